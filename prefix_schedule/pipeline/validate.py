"""The validator: every rule of [Note: prefix-reuse dependency rules] (ir.py), one place.

Rules hold per virtual stage ([Note: virtual stages]): each stage of a rank runs its own PF/SF/
SB/PB set, and row r may hold only actions of rank r's stages. Failures are `ScheduleError`s
whose message holds the per-rank grid with the failing step marked.
"""

from __future__ import annotations

from typing import Collection, Mapping, Optional, Sequence

from prefix_schedule.pipeline.ir import ActionKind, Schedule, ScheduleError, format_grid, without_gc
from prefix_schedule.pipeline.units import StepShape

__all__ = ["validate_schedule"]

_PF, _SF = ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD
_SB, _PB = ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD


@without_gc
def validate_schedule(schedule: Schedule, *, microbatch_groups: Sequence[Sequence[int]],
                      prefix_groups: Collection[int],
                      prefix_units: Optional[Mapping[int, tuple[int, int]]] = None,
                      unit_parents: Optional[Mapping[int, Optional[int]]] = None) -> None:
    """Check every rule of [Note: prefix-reuse dependency rules]; p2p actions are skipped here
    (the simulator checks them). `prefix_units`: unit -> (group, chunk) of a chunked step
    ([Note: prefix chunks] in units.py). Raises ScheduleError with the grid and the failing step
    marked."""
    shape = StepShape(microbatch_groups=microbatch_groups, prefix_groups=prefix_groups,
                      prefix_units=prefix_units, unit_parents=unit_parents)
    num_mb = len(shape.microbatch_groups)
    required = {_SF: range(num_mb), _SB: range(num_mb), _PF: shape.units, _PB: shape.units}
    for r, row in enumerate(schedule.actions):
        done = {s: set() for s in schedule.stages_of(r)}
        for i, action in enumerate(row):
            kind = action[1]
            ran = done.get(action[0])
            if ran is None or (kind.is_compute and _breaks_rule(action, ran, required, shape)):
                problem = _row_problem(schedule, action, r, done, required, shape)
                _fail(schedule, {(r, i): problem}, f"rank {r} step {i}: {action} {problem}")
            if kind.is_compute:
                ran.add((kind, action[2]))
        for s, ran in done.items():
            missing = sorted(f"{s}{k.value}{j}" for k, indices in required.items()
                             for j in indices if (k, j) not in ran)
            if missing:
                _fail(schedule, {(r, len(row)): f"missing {' '.join(missing)}"},
                      f"rank {r} never runs {', '.join(missing)}")
    _check_progress(schedule)


def _breaks_rule(action, ran: set, required: dict, shape: StepShape) -> bool:
    """The fast test of a compute action against its stage's rules (details: _row_problem)."""
    _, kind, index, _ = action
    if index not in required[kind] or (kind, index) in ran:
        return True
    if kind is _SB:
        return (_SF, index) not in ran
    for need in shape.local_needs(kind, index):
        if need not in ran:
            return True
    return False


def _row_problem(schedule, action, r, done, required, shape) -> str:
    if action.stage % schedule.num_ranks != r:
        where = ("" if schedule.num_model_chunks == 1
                 else f" (rank {action.stage % schedule.num_ranks})")
        return f"belongs to stage {action.stage}{where} but sits in rank {r}'s row"
    if action.stage not in done:
        return f"names stage {action.stage} of a {schedule.num_stages}-stage pipeline"
    if action.index not in required[action.kind]:
        what = "group with a cached prefix" if action.kind in (_PF, _PB) else "microbatch"
        return f"names no {what} of this step"
    ran = done[action.stage]
    if (action.kind, action.index) in ran:
        return "runs twice"
    missing = [f"{action.stage}{k.value}{j}" for k, j in shape.local_needs(action.kind,
                                                                           action.index)
               if (k, j) not in ran]
    return f"runs before {', '.join(missing)} on its stage"


def _check_progress(schedule: Schedule) -> None:
    """Walk all rows together, each compute waiting for its peer dependency (the same action on
    the neighbouring stage); stuck means deadlock."""
    num, rows = schedule.num_stages, schedule.actions
    pos, done = [0] * len(rows), set()
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            p = pos[r]
            while p < len(row):
                stage, kind, index, _ = row[p]
                if kind.is_compute:
                    up = stage - 1 if kind.is_forward else stage + 1
                    if 0 <= up < num and (up, kind, index) not in done:
                        break
                    done.add((stage, kind, index))
                p += 1
            if p != pos[r]:
                pos[r], progress = p, True
    stuck = {}
    for r, row in enumerate(rows):
        if pos[r] < len(row):
            stage, kind, index, _ = row[pos[r]]
            up = stage - 1 if kind.is_forward else stage + 1
            stuck[(r, pos[r])] = f"waits for {up}{kind.value}{index}"
    if stuck:
        _fail(schedule, stuck, "deadlock: every unfinished rank waits on another")


def _fail(schedule: Schedule, marks: Mapping[tuple[int, int], str], headline: str) -> None:
    raise ScheduleError(f"{headline}\n{format_grid(schedule, marks)}")
