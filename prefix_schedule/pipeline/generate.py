"""The schedule generator: (interleaved) 1F1B over the suffix microbatches, prefix work slotted in.

A pure function of the step's shape (no torch, no Megatron): `build_schedule` returns a
compute-only `Schedule` that obeys [Note: prefix-reuse dependency rules] (ir.py), on one model
chunk per rank or on virtual stages ([Note: virtual stages]).
"""

from __future__ import annotations

import functools
import heapq
from bisect import insort
from typing import Callable, Collection, Mapping, Optional, Sequence

from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, check_count, unit_cost,
                                         without_gc)
from prefix_schedule.pipeline.orders import BaseOrder, interleaved_order, one_f_one_b_order
from prefix_schedule.pipeline.units import StepShape

__all__ = ["build_schedule", "MAX_VIRTUAL_STAGES"]

MAX_VIRTUAL_STAGES = 1024
"""Most virtual stages (PP x V) a schedule is built for; real pipelines use tens."""

_PF, _SF = ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD
_SB, _PB = ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD
_new = functools.partial(tuple.__new__, Action)  # trusted: the planner builds valid actions


@without_gc
def build_schedule(*, num_stages: int, microbatch_groups: Sequence[Sequence[int]],
                   prefix_groups: Collection[int],
                   cost: Optional[Callable[[Action], float]] = None,
                   prefix_units: Optional[Mapping[int, tuple[int, int]]] = None,
                   num_model_chunks: int = 1,
                   unit_parents: Optional[Mapping[int, Optional[int]]] = None) -> Schedule:
    """Compute-only prefix-reuse plan: 1F1B over the suffix microbatches, prefix work slotted in.

    The ranks are played forward in (modelled) time with `cost` (default `unit_cost`). A free
    rank runs, in this order of preference: a prefix backward whose inputs are ready (frees the
    prefix soon and fills idle time), the next 1F1B action (preceded by the PFs of any group it
    is the first to touch), or, if that must wait, the next prefix unit's PF (fills a 1F1B
    bubble; at most one group is forwarded ahead of its first suffix). Every pick is an action
    whose inputs exist, so the order is deadlock-free whatever the real costs turn out to be.
    With one stage this gives PF g, SF m, SB m, then PB g right after the SB of g's last
    microbatch (a chunked group: its PF chunks in order, its PB chunks in reverse).
    `prefix_units` (unit -> (group, chunk)) splits prefixes into chunks ([Note: prefix chunks]
    in units.py); PF/PB indices are then unit ids. `unit_parents` (unit -> parent unit) makes
    the units of a group a tree ([Note: prefix trees] in planning/tree.py). Measured (tests, tools/plan.py): the bubble
    fraction is at most dense 1F1B's while a prefix unit's forward costs no more than a
    suffix-microbatch forward; a dearer unprefixed prefix is one long chain through the stages,
    and its fill shows as a larger fraction -- chunking it removes that.

    Virtual stages: `num_stages` counts them (PP * V) and `num_model_chunks` = V (>= 2 needs
    PP >= 2, as Megatron's interleaved schedule). The suffix order of each rank is then
    Megatron's interleaved 1F1B (orders.py) and every prefix unit's PF runs on each virtual
    stage in order, its PB in reverse, like a microbatch."""
    check_count("num_stages", num_stages, 1)
    check_count("num_model_chunks", num_model_chunks, 1)
    if num_stages > MAX_VIRTUAL_STAGES:  # the play is O(stages x actions): minutes at 10**6
        raise ValueError(f"num_stages={num_stages} virtual stages (pipeline size x "
                         f"num_model_chunks) is beyond the limit of {MAX_VIRTUAL_STAGES}; "
                         "give the real pipeline size (Megatron's pipeline_model_parallel_size)")
    if num_stages % num_model_chunks:
        raise ValueError(f"num_stages={num_stages} counts the virtual stages (pipeline size x "
                         f"num_model_chunks) and must be a multiple of num_model_chunks="
                         f"{num_model_chunks}")
    num_ranks = num_stages // num_model_chunks
    if num_model_chunks > 1 and num_ranks < 2:
        raise ValueError(f"num_model_chunks={num_model_chunks} needs a pipeline of >= 2 ranks "
                         "(Megatron runs virtual stages only with pipeline_model_parallel_size "
                         "> 1); use num_model_chunks=1 on one rank")
    shape = StepShape(microbatch_groups=microbatch_groups, prefix_groups=prefix_groups,
                      prefix_units=prefix_units, unit_parents=unit_parents)
    return _Planner(num_ranks, num_model_chunks, shape, cost or unit_cost).run()


class _Stage:
    """Prefix bookkeeping of one virtual stage."""

    __slots__ = ("num_pf", "sb_left", "unused", "eligible", "pb_done", "children_left")

    def __init__(self, uses: dict, children_of: dict) -> None:
        self.num_pf = 0                # PFs placed (always a prefix of the planner's order)
        self.sb_left = dict(uses)      # group -> SBs still to place
        self.unused: set = set()       # forwarded groups no SF has read yet
        self.eligible: list = []       # (order position, unit) whose PB may go next, sorted
        self.pb_done: set = set()      # units whose PB is placed
        self.children_left = {u: len(c) for u, c in children_of.items()}  # PBs still to come


class _Planner:
    """Event-driven play of the ranks; see `build_schedule` for the policy."""

    def __init__(self, num_ranks: int, num_chunks: int, shape: StepShape, cost) -> None:
        self.num_ranks, self.num_stages = num_ranks, num_ranks * num_chunks
        self.shape, self.cost = shape, cost
        self.groups_of = shape.microbatch_groups
        groups = dict.fromkeys(g for gs in self.groups_of for g in gs if g in shape.prefix_groups)
        # PFs run in this order on every stage: groups by first use, each group's chunks in order
        self.prefix_order = [u for g in groups for u in shape.chunks_of[g]]
        self.position = {u: i for i, u in enumerate(self.prefix_order)}
        self.last_position = {g: self.position[shape.chunks_of[g][-1]] for g in groups}
        self.uses = dict.fromkeys(groups, 0)  # group -> microbatches that touch it
        for gs in self.groups_of:
            for g in gs:
                if g in self.uses:
                    self.uses[g] += 1
        num_mb = len(self.groups_of)
        self.base = [one_f_one_b_order(r, num_ranks, num_mb) if num_chunks == 1
                     else interleaved_order(r, num_ranks, num_chunks, num_mb)
                     for r in range(num_ranks)]
        self.stages = [_Stage(self.uses, shape.children_of) for _ in range(self.num_stages)]
        self.left = [2 * num_mb * num_chunks + 2 * len(self.prefix_order) * num_chunks
                     for _ in range(num_ranks)]  # actions still to place per rank
        self.end: dict = {}  # (stage, kind, index) -> modelled finish time of each placed action
        self.rows: list[list[Action]] = [[] for _ in range(num_ranks)]
        neighbours = ({(r - 1) % num_ranks, (r + 1) % num_ranks} - {r} for r in range(num_ranks))
        self.rank_stages = [range(self.num_stages - num_ranks + r, -1, -num_ranks)
                            for r in range(num_ranks)]
        self.neighbours = [sorted(n) if num_chunks > 1 else
                           sorted(x for x in n if abs(x - r) == 1)
                           for r, n in enumerate(neighbours)]

    def run(self) -> Schedule:
        """Play the ranks forward. A rank that cannot place anything retries only when an action
        of a neighbouring rank ends (readiness depends on nothing else), which keeps the play
        linear in the number of actions."""
        ending: dict = {}  # time -> ranks whose action ends then
        times: list = []
        now, candidates, idle = 0.0, range(self.num_ranks), set()
        while True:
            for r in candidates:
                action = self._pick(r, now) if self.left[r] else None
                if action is None:
                    if self.left[r]:
                        idle.add(r)
                    continue
                idle.discard(r)
                end = self._place(r, action, now)
                if end not in ending:
                    ending[end] = []
                    heapq.heappush(times, end)
                ending[end].append(r)
            if not times:
                if not idle:
                    break
                candidates = [self._break_stall(idle, now)]
                continue
            now = heapq.heappop(times)
            ended = ending.pop(now)
            woken = {n for r in ended for n in self.neighbours[r] if n in idle}
            candidates = sorted(woken.union(ended))
        return Schedule._trusted(self.num_stages, tuple(map(tuple, self.rows)),
                                 self.num_stages // self.num_ranks)

    def _break_stall(self, idle: set, now: float) -> int:
        """Every unfinished rank waits: the interleaved order's warmup was too short for this
        microbatch count (Megatron refuses such counts; see orders.py). Let the lowest such rank
        whose next suffix forward is ready run it early (one more warmup forward)."""
        for r in sorted(idle):
            nxt = self.base[r].peek_forward()
            if nxt is not None and self._ready(nxt[1], _SF, nxt[0], now):
                self.base[r].extend_warmup()
                return r
        raise AssertionError(f"planner stalled at t={now}: {self.rows}")

    def _ready(self, s: int, kind: ActionKind, i: int, now: float) -> bool:
        """Action (s, kind, i)'s peer dependency (ir.peer_dependency, inlined: the hot path) has
        ended by `now`."""
        if kind.is_forward:
            if s == 0:
                return True
            finish = self.end.get((s - 1, kind, i))
        else:
            if s == self.num_stages - 1:
                return True
            finish = self.end.get((s + 1, kind, i))
        return finish is not None and finish <= now

    def _pick(self, r: int, now: float) -> Optional[tuple]:
        """(stage, kind, index) of what rank r runs next, or None if nothing is ready."""
        stages = self.rank_stages[r]  # deepest model chunk first: backward flows down
        for s in stages:
            for _, unit in self.stages[s].eligible:
                if self._ready(s, _PB, unit, now):
                    return s, _PB, unit
        nxt = self._next_required(r)
        if nxt is not None and self._ready(*nxt, now):
            return nxt
        for s in reversed(stages):
            st = self.stages[s]
            if st.num_pf < len(self.prefix_order):
                unit = self.prefix_order[st.num_pf]
                if ((not st.unused or st.unused == {self.shape.group_of(unit)})
                        and self._ready(s, _PF, unit, now)):
                    return s, _PF, unit
        return None

    def _next_required(self, r: int) -> Optional[tuple]:
        nxt = self.base[r].peek()
        if nxt is None:
            return None
        kind, m, s = nxt
        if kind is _SF:
            st = self.stages[s]
            for g in self.groups_of[m]:
                if g in self.uses and st.num_pf <= self.last_position[g]:
                    unit = self.prefix_order[st.num_pf]
                    assert self.shape.group_of(unit) == g, "PFs run in first-use order"
                    return s, _PF, unit
        return s, kind, m

    def _place(self, r: int, picked: tuple, now: float) -> float:
        s, kind, i = picked
        action = _new((s, kind, i, ()))
        cost = float(self.cost(action))
        if not cost > 0:
            raise ValueError(f"cost({action}) = {cost}: compute costs must be > 0")
        st = self.stages[s]
        if kind is _PF:
            assert self.prefix_order[st.num_pf] == i, "PFs run in first-use order"
            st.num_pf += 1
            st.unused.add(self.shape.group_of(i))
        elif kind is _PB:
            st.eligible.remove((self.position[i], i))
            st.pb_done.add(i)
            previous = self.shape.parent_of(i)
            if previous is not None:  # children backward first: the parent may go after the last
                st.children_left[previous] -= 1
                if st.children_left[previous] == 0:
                    insort(st.eligible, (self.position[previous], previous))
        else:
            self.base[r].advance(kind)
            for g in self.groups_of[i]:
                st.unused.discard(g)
                if kind is _SB and g in self.uses:
                    st.sb_left[g] -= 1
                    if st.sb_left[g] == 0:  # the group's leaf units (its last chunk unless a tree)
                        for last in self.shape.chunks_of[g]:
                            if not st.children_left[last]:
                                insort(st.eligible, (self.position[last], last))
        end = now + cost
        self.end[(s, kind, i)] = end
        self.rows[r].append(action)
        self.left[r] -= 1
        return end
