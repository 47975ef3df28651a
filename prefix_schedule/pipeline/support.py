"""Helpers of the schedule layer that know nothing of its IR: argument checks, the per-rank grid
printer, and running allocation-heavy passes with the cyclic garbage collector paused."""

from __future__ import annotations

import functools
import gc
from typing import Mapping, Optional

__all__ = ["check_count", "format_grid", "without_gc"]


def check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def without_gc(fn):
    """Run `fn` with CPython's cyclic collector paused. Planning a big step builds hundreds of
    thousands of small tuples that hold no cycles; the collector would rescan them all, over and
    over, as they pile up (more than half of the lowering's time at 4,096 groups). Reference
    counting still frees everything; cycles (the NCCL dry run's op pairs) wait for the next
    collection after `fn` returns."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


def format_grid(schedule, marks: Optional[Mapping[tuple[int, int], str]] = None,
                *, width: int = 16) -> str:
    """Per-rank grid by step; `marks[(rank, step)]` flags a cell with `>...<` and a note below.

    A mark at step == len(row) flags the end of the row (something is missing there)."""
    marks = dict(marks or {})
    cells = [[str(a) for a in row] + (["(end)"] if (s, len(row)) in marks else [])
             for s, row in enumerate(schedule.actions)]
    num_steps = max((len(row) for row in cells), default=0)
    cell_w = max([len(c) for row in cells for c in row] + [4]) + 2
    lines = []
    for lo in range(0, max(num_steps, 1), width):
        steps = range(lo, min(lo + width, num_steps))
        lines.append("step  " + "".join(f"{i:^{cell_w}}" for i in steps))
        for s, row in enumerate(cells):
            text = [(f">{row[i]}<" if (s, i) in marks else f" {row[i]} ") if i < len(row) else ""
                    for i in steps]
            lines.append(f"rank{s:<2}" + "".join(f"{c:^{cell_w}}" for c in text).rstrip())
    lines += [f"  rank {s} step {i}: {note}" for (s, i), note in sorted(marks.items())]
    return "\n".join(lines)
