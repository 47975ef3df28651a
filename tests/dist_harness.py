"""Multi-process tests: run a module-level function on N gloo ranks (see megatron_patches.support.launch).

    from dist_harness import run_distributed
    results = run_distributed(my_rank_fn, world_size=2, kwargs={"seed": 3}, timeout_s=90)

A thin test adapter over the package's launcher (forkserver ranks with Megatron preloaded, one
thread each, gloo initialised, a headline naming the rank that failed first, every rank's
traceback and output tail on failure, a hang killed at the timeout with its Python stacks): a
failure is raised as `DistributedRunError`, an
AssertionError, so pytest reports it as a test failure rather than an error.

Each rank turns on the CPU/gloo layer (`megatron_patches.enable_cpu_support()`) before `fn`, and
runs the executor's p2p under strict NCCL semantics (`PREFIX_REUSE_P2P_STRICT`, see
megatron_patches/runtime/p2p.py) unless `strict_p2p=False`: on gloo a send that would wait for its
receiver on NCCL then waits too, so an ordering that deadlocks on a GPU cluster deadlocks here.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_patches.support.launch import DEFAULT_PRELOAD, LaunchError, launch

__all__ = ["run_distributed", "DistributedRunError", "DEFAULT_PRELOAD", "STRICT_P2P_DEFAULT"]

STRICT_P2P_DEFAULT = True
"""Whether ranks run the executor's p2p in strict mode unless told otherwise."""


class DistributedRunError(AssertionError):
    """A rank failed, died or timed out."""


def _rank_entry(fn: Callable, strict_p2p: bool, stall_s: Optional[float], args, kwargs):
    os.environ["PREFIX_REUSE_P2P_STRICT"] = "1" if strict_p2p else "0"
    if stall_s is not None:
        os.environ["PREFIX_REUSE_P2P_STRICT_STALL_S"] = str(stall_s)
    import megatron_patches

    megatron_patches.enable_cpu_support()
    return fn(*args, **kwargs)


def run_distributed(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 120.0,
                    collective_timeout_s: Optional[float] = None,
                    preload: Sequence[str] = DEFAULT_PRELOAD,
                    strict_p2p: Optional[bool] = None,
                    stall_s: Optional[float] = None) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return each rank's value, in order
    (`timeout_s` for the whole run, `collective_timeout_s` per collective: see launch.py).

    `stall_s`: strict mode's deadlock report after that many seconds without progress."""
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<" in qualname or "." in qualname:
        raise ValueError(f"{fn!r}: give a module-level function (ranks import it by name)")
    strict = STRICT_P2P_DEFAULT if strict_p2p is None else strict_p2p
    try:
        return launch(_rank_entry, world_size=world_size,
                      args=(fn, strict, stall_s, tuple(args), dict(kwargs or {})),
                      timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                      threads_per_rank=1, preload=preload)
    except LaunchError as error:
        raise DistributedRunError(str(error)) from None
