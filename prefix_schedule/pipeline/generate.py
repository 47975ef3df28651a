"""The schedule generator: 1F1B over the suffix microbatches with the prefix work slotted in.

A pure function of the step's shape (no torch, no Megatron): `build_schedule` returns a
compute-only `Schedule` that obeys [Note: prefix-reuse dependency rules] (ir.py).
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping, Optional, Sequence

from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, check_count, peer_dependency,
                                         unit_cost)
from prefix_schedule.pipeline.units import StepShape

__all__ = ["build_schedule"]


def build_schedule(*, num_stages: int, microbatch_groups: Sequence[Sequence[int]],
                   prefix_groups: Collection[int],
                   cost: Optional[Callable[[Action], float]] = None,
                   prefix_units: Optional[Mapping[int, tuple[int, int]]] = None) -> Schedule:
    """Compute-only prefix-reuse plan: 1F1B over the suffix microbatches, prefix work slotted in.

    The stages are played forward in (modelled) time with `cost` (default `unit_cost`). A free
    stage runs, in this order of preference: a prefix backward whose inputs are ready (frees the
    prefix soon and fills idle time), the next 1F1B action (preceded by the PFs of any group it
    is the first to touch), or, if that must wait, the next prefix unit's PF (fills a 1F1B
    bubble; at most one group is forwarded ahead of its first suffix). Every pick is an action
    whose inputs exist, so the order is deadlock-free whatever the real costs turn out to be.
    With one stage this gives PF g, SF m, SB m, then PB g right after the SB of g's last
    microbatch (a chunked group: its PF chunks in order, its PB chunks in reverse).
    `prefix_units` (unit -> (group, chunk)) splits prefixes into chunks ([Note: prefix chunks]
    in units.py); PF/PB indices are then unit ids. Measured (tests, tools/plan.py): the bubble
    fraction is at most dense 1F1B's while a prefix unit's forward costs no more than a
    suffix-microbatch forward; a dearer unprefixed prefix is one long chain through the stages,
    and its fill shows as a larger fraction -- chunking it removes that."""
    check_count("num_stages", num_stages, 1)
    shape = StepShape(microbatch_groups=microbatch_groups, prefix_groups=prefix_groups,
                      prefix_units=prefix_units)
    return _Planner(num_stages, shape, cost or unit_cost).run()


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list:
    """Classic 1F1B order of one stage: warmup forwards, steady 1F1B, cooldown backwards."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    forwards = [(ActionKind.SUFFIX_FORWARD, m) for m in range(num_microbatches)]
    backwards = [(ActionKind.SUFFIX_BACKWARD, m) for m in range(num_microbatches)]
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[num_microbatches - warmup:]


class _Planner:
    """Event-driven play of the stages; see `build_schedule` for the policy."""

    def __init__(self, num_stages, shape: StepShape, cost) -> None:
        self.num, self.shape, self.cost = num_stages, shape, cost
        self.groups_of = shape.microbatch_groups
        groups = dict.fromkeys(g for gs in self.groups_of for g in gs if g in shape.prefix_groups)
        # PFs run in this order on every stage: groups by first use, each group's chunks in order
        self.prefix_order = [u for g in groups for u in shape.chunks_of[g]]
        self.uses = {g: sum(g in gs for gs in self.groups_of) for g in groups}
        self.base = [_one_f_one_b(s, num_stages, len(self.groups_of)) for s in range(num_stages)]
        self.pos = [0] * num_stages
        self.left = [len(row) + 2 * len(self.prefix_order) for row in self.base]  # to place
        self.end: dict[tuple[int, ActionKind, int], float] = {}  # finish time of each placed action
        self.num_pf = [0] * num_stages  # PFs placed per stage (always a prefix of prefix_order)
        self.sb_left = [dict(self.uses) for _ in range(num_stages)]
        self.unused = [set() for _ in range(num_stages)]  # forwarded groups no SF has read yet
        self.rows: list[list[Action]] = [[] for _ in range(num_stages)]

    def run(self) -> Schedule:
        free, now = [0.0] * self.num, 0.0
        while not all(self._finished(s) for s in range(self.num)):
            for s in range(self.num):
                if free[s] <= now and not self._finished(s):
                    action = self._pick(s, now)
                    if action is not None:
                        free[s] = self._place(action, now)
            later = [t for t in free if t > now]
            assert later, f"planner stalled at t={now}: {self.rows}"
            now = min(later)
        return Schedule(num_stages=self.num, actions=tuple(map(tuple, self.rows)))

    def _finished(self, s: int) -> bool:
        return self.left[s] == 0

    def _ready(self, action: Action, now: float) -> bool:
        dep = peer_dependency(action, self.num)
        return dep is None or self.end.get(dep, now + 1) <= now

    def _placed(self, s: int, kind: ActionKind, index: Optional[int]) -> bool:
        return index is None or (s, kind, index) in self.end

    def _pick(self, s: int, now: float) -> Optional[Action]:
        for u in self.prefix_order[:self.num_pf[s]]:
            pb = Action(stage=s, kind=ActionKind.PREFIX_BACKWARD, index=u)
            # chunks backward in reverse: the next chunk's PB must be placed already
            if (self.sb_left[s][self.shape.group_of(u)] == 0 and not self._placed(s, pb.kind, u)
                    and self._placed(s, pb.kind, self.shape.next_chunk(u))
                    and self._ready(pb, now)):
                return pb
        nxt = self._next_required(s)
        if nxt is not None and self._ready(nxt, now):
            return nxt
        if self.num_pf[s] < len(self.prefix_order):
            unit = self.prefix_order[self.num_pf[s]]
            early = Action(stage=s, kind=ActionKind.PREFIX_FORWARD, index=unit)
            if not self.unused[s] - {self.shape.group_of(unit)} and self._ready(early, now):
                return early
        return None

    def _next_required(self, s: int) -> Optional[Action]:
        if self.pos[s] == len(self.base[s]):
            return None
        kind, m = self.base[s][self.pos[s]]
        if kind is ActionKind.SUFFIX_FORWARD:
            for g in self.groups_of[m]:
                if g in self.uses and not self._placed(s, ActionKind.PREFIX_FORWARD,
                                                       self.shape.chunks_of[g][-1]):
                    unit = self.prefix_order[self.num_pf[s]]
                    assert self.shape.group_of(unit) == g, "PFs run in first-use order"
                    return Action(stage=s, kind=ActionKind.PREFIX_FORWARD, index=unit)
        return Action(stage=s, kind=kind, index=m)

    def _place(self, action: Action, now: float) -> float:
        s, kind, i = action.stage, action.kind, action.index
        cost = float(self.cost(action))
        if not cost > 0:
            raise ValueError(f"cost({action}) = {cost}: compute costs must be > 0")
        if kind is ActionKind.PREFIX_FORWARD:
            assert self.prefix_order[self.num_pf[s]] == i, "PFs run in first-use order"
            self.num_pf[s] += 1
            self.unused[s].add(self.shape.group_of(i))
        elif kind in (ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD):
            self.pos[s] += 1
            for g in self.groups_of[i]:
                self.unused[s].discard(g)
                if kind is ActionKind.SUFFIX_BACKWARD and g in self.uses:
                    self.sb_left[s][g] -= 1
        self.end[(s, kind, i)] = now + cost
        self.rows[s].append(action)
        self.left[s] -= 1
        return now + cost
