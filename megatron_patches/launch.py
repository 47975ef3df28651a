"""Run a function on N gloo processes on this machine and collect each rank's return value.

    from megatron_patches.launch import launch
    results = launch(my_rank_fn, world_size=4, args=(config,), timeout_s=900, threads_per_rank=1)

For tools (tools/bench.py --pp/--tp/--dp); tests use tests/dist_harness.py, which works the same
way and adds test-only checks. Each rank is a fresh process started by a multiprocessing
"forkserver" that imports `preload` once (so N ranks do not each re-import Megatron). Before `fn`
runs, a rank has RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set,
`threads_per_rank` intra-op threads, and the default process group initialised (gloo).
`fn` must be importable by name: a module-level function (of the main script too).

A rank that raises, dies, or does not finish within `timeout_s` (counted from the launch, start-up
included) fails the call with `LaunchError`, whose message holds every rank's traceback and the
tail of its output (captured per rank at the file-descriptor level). At a timeout every rank still
running first writes all its threads' Python stacks into its output (faulthandler), which shows
where a hang sits; then all are killed, so a hang never outlives the timeout. Importing this
module imports neither torch nor Megatron.
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

__all__ = ["launch", "LaunchError", "DEFAULT_PRELOAD"]

DEFAULT_PRELOAD = ("torch", "megatron_patches.models")
"""Modules the forkserver imports once; rank processes fork from it with them loaded."""

_TAIL_CHARS = 4000
_GRACE_S = 5.0  # after one rank failed, the others get this long before they are killed


class LaunchError(RuntimeError):
    """A rank failed, died or timed out; the message has every rank's traceback and output tail."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn, rank, world_size, port, workdir, args, kwargs, timeout_s, threads) -> None:
    """One rank: output to its log, env, gloo, run `fn`, pickle ("ok", value) or ("error", tb)."""
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks
    status = 1
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(threads)
        # Collectives wait longer than the run may take: the parent decides about hangs.
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=timeout_s + 60))
        outcome = ("ok", fn(*args, **kwargs), time.time())
        torch.distributed.barrier()  # rank 0 hosts the store: nobody leaves before all are done
        status = 0
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent
        # the time tells the rank that failed first from peers whose collectives then broke
        outcome = ("error", traceback.format_exc(), time.time())
    path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(outcome, f)
    except Exception:  # an unpicklable return value
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", traceback.format_exc(), time.time()), f)
        status = 1
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # never hang in interpreter shutdown (process-group teardown, dead peer)


def _outcome(workdir: str, rank: int) -> Optional[tuple]:
    path = os.path.join(workdir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_CHARS))
            return f.read().decode(errors="replace").rstrip()
    except OSError:
        return "(no output)"


def _wait(procs, workdir: str, timeout_s: float) -> tuple[Dict[int, Optional[tuple]], Optional[str]]:
    """Poll until every rank exits, or one failed (+ grace), or the deadline; (outcomes, why)."""
    deadline, failed_at, outcomes = time.monotonic() + timeout_s, None, {}
    while True:
        for rank, proc in enumerate(procs):
            if rank not in outcomes and not proc.is_alive():
                outcomes[rank] = _outcome(workdir, rank)
                if failed_at is None and (outcomes[rank] is None or outcomes[rank][0] != "ok"):
                    failed_at = time.monotonic()
        if len(outcomes) == len(procs):
            return outcomes, None if failed_at is None else _first_failure(outcomes)
        now = time.monotonic()
        if now > deadline:
            return outcomes, f"timed out after {timeout_s:.0f} s (hang? raise --timeout if not)"
        if failed_at is not None and now > failed_at + _GRACE_S:
            return outcomes, (_first_failure(outcomes) + "; the others were killed after a grace "
                              "period")
        time.sleep(0.05)


def _first_failure(outcomes: Dict[int, Optional[tuple]]) -> str:
    """Which rank's error came first; ranks that exited without a result count after them."""
    failed = {r: o[2] for r, o in outcomes.items() if o is not None and o[0] != "ok"}
    if failed:
        return f"rank {min(failed, key=failed.get)} failed first"
    silent = ",".join(str(r) for r, o in sorted(outcomes.items()) if o is None)
    # e.g. `fn` could not be unpickled: the forkserver printed that traceback to our stderr
    return f"rank(s) {silent} exited without a result (see stderr above)"


def _stop(procs, dump_stacks: bool) -> None:
    alive = [p for p in procs if p.is_alive()]
    if dump_stacks and alive:
        for proc in alive:
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
    for proc in alive:
        proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _report(fn, workdir: str, procs, outcomes, why: str) -> str:
    lines = [f"{fn.__module__}.{fn.__qualname__} over {len(procs)} ranks: {why}"]
    for rank, proc in enumerate(procs):
        outcome = outcomes.get(rank)
        state = "ok" if outcome and outcome[0] == "ok" else f"exit code {proc.exitcode}"
        lines.append(f"---- rank {rank} ({state})")
        if outcome and outcome[0] == "error":
            lines.append(outcome[1].rstrip())
        log = _tail(os.path.join(workdir, f"rank{rank}.log"))
        if log:
            lines.append(f"-- rank {rank} output (tail):\n{log}")
    return "\n".join(lines)


def _check_args(fn, world_size, timeout_s, threads_per_rank) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; give an int >= 1")
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank={threads_per_rank!r}; give an int >= 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}; give a number of seconds > 0")
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<" in qualname or "." in qualname:
        raise ValueError(f"{fn!r}: give a module-level function (ranks import it by name)")


def launch(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
           kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 900.0,
           threads_per_rank: int = 1, preload: Sequence[str] = DEFAULT_PRELOAD) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return each rank's value, in order.

    ValueError for bad arguments (before anything starts); LaunchError when a rank fails, dies or
    the run exceeds `timeout_s` seconds (see the module docstring).
    """
    _check_args(fn, world_size, timeout_s, threads_per_rank)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # no effect once the server runs
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="launch_") as workdir:
        procs = [context.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                                 args=(fn, rank, world_size, port, workdir, tuple(args),
                                       dict(kwargs or {}), timeout_s, threads_per_rank))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        why = "interrupted"
        try:
            outcomes, why = _wait(procs, workdir, timeout_s)
        finally:
            _stop(procs, dump_stacks=why is not None)
        if why is not None:
            outcomes.update({r: _outcome(workdir, r) for r in range(world_size) if r not in outcomes})
            raise LaunchError(_report(fn, workdir, procs, outcomes, why))
        return [outcomes[rank][1] for rank in range(world_size)]
