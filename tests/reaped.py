"""`run_reaped`: `subprocess.run` for commands that start process trees (torchrun), ending every
process the command started.

torchrun starts each rank in a session of its own (`start_new_session=True`), so killing torchrun
-- `subprocess.run`'s timeout, pytest's -- does not reach its ranks: they live on as orphans
(a stalled one forever). `run_reaped` records the command's descendants while it runs and, when
the command ends or its time is up, kills whichever of them are still alive.
"""

from __future__ import annotations

import subprocess
import time
from typing import List, Sequence

import psutil

__all__ = ["run_reaped"]

_POLL_S = 0.5


def run_reaped(command: Sequence[str], *, timeout: float, **popen_kwargs):
    """Like `subprocess.run(command, capture_output=True, text=True, timeout=timeout)`; the
    result also has `descendants` (every process seen under the command), none alive on return.
    Raises subprocess.TimeoutExpired after ending them all, when the time is up."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen_kwargs)
    seen: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                _record(proc.pid, seen)
                if proc.poll() is not None:  # it ended; orphans of it still hold its pipes
                    _end(proc, list(seen.values()))
                    out, err = proc.communicate()
                    break
                if time.monotonic() > deadline:  # the ranks first: they hold the pipes too
                    _end(proc, list(seen.values()))
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(command, timeout, out, err) from None
    finally:
        _end(proc, list(seen.values()))
    result = subprocess.CompletedProcess(list(command), proc.returncode, out, err)
    result.descendants = list(seen.values())
    return result


def _record(pid: int, seen: dict) -> None:
    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen.setdefault((child.pid, child.create_time()), child)
    except psutil.Error:  # the command ended between two polls
        pass


def _end(proc: subprocess.Popen, descendants: List[psutil.Process]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for child in descendants:
        try:
            if child.is_running():  # the same process (pid and start time), not a reused pid
                child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=10)
