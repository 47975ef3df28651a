"""Run a function on N gloo processes on this machine and collect each rank's return value.

    from megatron_patches.support.launch import launch
    results = launch(my_rank_fn, world_size=4, args=(config,), timeout_s=900, threads_per_rank=1)

For tools (tools/bench.py --pp/--tp/--dp); tests use tests/dist_harness.py, which works the same
way and adds test-only checks. Each rank is a fresh process started by a multiprocessing
"forkserver" that imports `preload` once (so N ranks do not each re-import Megatron). Before `fn`
runs, a rank has RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set,
`threads_per_rank` intra-op threads, and the default process group initialised: gloo, or with
`backend="nccl"` (or `"auto"` on a machine with CUDA) NCCL with one GPU per rank
(`torch.cuda.set_device(LOCAL_RANK)`; `rank_backend`).
`fn` must be importable by name: a module-level function (of the main script too).

Two timeouts end a stalled job. `timeout_s` bounds the whole run (start-up included): at that
point every rank still running writes all its threads' Python stacks into its output
(faulthandler) and is killed, so a hang never outlives it. `collective_timeout_s` (default
`$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S`, else max(timeout_s / 2, 10 s)) is the process-group
timeout: a collective or p2p that waits longer for a peer fails, in the default group and in
Megatron's groups (`models.initialize_distributed` reads it from the environment the launcher
sets). Once any rank failed, the others get a few seconds to finish, then are killed.

A failure raises `LaunchError`, whose headline names the rank that failed first
(megatron_patches/support/failures.py: a rank that died without a result, e.g. by SIGKILL, before one
whose own code raised, before one that stalled -- still running when its peers' collectives
broke -- before one whose collective broke under it), followed by every rank's traceback and
the tail of its output (captured per rank at the file-descriptor level). Importing this module
imports neither torch nor Megatron.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_patches.support.failures import (COLLECTIVE_TIMEOUT_ENV, RankEnd, classify,
                                       collective_timeout_s, one_line)
from megatron_patches.support.failures import headline as failure_headline

__all__ = ["launch", "LaunchError", "DEFAULT_PRELOAD", "rank_backend"]

DEFAULT_PRELOAD = ("torch", "megatron_patches.models.tiny")
"""Modules the forkserver imports once; rank processes fork from it with them loaded."""

_TAIL_CHARS = 4000
_GRACE_S = 5.0  # after one rank failed, the others get this long before they are killed


class LaunchError(RuntimeError):
    """A rank failed, died or timed out; the message has every rank's traceback and output tail."""


def rank_backend(backend: str, local_rank: int, cuda_devices: int) -> Tuple[str, Optional[int]]:
    """(process-group backend, CUDA device of this rank or None) for `backend` "gloo", "nccl"
    or "auto" (NCCL when this machine has CUDA devices, else gloo), on a machine with
    `cuda_devices` GPUs. NCCL gets one device per local rank; ValueError when there is none."""
    if backend not in ("gloo", "nccl", "auto"):
        raise ValueError(f"backend={backend!r}; give 'gloo', 'nccl' or 'auto'")
    if backend == "gloo" or (backend == "auto" and cuda_devices == 0):
        return "gloo", None
    if local_rank >= cuda_devices:
        raise ValueError(f"NCCL needs one CUDA device per rank: local rank {local_rank} of a "
                         f"machine with {cuda_devices} device(s); start at most {cuda_devices} "
                         "ranks per machine, or use backend='gloo' (CPU)")
    return "nccl", local_rank


def _rank_main(fn, rank, world_size, port, workdir, args, kwargs, timeouts, threads,
               backend="gloo") -> None:
    """One rank: output to its log, env, gloo or NCCL (`rank_backend`), run `fn`, pickle ("ok",
    value, time) or (failure class, traceback, time, one-line detail); then wait until every
    rank is done."""
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks
    run_timeout_s, collective_s = timeouts
    status, store = 1, None
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          **{COLLECTIVE_TIMEOUT_ENV: repr(collective_s)})
        import torch

        torch.set_num_threads(threads)
        backend, device = rank_backend(backend, rank, torch.cuda.device_count()
                                       if backend != "gloo" else 0)
        if device is not None:
            torch.cuda.set_device(device)
        # The launcher hosts the store (its port is bound once: no other process can take it
        # between choosing and listening). Every rank waits there for all (start-up may be
        # slow); once all are there, the collective timeout applies to the default group, its
        # rendezvous included.
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, world_size, is_master=False,
            timeout=datetime.timedelta(seconds=run_timeout_s + 60))
        if store.add("launch/started", 1) == world_size:
            store.set("launch/all_started", "1")
        store.wait(["launch/all_started"])
        torch.distributed.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_s))
        outcome = ("ok", fn(*args, **kwargs), time.time())
        status = 0
    except BaseException as exc:  # noqa: BLE001 -- everything goes back to the parent
        outcome = (classify(exc), traceback.format_exc(), time.time(), one_line(exc))
    _write_outcome(workdir, rank, outcome)
    sys.stdout.flush()
    sys.stderr.flush()
    if status == 0 and store is not None:
        # nobody leaves before all are done (the parent kills the waiting ranks if a peer
        # fails)
        with contextlib.suppress(Exception):
            if store.add("launch/finished", 1) == world_size:
                store.set("launch/all_finished", "1")
            store.wait(["launch/all_finished"])
    os._exit(status)  # never hang in interpreter shutdown (process-group teardown, dead peer)


def _write_outcome(workdir: str, rank: int, outcome: tuple) -> None:
    path = os.path.join(workdir, f"rank{rank}.pkl")
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(outcome, f)
    except Exception:  # an unpicklable return value
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("error", traceback.format_exc(), time.time(),
                         "the return value could not be pickled"), f)
    os.replace(path + ".tmp", path)


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


def _wait(procs, workdir: str, timeout_s: float, exits: Dict[int, float]) -> Optional[str]:
    """Poll until every rank exits (None), or one failed + grace ("failed"), or the deadline
    ("deadline"); `exits` gets the wall-clock time each rank was first seen dead."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while True:
        for rank, proc in enumerate(procs):
            if rank not in exits and not proc.is_alive():
                exits[rank] = time.time()
                outcome = _outcome(workdir, rank)
                if failed_at is None and (outcome is None or outcome[0] != "ok"):
                    failed_at = time.monotonic()
        if len(exits) == len(procs):
            return None if failed_at is None else "failed"
        now = time.monotonic()
        if now > deadline:
            return "deadline"
        if failed_at is not None and now > failed_at + _GRACE_S:
            return "failed"
        time.sleep(0.05)


def _stop(procs, workdir: str) -> Dict[int, float]:
    """Kill every rank still running (after asking those without a result for their stacks);
    returns rank -> time of the kill, for the ranks that had not finished `fn`."""
    alive = {rank: p for rank, p in enumerate(procs) if p.is_alive()}
    unfinished = {rank: time.time() for rank in alive if _outcome(workdir, rank) is None}
    if unfinished:
        for rank in unfinished:
            os.kill(alive[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)
    for proc in alive.values():
        proc.kill()
    for proc in procs:
        proc.join(timeout=10)
    return unfinished


def _ends(procs, workdir: str, exits: Dict[int, float], killed: Dict[int, float],
          why: Optional[str]) -> List[RankEnd]:
    """How each rank ended (megatron_patches/support/failures.py)."""
    ends = []
    for rank, proc in enumerate(procs):
        outcome = _outcome(workdir, rank)
        if outcome is not None:
            detail = outcome[3] if len(outcome) > 3 else ""
            ends.append(RankEnd(rank, outcome[0], outcome[2], detail))
        elif rank in killed:
            when = ("the run's timeout passed" if why == "deadline"
                    else "its peers had failed")
            ends.append(RankEnd(rank, "stalled", killed[rank],
                                f"still running when {when}; its stack is in its output"))
        else:
            code = proc.exitcode
            how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            ends.append(RankEnd(rank, "died", exits.get(rank, time.time()),
                                f"{how} without a result; see its output and stderr above"))
    return ends


def _report(fn, workdir: str, ends: List[RankEnd], why: str, timeout_s: float) -> str:
    first = failure_headline(ends)
    if why == "deadline":
        first = f"timed out after {timeout_s:.0f} s: {first}"
    lines = [f"{fn.__module__}.{fn.__qualname__} over {len(ends)} ranks: {first}"]
    for end in ends:
        lines.append(f"---- rank {end.rank} ({end.state}{': ' + end.detail if end.detail else ''})")
        outcome = _outcome(workdir, end.rank)
        if outcome and outcome[0] != "ok":
            lines.append(outcome[1].rstrip())
        log = _tail(os.path.join(workdir, f"rank{end.rank}.log"))
        if log:
            lines.append(f"-- rank {end.rank} output (tail):\n{log}")
    return "\n".join(lines)


def _check_args(fn, world_size, timeout_s, collective_s, threads_per_rank) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; give an int >= 1")
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank={threads_per_rank!r}; give an int >= 1")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r}; give a number of seconds > 0")
    if not collective_s > 0:
        raise ValueError(f"collective_timeout_s={collective_s!r}; give a number of seconds > 0")
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<" in qualname or "." in qualname:
        raise ValueError(f"{fn!r}: give a module-level function (ranks import it by name)")


def launch(fn: Callable, *, world_size: int, args: Sequence[Any] = (),
           kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 900.0,
           collective_timeout_s: Optional[float] = None, threads_per_rank: int = 1,
           preload: Sequence[str] = DEFAULT_PRELOAD, backend: str = "gloo") -> List[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return each rank's value, in order.
    `backend`: "gloo", "nccl" or "auto" (`rank_backend`: NCCL with one GPU per rank when CUDA
    is available).

    ValueError for bad arguments (before anything starts); LaunchError when a rank fails, dies,
    stalls or the run exceeds `timeout_s` seconds; `collective_timeout_s`: see the module
    docstring.
    """
    if collective_timeout_s is None:
        collective_timeout_s = collective_timeout_s_default(timeout_s)
    _check_args(fn, world_size, timeout_s, collective_timeout_s, threads_per_rank)
    if backend != "gloo":  # every rank needs its GPU: refuse before anything starts
        import torch

        rank_backend(backend, world_size - 1, torch.cuda.device_count())
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))  # no effect once the server runs
    import torch

    # the ranks' store, listening from here on an OS-chosen port until every rank has ended
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, is_master=True,
                                       wait_for_workers=False)
    port = store.port
    timeouts = (float(timeout_s), float(collective_timeout_s))
    with tempfile.TemporaryDirectory(prefix="launch_") as workdir:
        procs = [context.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                                 args=(fn, rank, world_size, port, workdir, tuple(args),
                                       dict(kwargs or {}), timeouts, threads_per_rank,
                                       backend))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        why, exits, killed = "interrupted", {}, {}
        try:
            why = _wait(procs, workdir, timeout_s, exits)
        finally:
            killed = _stop(procs, workdir)
        if why is not None:
            ends = _ends(procs, workdir, exits, killed, why)
            raise LaunchError(_report(fn, workdir, ends, why, timeout_s))
        return [_outcome(workdir, rank)[1] for rank in range(world_size)]


def collective_timeout_s_default(timeout_s: float) -> float:
    """`$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S`, else max(timeout_s / 2, 10): a peer that keeps a
    collective waiting for half the run has stalled."""
    return collective_timeout_s(max(float(timeout_s) / 2, 10.0))
