"""Dry run of a lowered plan with no model: p2p matching, deadlock, bubble and live memory.

Each rank walks its own list. A compute action takes `cost(action)` time units; a send posts its
item on the channel to its peer and never blocks (isend); a receive blocks until the channel's next
item arrives and must be exactly the item it names ([Note: p2p posting order] in lowering.py).
Protocol invariants are checked as an executor would: a compute's input must have been received,
a send's data computed, a backward's forward run; every sent item must be received.

Memory (units per rank): a PF allocates `memory(PF g)` (its activations plus the group's cached
K/V and their gradient buffer) from its start until the end of PB g; an SF allocates
`memory(SF m)` until the end of SB m. Live received buffers are not counted.

`build_dense_1f1b` + `compare_with_dense` give the baseline: the same trajectories run dense
(no cached prefix, every row recomputes its prompt) under plain 1F1B.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from prefix_schedule.pipeline.lowering import lower, peer_of, recv_kind
from prefix_schedule.pipeline.generate import build_schedule
from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, ScheduleError, format_grid,
                                         unit_cost)

__all__ = [
    "Comparison",
    "DeadlockError",
    "SimResult",
    "TimedAction",
    "TokenCostModel",
    "build_dense_1f1b",
    "chrome_trace",
    "compare_with_dense",
    "simulate",
    "unit_memory",
]

CostFn = Callable[[Action], float]


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on a receive nobody will send; the message says who waits."""


def unit_memory(action: Action) -> float:
    """Default memory: a live prefix holds 2 units (activations 1, cached K/V + gK/gV 1), an
    in-flight suffix microbatch 1."""
    return {ActionKind.PREFIX_FORWARD: 2.0, ActionKind.SUFFIX_FORWARD: 1.0}.get(action.kind, 0.0)


@dataclass(frozen=True, kw_only=True)
class TimedAction:
    """One executed action on the simulated clock."""

    action: Action
    """The action."""
    start: float
    """When it began (for a receive: when the item was there)."""
    end: float
    """When it finished (== start for p2p actions)."""


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
class _Rank:
    rank: int
    row: tuple[Action, ...]
    pos: int = 0
    clock: float = 0.0
    done: set = field(default_factory=set)  # (kind, index) of compute run so far
    received: set = field(default_factory=set)
    memory_events: list = field(default_factory=list)  # (time, +/- units)
    timeline: list = field(default_factory=list)


def simulate(schedule: Schedule, *, cost: Optional[CostFn] = None,
             memory: Optional[CostFn] = None) -> SimResult:
    """Execute a lowered plan (a compute-only plan only if it has one stage).

    Raises DeadlockError when ranks wait forever and ScheduleError on a protocol violation."""
    cost, memory = cost or unit_cost, memory or unit_memory
    ranks = [_Rank(rank=s, row=row) for s, row in enumerate(schedule.actions)]
    channels: dict[tuple[int, int], deque] = {}
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while r.pos < len(r.row) and _step(r, schedule, channels, cost, memory):
                r.pos, progress = r.pos + 1, True
    _check_finished(schedule, ranks, channels)
    busy = tuple(sum(t.end - t.start for t in r.timeline if t.action.kind.is_compute)
                 for r in ranks)
    return SimResult(makespan=max(r.clock for r in ranks), busy=busy,
                     peak_memory=tuple(_peak(r.memory_events) for r in ranks),
                     timeline=tuple(tuple(r.timeline) for r in ranks))


def _step(r: _Rank, schedule: Schedule, channels, cost: CostFn, memory: CostFn) -> bool:
    """Run r's next action; False if it is a receive whose item has not been sent yet."""
    action, num = r.row[r.pos], schedule.num_stages
    kind, item = action.kind, (action.kind.compute, action.index)
    start, peer = r.clock, peer_of(action, num)
    if (kind.is_recv or kind.is_send) and peer is None:
        missing = action.stage + (1 if kind.is_forward == kind.is_send else -1)
        _protocol(schedule, r, f"has no peer: there is no stage {missing}")
    if kind.is_recv:
        queue = channels.get((peer, r.rank))
        if not queue:
            return False
        sent, when, _ = queue.popleft()
        if sent != item:
            _protocol(schedule, r, f"posting order mismatch: receives {item[0].value}{item[1]} "
                      f"but the peer's next send on this channel is {sent[0].value}{sent[1]}")
        r.received.add(item)
        start = r.clock = max(r.clock, when)
    elif kind.is_send:
        if item not in r.done:
            _protocol(schedule, r, f"sends {item[0].value}{item[1]} before computing it")
        channels.setdefault((r.rank, peer), deque()).append(
            (item, r.clock + cost(action), r.pos))
    elif kind.is_compute:
        _check_compute(schedule, r, action)
        r.clock += cost(action)
        _track_memory(r, action, start, memory)
        r.done.add(item)
    r.timeline.append(TimedAction(action=action, start=start, end=r.clock))
    return True


def _check_compute(schedule: Schedule, r: _Rank, action: Action) -> None:
    kind, num = action.kind, schedule.num_stages
    upstream = action.stage - 1 if kind.is_forward else action.stage + 1
    if 0 <= upstream < num and (kind, action.index) not in r.received:
        _protocol(schedule, r, f"runs before its input {r.rank}{recv_kind(kind).value}"
                  f"{action.index} was received (is the plan lowered?)")
    if (kind, action.index) in r.done:
        _protocol(schedule, r, "runs twice")
    forward = {ActionKind.SUFFIX_BACKWARD: ActionKind.SUFFIX_FORWARD,
               ActionKind.PREFIX_BACKWARD: ActionKind.PREFIX_FORWARD}.get(kind)
    if forward is not None and (forward, action.index) not in r.done:
        _protocol(schedule, r, f"runs before {r.rank}{forward.value}{action.index}")


def _track_memory(r: _Rank, action: Action, start: float, memory: CostFn) -> None:
    if action.kind in (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD):
        r.memory_events.append((start, float(memory(action))))
    elif action.kind in (ActionKind.PREFIX_BACKWARD, ActionKind.SUFFIX_BACKWARD):
        forward = Action(stage=action.stage, kind=ActionKind(action.kind.value[0] + "F"),
                         index=action.index)
        r.memory_events.append((r.clock, -float(memory(forward))))


def _peak(events) -> float:
    live = peak = 0.0
    for _, delta in sorted(events):  # at equal times frees (negative) come first
        live += delta
        peak = max(peak, live)
    return peak


def _protocol(schedule: Schedule, r: _Rank, problem: str) -> None:
    raise ScheduleError(f"rank {r.rank} step {r.pos}: {r.row[r.pos]} {problem}\n"
                        + format_grid(schedule, {(r.rank, r.pos): problem}))


def _check_finished(schedule: Schedule, ranks, channels) -> None:
    waiting = {(r.rank, r.pos): f"waits on {r.row[r.pos]} from rank "
               f"{peer_of(r.row[r.pos], len(ranks))}" for r in ranks if r.pos < len(r.row)}
    if waiting:
        lines = "; ".join(f"rank {s} {note}" for (s, _), note in sorted(waiting.items()))
        raise DeadlockError(f"deadlock: {lines}\n" + format_grid(schedule, waiting))
    for (src, dst), queue in channels.items():
        if queue:
            _, _, step = queue[0]
            note = f"rank {dst} never receives it"
            raise ScheduleError(f"rank {src} step {step}: {schedule.actions[src][step]}: {note}\n"
                                + format_grid(schedule, {(src, step): note}))


def chrome_trace(result: SimResult) -> str:
    """Chrome/Perfetto trace JSON (1 cost unit = 1 us): one thread per rank, compute as slices,
    p2p and grad reduce as instants."""
    events: list[dict] = []
    for rank, timed_row in enumerate(result.timeline):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for timed in timed_row:
            event = {"name": str(timed.action), "cat": timed.action.kind.value, "pid": 0,
                     "tid": rank, "ts": timed.start}
            if timed.action.kind.is_compute:
                event.update(ph="X", dur=timed.end - timed.start)
            else:
                event.update(ph="i", s="t")
            events.append(event)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, indent=1)


# ---------------------------------------------------------------- costs and the dense baseline
@dataclass(frozen=True, kw_only=True)
class TokenCostModel:
    """Costs and memory proportional to tokens, for the reuse plan and its dense baseline."""

    prefix_tokens: Mapping[int, int]
    """Cached prefix tokens of each group that has one."""
    microbatch_rows: Sequence[Mapping[int, int]]
    """Per suffix microbatch: trajectory rows of each group it holds."""
    suffix_tokens: Sequence[int]
    """Tokens of each suffix microbatch (its packed rows)."""
    backward_ratio: float = 2.0
    """Backward cost / forward cost."""
    kv_units_per_token: float = 1.0
    """Memory of a prefix token's cached K/V plus gK/gV buffer, in token-activation units."""
    unit_tokens: Optional[Mapping[int, int]] = None
    """Tokens of each prefix unit (PF/PB index) when prefixes are chunked ([Note: prefix chunks]
    in units.py); None: PF/PB indices are groups and cost their whole `prefix_tokens`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_tokens", dict(self.prefix_tokens))
        if self.unit_tokens is not None:
            object.__setattr__(self, "unit_tokens", dict(self.unit_tokens))
            if sum(self.unit_tokens.values()) != sum(self.prefix_tokens.values()):
                raise ValueError(f"unit_tokens sum to {sum(self.unit_tokens.values())} but "
                                 f"prefix_tokens to {sum(self.prefix_tokens.values())}; the chunks "
                                 "of every group must add up to its prefix")
        object.__setattr__(self, "microbatch_rows", tuple(dict(r) for r in self.microbatch_rows))
        object.__setattr__(self, "suffix_tokens", tuple(self.suffix_tokens))
        if len(self.microbatch_rows) != len(self.suffix_tokens):
            raise ValueError(f"{len(self.microbatch_rows)} microbatch_rows entries but "
                             f"{len(self.suffix_tokens)} suffix_tokens; give one per microbatch")
        counts = [*self.prefix_tokens.values(), *self.suffix_tokens,
                  *(self.unit_tokens or {}).values()]
        if any(c <= 0 for c in counts) or self.backward_ratio <= 0 or self.kv_units_per_token < 0:
            raise ValueError("token counts and backward_ratio must be > 0, kv_units_per_token >= 0")

    def cost(self, action: Action) -> float:
        """Reuse plan: PF/PB scale with the prefix, SF/SB with the suffix microbatch."""
        return self._scaled(action, self._tokens(action))

    def memory(self, action: Action) -> float:
        if action.kind is ActionKind.PREFIX_FORWARD:
            return self._tokens(action) * (1.0 + self.kv_units_per_token)
        return float(self.suffix_tokens[action.index]) if action.kind.is_compute else 0.0

    def dense_tokens(self, m: int) -> float:
        """Microbatch m run dense: every row also carries its group's prefix."""
        extra = sum(n * self.prefix_tokens.get(g, 0) for g, n in self.microbatch_rows[m].items())
        return float(self.suffix_tokens[m] + extra)

    def dense_cost(self, action: Action) -> float:
        return self._scaled(action, self.dense_tokens(action.index))

    def dense_memory(self, action: Action) -> float:
        is_sf = action.kind is ActionKind.SUFFIX_FORWARD
        return self.dense_tokens(action.index) if is_sf else 0.0

    def _tokens(self, action: Action) -> float:
        if action.kind.compute in (ActionKind.PREFIX_FORWARD, ActionKind.PREFIX_BACKWARD):
            per_unit = self.prefix_tokens if self.unit_tokens is None else self.unit_tokens
            return float(per_unit[action.index])
        return float(self.suffix_tokens[action.index])

    def _scaled(self, action: Action, tokens: float) -> float:
        if not action.kind.is_compute:
            return 0.0
        return tokens if action.kind.is_forward else tokens * self.backward_ratio


def build_dense_1f1b(*, num_stages: int, num_microbatches: int) -> Schedule:
    """Plain 1F1B over `num_microbatches` dense microbatches (no prefix work): the baseline."""
    return build_schedule(num_stages=num_stages, microbatch_groups=[()] * num_microbatches,
                          prefix_groups=())


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """The reuse plan and the dense 1F1B baseline, simulated on the same trajectories."""

    plan: SimResult
    """The prefix-reuse plan."""
    dense: SimResult
    """Dense 1F1B: same microbatches, every row recomputing its prefix (unit costs: same costs)."""


def compare_with_dense(schedule: Schedule, *, num_microbatches: int,
                       costs: Optional[TokenCostModel] = None) -> Comparison:
    """Simulate `schedule` (compute-only) and a dense 1F1B plan of the same microbatches.

    With `costs=None` both use `unit_cost`/`unit_memory` (the dense microbatches then cost as
    much as the suffix ones: a pure bubble comparison); with a TokenCostModel the dense
    microbatches pay for the recomputed prefixes."""
    dense = lower(build_dense_1f1b(num_stages=schedule.num_stages,
                                   num_microbatches=num_microbatches))
    if costs is None:
        return Comparison(plan=simulate(lower(schedule)), dense=simulate(dense))
    return Comparison(plan=simulate(lower(schedule), cost=costs.cost, memory=costs.memory),
                      dense=simulate(dense, cost=costs.dense_cost, memory=costs.dense_memory))
