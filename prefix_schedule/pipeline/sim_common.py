"""What both p2p models of the dry run share: results, protocol checks and memory accounting.

Memory (units per rank): a PF allocates `memory(PF u)` (its activations plus the unit's cached
K/V and their gradient buffer) from its start until the end of PB u; an SF allocates
`memory(SF m)` until the end of SB m (per virtual stage). Live received buffers are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from prefix_schedule.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, format_grid
from prefix_schedule.pipeline.lowering import recv_kind

__all__ = ["CostFn", "DeadlockError", "SimResult", "TimedAction", "unit_memory"]

CostFn = Callable[[Action], float]
_FORWARD_OF = {ActionKind.SUFFIX_BACKWARD: ActionKind.SUFFIX_FORWARD,
               ActionKind.PREFIX_BACKWARD: ActionKind.PREFIX_FORWARD}


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on p2p that cannot complete; the message says who waits."""


def unit_memory(action: Action) -> float:
    """Default memory: a live prefix holds 2 units (activations 1, cached K/V + gK/gV 1), an
    in-flight suffix microbatch 1."""
    return {ActionKind.PREFIX_FORWARD: 2.0, ActionKind.SUFFIX_FORWARD: 1.0}.get(action.kind, 0.0)


class TimedAction(NamedTuple):
    """One executed action on the simulated clock (a named tuple: hundreds of thousands of them
    are made per dry run)."""

    action: Action
    """The action."""
    start: float
    """When it began (a receive: when its item was there; NCCL mode: when it was posted)."""
    end: float
    """When it finished (buffered p2p: == start; NCCL p2p: when its exchange completed)."""


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What one simulated step did, per rank."""

    makespan: float
    """Time when the last rank finished."""
    busy: tuple[float, ...]
    """Compute time per rank."""
    peak_memory: tuple[float, ...]
    """Largest live memory per rank, in the units of the memory function."""
    timeline: tuple[tuple[TimedAction, ...], ...]
    """Every executed action per rank, in list order."""

    @property
    def idle(self) -> tuple[float, ...]:
        """Time per rank within the makespan that computes nothing."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: sum(idle) / (num_ranks * makespan)."""
        return sum(self.idle) / (len(self.busy) * self.makespan) if self.makespan else 0.0


@dataclass
class RankState:
    """One rank walking its row."""

    rank: int
    row: tuple
    pos: int = 0
    clock: float = 0.0
    done: set = field(default_factory=set)  # (kind, index, stage) of compute run so far
    memory_events: list = field(default_factory=list)  # (time, +/- units)
    timeline: list = field(default_factory=list)


def protocol_error(schedule: Schedule, r: RankState, problem: str) -> None:
    raise ScheduleError(f"rank {r.rank} step {r.pos}: {r.row[r.pos]} {problem}\n"
                        + format_grid(schedule, {(r.rank, r.pos): problem}))


def check_compute(schedule: Schedule, r: RankState, action: Action, has_input: bool) -> None:
    """What an executor asserts before a compute: its input received (`has_input`), it has not
    run, and a backward's forward ran."""
    kind, s = action.kind, action.stage
    upstream = s - 1 if kind.is_forward else s + 1
    if 0 <= upstream < schedule.num_stages and not has_input:
        protocol_error(schedule, r, f"runs before its input {s}{recv_kind(kind).value}"
                       f"{action.index} was received (is the plan lowered?)")
    if (kind, action.index, s) in r.done:
        protocol_error(schedule, r, "runs twice")
    forward = _FORWARD_OF.get(kind)
    if forward is not None and (forward, action.index, s) not in r.done:
        protocol_error(schedule, r, f"runs before {s}{forward.value}{action.index}")


def run_compute(r: RankState, action: Action, start: float, cost: CostFn,
                memory: CostFn) -> None:
    """Advance r's clock over `action` from `start`, with its timeline and memory entries."""
    r.clock = start + cost(action)
    if action.kind in (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD):
        r.memory_events.append((start, float(memory(action))))
    else:
        forward = Action._make((action.stage, _FORWARD_OF[action.kind], action.index, ()))
        r.memory_events.append((r.clock, -float(memory(forward))))
    r.done.add((action.kind, action.index, action.stage))
    r.timeline.append(TimedAction(action=action, start=start, end=r.clock))


def result_of(ranks: list[RankState]) -> SimResult:
    busy = tuple(sum(t.end - t.start for t in r.timeline if t.action.kind.is_compute)
                 for r in ranks)
    return SimResult(makespan=max(r.clock for r in ranks), busy=busy,
                     peak_memory=tuple(_peak(r.memory_events) for r in ranks),
                     timeline=tuple(tuple(r.timeline) for r in ranks))


def _peak(events) -> float:
    live = peak = 0.0
    for _, delta in sorted(events):  # at equal times frees (negative) come first
        live += delta
        peak = max(peak, live)
    return peak
