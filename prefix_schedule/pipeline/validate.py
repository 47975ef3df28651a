"""The validator: every rule of [Note: prefix-reuse dependency rules] (ir.py), one place.

Failures are `ScheduleError`s whose message holds the per-rank grid with the failing step marked.
"""

from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence

from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, ScheduleError, format_grid,
                                         peer_dependency)
from prefix_schedule.pipeline.units import StepShape

__all__ = ["validate_schedule"]


def _local_rule(action: Action, done: set, shape: StepShape) -> Optional[str]:
    """Why `action` may not run yet on its stage given the stage's `done` (kind, index) set."""
    need = shape.local_needs(action.kind.value, action.index)
    missing = [f"{action.stage}{code}{j}" for code, j in need if (ActionKind(code), j) not in done]
    return f"runs before {', '.join(missing)} on its stage" if missing else None


def validate_schedule(schedule: Schedule, *, microbatch_groups: Sequence[Sequence[int]],
                      prefix_groups: Collection[int],
                      prefix_units: Optional[Mapping[int, tuple[int, int]]] = None) -> None:
    """Check every rule of [Note: prefix-reuse dependency rules]; p2p actions are skipped here
    (the simulator checks them). `prefix_units`: unit -> (group, chunk) of a chunked step
    ([Note: prefix chunks] in units.py). Raises ScheduleError with the grid and the failing step
    marked."""
    shape = StepShape(microbatch_groups=microbatch_groups, prefix_groups=prefix_groups,
                      prefix_units=prefix_units)
    kinds = ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_FORWARD, \
        ActionKind.PREFIX_BACKWARD
    required = {(k, m) for m in range(len(shape.microbatch_groups)) for k in kinds[:2]} | {
        (k, u) for u in shape.units for k in kinds[2:]}
    for s, row in enumerate(schedule.actions):
        done: set = set()
        for i, action in enumerate(row):
            problem = _row_problem(action, s, done, required, shape)
            if problem:
                _fail(schedule, {(s, i): problem}, f"rank {s} step {i}: {action} {problem}")
            if action.kind.is_compute:
                done.add((action.kind, action.index))
        missing = sorted(f"{s}{k.value}{j}" for k, j in required - done)
        if missing:
            _fail(schedule, {(s, len(row)): f"missing {' '.join(missing)}"},
                  f"rank {s} never runs {', '.join(missing)}")
    _check_progress(schedule)


def _row_problem(action, s, done, required, shape) -> Optional[str]:
    if action.stage != s:
        return f"belongs to stage {action.stage} but sits in rank {s}'s row"
    if not action.kind.is_compute:
        return None
    if (action.kind, action.index) not in required:
        what = "group with a cached prefix" if action.kind.value[0] == "P" else "microbatch"
        return f"names no {what} of this step"
    if (action.kind, action.index) in done:
        return "runs twice"
    return _local_rule(action, done, shape)


def _check_progress(schedule: Schedule) -> None:
    """Walk all rows together, each action waiting for its peer dependency; stuck means deadlock."""
    num, rows = schedule.num_stages, schedule.actions
    pos, done = [0] * num, set()
    progress = True
    while progress:
        progress = False
        for s in range(num):
            while pos[s] < len(rows[s]):
                action = rows[s][pos[s]]
                dep = peer_dependency(action, num) if action.kind.is_compute else None
                if dep is not None and dep not in done:
                    break
                done.add((s, action.kind, action.index))
                pos[s], progress = pos[s] + 1, True
    stuck = {(s, pos[s]): "waits for " + "{}{}{}".format(dep[0], dep[1].value, dep[2])
             for s in range(num) if pos[s] < len(rows[s])
             for dep in [peer_dependency(rows[s][pos[s]], num)]}
    if stuck:
        _fail(schedule, stuck, "deadlock: every unfinished rank waits on another")


def _fail(schedule: Schedule, marks: Mapping[tuple[int, int], str], headline: str) -> None:
    raise ScheduleError(f"{headline}\n{format_grid(schedule, marks)}")
