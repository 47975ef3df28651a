"""Which rank failed first: what every launcher we ship puts in its headline.

When one rank of a job fails, its peers fail too, a little later, inside a collective or p2p that
can no longer complete (gloo: "Connection reset by peer", or "Timed out waiting ..." once the
process-group timeout passes; NCCL: a DistBackendError or the watchdog). Blaming the earliest
Python error would name such a victim whenever the real cause left no error behind (a rank
killed by a signal, or one that stalls). So a rank's end is one of, in order of blame:

1. `died`: it exited on its own without a result (a signal such as SIGKILL, os._exit, a crash);
2. `error`: its own code raised (not a broken or timed-out collective);
3. `stalled`: it was still running when its peers' collectives failed or the job's time ran out
   (or, seen from inside a job: it never reported an end);
4. `collective`: a collective or p2p failed under it (the peer's fault, not its own);
and the first failure is the earliest end of the best class (every rank of it for `stalled`).

`report_first_failure` does this from inside a torchrun job (examples/train_grpo_megatron.py),
through the job's TCPStore; megatron_patches/support/launch.py does it from the parent process.
Importing this module imports neither torch nor Megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Iterator, List, Sequence

__all__ = ["RankEnd", "RankFailure", "classify", "one_line", "first_failures", "headline",
           "report_first_failure", "COLLECTIVE_TIMEOUT_ENV", "collective_timeout_s"]

COLLECTIVE_TIMEOUT_ENV = "PREFIX_REUSE_COLLECTIVE_TIMEOUT_S"
"""Seconds a collective or p2p may wait for its peers before it fails (the process-group timeout
of every group the job creates); read by the launchers and `models.initialize_distributed`."""

_BLAME = {"died": 0, "error": 1, "stalled": 2, "collective": 3}
# gloo raises plain RuntimeErrors from its transport; NCCL / c10d raise DistError subclasses
_COLLECTIVE_MARKERS = ("gloo/transport/", "Connection reset by peer", "Connection closed by peer",
                       "Timed out waiting", "Broken pipe")


def collective_timeout_s(default: float) -> float:
    """The collective timeout: `$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S` if set, else `default`."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if text is None:
        return float(default)
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={text!r}; give a number of seconds > 0")
    return value


class RankFailure(RuntimeError):
    """Raised by `report_first_failure` from a rank's failure; its message is the headline."""


@dataclasses.dataclass(frozen=True)
class RankEnd:
    """How one rank of a job ended."""

    rank: int
    state: str
    """"ok", or one of the failure classes of the module docstring."""
    time: float
    """Wall-clock time of the end (for `stalled`: when it was found still running)."""
    detail: str = ""
    """One line: the exception, the signal, where it was."""


def classify(exc: BaseException) -> str:
    """"collective" for a failed or timed-out collective / p2p, else "error"."""
    try:
        import torch.distributed

        if isinstance(exc, torch.distributed.DistError):
            return "collective"
    except ImportError:  # pragma: no cover - torch is always there in a rank
        pass
    text = str(exc)
    return "collective" if any(m in text for m in _COLLECTIVE_MARKERS) else "error"


def first_failures(ends: Sequence[RankEnd]) -> List[RankEnd]:
    """The rank(s) to blame: the earliest end of the best failure class; [] if all are ok."""
    failed = [e for e in ends if e.state != "ok"]
    if not failed:
        return []
    best = min(_BLAME[e.state] for e in failed)
    ranked = sorted((e for e in failed if _BLAME[e.state] == best), key=lambda e: e.time)
    return ranked if ranked[0].state == "stalled" else ranked[:1]


def headline(ends: Sequence[RankEnd]) -> str:
    """One line naming the rank that failed first, e.g. "rank 1 failed first (killed by
    SIGKILL ...)" or "rank 1 stalled (...)"; "no rank failed" when all are ok."""
    first = first_failures(ends)
    if not first:
        return "no rank failed"
    if first[0].state == "stalled":
        names = ", ".join(str(e.rank) for e in first)
        return f"rank{'s' if len(first) > 1 else ''} {names} stalled ({first[0].detail})"
    return f"rank {first[0].rank} failed first ({first[0].detail})"


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (at most 300 characters of it)."""
    line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {line[:300]}"


@contextlib.contextmanager
def report_first_failure(store, rank: int, world_size: int, *, wait_s: float = 5.0,
                         key: str = "prefix_reuse/end") -> Iterator[None]:
    """Around one rank's work in a job that shares `store` (a torch.distributed Store): every
    rank records how it ended; a rank that fails waits up to `wait_s` for the others' records,
    prints the headline (stderr) and raises `RankFailure(headline)` from its error, naming ranks
    that recorded nothing as stalled (still running, or killed). So torchrun's own summary (with
    `@record` on main) shows the headline too. The store must outlive rank 0 if rank 0 may be
    the one that dies (torchrun hosts it in its agent)."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        _record(store, f"{key}/{rank}", RankEnd(rank, classify(exc), time.time(), one_line(exc)))
        line = f"[rank {rank}] {headline(_gather(store, key, world_size, wait_s))}"
        print(line, file=sys.stderr, flush=True)
        raise RankFailure(line) from exc
    _record(store, f"{key}/{rank}", RankEnd(rank, "ok", time.time()))


def _record(store, key: str, end: RankEnd) -> None:
    with contextlib.suppress(Exception):  # a dead store must not hide the real error
        store.set(key, f"{end.state}|{end.time!r}|{end.detail}")


def _gather(store, key: str, world_size: int, wait_s: float) -> List[RankEnd]:
    deadline = time.monotonic() + wait_s
    ends = {}
    while True:
        for rank in range(world_size):
            if rank in ends:
                continue
            with contextlib.suppress(Exception):
                if store.check([f"{key}/{rank}"]):
                    state, stamp, detail = store.get(f"{key}/{rank}").decode().split("|", 2)
                    ends[rank] = RankEnd(rank, state, float(stamp), detail)
        if len(ends) == world_size or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    silent = f"no end recorded within {wait_s:.0f} s of a peer's failure: stalled or killed"
    return [ends.get(r, RankEnd(r, "stalled", time.time(), silent)) for r in range(world_size)]
