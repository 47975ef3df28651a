"""Run a module-level function in N processes on one machine (gloo), for multi-process tests.

    from dist_harness import run_distributed
    results = run_distributed(my_rank_fn, world_size=2, kwargs={"seed": 3}, timeout_s=90)

Each rank is a fresh process (multiprocessing "forkserver": the server imports `preload` once per
test session, so a rank starts in well under a second instead of re-importing Megatron). Before
`fn` runs, a rank has RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set (a free
port), one intra-op thread, and the default process group initialised (gloo, collectives time
out after `timeout_s`). `fn(*args, **kwargs)` runs; its return value is pickled back; the list of
every rank's value is returned in rank order.

A rank that raises, dies, or does not finish within `timeout_s` fails the call with
`DistributedRunError`, whose message holds every rank's traceback and the tail of its
stdout/stderr (captured per rank at the file-descriptor level); ranks still running at that point
first print every thread's Python stack there (faulthandler), which shows where a hang sits. Once
one rank has failed the others get `grace_s` to finish, then are killed: a hang can never outlive
the timeout. Ranks wait for each other in a barrier before they exit.
`fn` must be importable by name (a module-level function of an importable module, e.g. a test
module), not a lambda or a nested function.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["run_distributed", "DistributedRunError", "DEFAULT_PRELOAD"]

DEFAULT_PRELOAD = ("torch", "megatron_patches.models")
"""Modules the forkserver imports once per session (rank processes fork from it)."""

_LOG_TAIL_CHARS = 4000
_STARTUP_S = 180.0  # the first start of a session imports DEFAULT_PRELOAD on a busy machine


class DistributedRunError(AssertionError):
    """A rank failed, died or timed out (an AssertionError so pytest reports it as a failure)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, workdir, args, kwargs, timeout_s, init_process_group):
    """Entry point of one rank: redirect output, set the env, init gloo, run, pickle the result."""
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()  # a crash prints the Python stack into the log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks at a hang
    open(os.path.join(workdir, f"rank{rank}.started"), "w").close()  # the run clock starts now
    status = 1
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(1)  # N ranks share the machine's cores
        if init_process_group:
            torch.distributed.init_process_group(
                "gloo", rank=rank, world_size=world_size,
                init_method=f"tcp://127.0.0.1:{port}",
                # longer than the run: the parent decides about hangs (and collects stacks)
                timeout=datetime.timedelta(seconds=timeout_s + 60))
        outcome = ("ok", fn(*args, **kwargs))
        if init_process_group:
            # rank 0 hosts the rendezvous store: nobody leaves before everybody is done
            torch.distributed.barrier()
        status = 0
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent
        outcome = ("error", traceback.format_exc())
    path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(outcome, f)
    except Exception:  # an unpicklable return value
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        status = 1
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: never hang in interpreter shutdown (process-group teardown with a dead peer)
    os._exit(status)


def _check_importable(fn: Callable) -> None:
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<" in qualname or "." in qualname:
        raise ValueError(f"{fn!r}: give a module-level function (rank processes import it by name)")


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_CHARS))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no output)"


def _outcome(workdir: str, rank: int) -> Optional[tuple]:
    path = os.path.join(workdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _report(fn, workdir, procs, outcomes, headline) -> str:
    lines = [f"{fn.__module__}.{fn.__qualname__} over {len(procs)} ranks: {headline}"]
    for rank, proc in enumerate(procs):
        outcome = outcomes.get(rank)
        state = "ok" if outcome and outcome[0] == "ok" else f"exit code {proc.exitcode}"
        lines.append(f"---- rank {rank} ({state})")
        if outcome and outcome[0] == "error":
            lines.append(outcome[1].rstrip())
        log = _tail(os.path.join(workdir, f"rank{rank}.log")).rstrip()
        if log:
            lines.append(f"-- rank {rank} stdout/stderr (tail):\n{log}")
    return "\n".join(lines)


def _wait(procs, workdir, timeout_s: float, grace_s: float) -> tuple:
    """Poll until all ranks exit, one fails (then grace), or the deadline; returns (outcomes, why).

    The deadline counts from when every rank has started (the forkserver's first start imports
    the preload modules, which is not the run's time); starting may take _STARTUP_S at most.
    """
    deadline, failed_at, outcomes = time.monotonic() + _STARTUP_S, None, {}
    started = False
    while True:
        if not started and all(os.path.exists(os.path.join(workdir, f"rank{r}.started"))
                               for r in range(len(procs))):
            started, deadline = True, time.monotonic() + timeout_s
        for rank, proc in enumerate(procs):
            if rank not in outcomes and not proc.is_alive():
                outcomes[rank] = _outcome(workdir, rank)
                if failed_at is None and (outcomes[rank] is None or outcomes[rank][0] != "ok"):
                    failed_at = time.monotonic()
        if len(outcomes) == len(procs):
            return outcomes, None if failed_at is None else "a rank failed"
        now = time.monotonic()
        if now > deadline:
            if not started:
                return outcomes, f"the ranks did not start within {_STARTUP_S:.0f} s"
            return outcomes, f"timed out after {timeout_s:.0f} s (hang?)"
        if failed_at is not None and now > failed_at + grace_s:
            return outcomes, "a rank failed; the others were killed after the grace period"
        time.sleep(0.05)


def _dump_stacks(procs) -> None:
    """SIGUSR1 -> faulthandler writes every thread's Python stack into the rank's log."""
    alive = [proc for proc in procs if proc.is_alive()]
    for proc in alive:
        os.kill(proc.pid, signal.SIGUSR1)
    if alive:
        time.sleep(1.0)


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
                    kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 120.0,
                    grace_s: float = 5.0, init_process_group: bool = True,
                    preload: Sequence[str] = DEFAULT_PRELOAD) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return each rank's value, in order.

    Raises ValueError for a bad world size or a function that cannot be imported by name, and
    DistributedRunError (with every rank's traceback and output tail) when a rank fails or the
    run exceeds `timeout_s` seconds (counted once every rank has started).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; give an int >= 1")
    if timeout_s <= 0 or grace_s < 0:
        raise ValueError("timeout_s must be > 0 and grace_s >= 0")
    _check_importable(fn)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # no effect once the server runs (first call)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="dist_harness_") as workdir:
        procs = [context.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                                 args=(fn, rank, world_size, port, workdir, tuple(args),
                                       dict(kwargs or {}), timeout_s, init_process_group))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        try:
            outcomes, why = _wait(procs, workdir, timeout_s, grace_s)
            if why is not None:
                _dump_stacks(procs)
        finally:
            _kill(procs)
        if why is not None:
            outcomes.update({r: _outcome(workdir, r) for r in range(world_size) if r not in outcomes})
            raise DistributedRunError(_report(fn, workdir, procs, outcomes, why))
        return [outcomes[rank][1] for rank in range(world_size)]
