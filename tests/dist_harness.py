"""Multi-process tests: run a module-level function on N gloo ranks (see megatron_patches.launch).

    from dist_harness import run_distributed
    results = run_distributed(my_rank_fn, world_size=2, kwargs={"seed": 3}, timeout_s=90)

A thin test adapter over the package's launcher (forkserver ranks with Megatron preloaded, one
thread each, gloo initialised, a headline naming the rank that failed first, every rank's
traceback and output tail on failure, a hang killed at the timeout with its Python stacks): a failure is raised as `DistributedRunError`, an
AssertionError, so pytest reports it as a test failure rather than an error.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_patches.launch import DEFAULT_PRELOAD, LaunchError, launch

__all__ = ["run_distributed", "DistributedRunError", "DEFAULT_PRELOAD"]


class DistributedRunError(AssertionError):
    """A rank failed, died or timed out."""


def run_distributed(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 120.0,
                    collective_timeout_s: Optional[float] = None,
                    preload: Sequence[str] = DEFAULT_PRELOAD) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return each rank's value, in order
    (`timeout_s` for the whole run, `collective_timeout_s` per collective: see launch.py)."""
    try:
        return launch(fn, world_size=world_size, args=args, kwargs=kwargs, timeout_s=timeout_s,
                      collective_timeout_s=collective_timeout_s, threads_per_rank=1,
                      preload=preload)
    except LaunchError as error:
        raise DistributedRunError(str(error)) from None
