"""Dry run of a lowered plan with no model: p2p matching, deadlock, bubble and live memory.

Each rank walks its own list; a compute action takes `cost(action)` time units. Two p2p models:

- `p2p="nccl"` (default, what the tests prove plans against; nccl.py): one FIFO stream per rank
  pair, a send completes only together with its matching receive, an exchange's ops are posted
  at once and it completes as one, a compute waits for the exchanges holding its inputs.
  `p2p="blocking"` is stricter still: a rank also waits on every op/exchange it posts (a gloo
  mode where each send waits for its receiver's acknowledgement).
- `p2p="buffered"` (gloo's): a send posts its item on the channel and never blocks; a receive
  blocks until the channel's next item arrives. An exchange runs as its sends, then its
  receives.

Protocol invariants are checked as an executor would: a compute's input must have been
received, a send's data computed, a backward's forward run; every sent item must be received
and each receive must name exactly the channel's next item ([Note: p2p posting order] in
lowering.py). Memory: sim_common.py. Baselines and the dense comparison: baselines.py.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Optional

from prefix_schedule.pipeline.ir import (Schedule, ScheduleError, format_grid, peer_stage, unit_cost,
                                         without_gc)
from prefix_schedule.pipeline.lowering import flatten_exchanges
from prefix_schedule.pipeline.nccl import run_nccl
from prefix_schedule.pipeline.sim_common import (CostFn, DeadlockError, RankState, SimResult,
                                                 TimedAction, check_compute, protocol_error,
                                                 result_of, run_compute, unit_memory)

__all__ = ["DeadlockError", "P2P_MODES", "SimResult", "TimedAction", "chrome_trace", "simulate",
           "unit_memory"]

P2P_MODES = ("nccl", "blocking", "buffered")


@without_gc
def simulate(schedule: Schedule, *, cost: Optional[CostFn] = None,
             memory: Optional[CostFn] = None, p2p: str = "nccl") -> SimResult:
    """Execute a lowered plan (a compute-only plan only if it has one rank) under `p2p`.

    Raises DeadlockError when ranks wait forever and ScheduleError on a protocol violation."""
    if p2p not in P2P_MODES:
        raise ValueError(f"p2p={p2p!r}: choose one of {P2P_MODES}")
    cost, memory = cost or unit_cost, memory or unit_memory
    if p2p == "buffered":
        return _run_buffered(flatten_exchanges(schedule), cost, memory)
    return run_nccl(schedule, cost, memory, blocking=p2p == "blocking")


def _run_buffered(schedule: Schedule, cost: CostFn, memory: CostFn) -> SimResult:
    ranks = [RankState(rank=s, row=row) for s, row in enumerate(schedule.actions)]
    channels: dict[tuple[int, int], deque] = {}
    received = [set() for _ in ranks]
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while r.pos < len(r.row) and _step(r, schedule, channels, received[r.rank], cost,
                                               memory):
                r.pos, progress = r.pos + 1, True
    _check_finished(schedule, ranks, channels)
    return result_of(ranks)


def _step(r: RankState, schedule: Schedule, channels, received: set, cost, memory) -> bool:
    """Run r's next action; False if it is a receive whose item has not been sent yet."""
    action = r.row[r.pos]
    kind, stage = action.kind, action.stage
    start, peer = r.clock, peer_stage(action, schedule.num_stages)
    if (kind.is_recv or kind.is_send) and peer is None:
        missing = stage + (1 if kind.is_forward == kind.is_send else -1)
        protocol_error(schedule, r, f"has no peer: there is no stage {missing}")
    if kind.is_recv:
        queue = channels.get((peer % schedule.num_ranks, r.rank))
        if not queue:
            return False
        sent, when, _ = queue.popleft()
        item = (kind.compute, action.index, stage)
        if sent != item:
            protocol_error(schedule, r, f"posting order mismatch: receives {_item(item)} but "
                           f"the peer's next send on this channel is {_item(sent)}")
        received.add(item)
        start = r.clock = max(r.clock, when)
    elif kind.is_send:
        if (kind.compute, action.index, stage) not in r.done:
            protocol_error(schedule, r, f"sends {kind.compute.value}{action.index} before "
                           "computing it")
        channels.setdefault((r.rank, peer % schedule.num_ranks), deque()).append(
            ((kind.compute, action.index, peer), r.clock + cost(action), r.pos))
    elif kind.is_compute:
        check_compute(schedule, r, action, (kind, action.index, stage) in received)
        run_compute(r, action, r.clock, cost, memory)
        return True
    r.timeline.append(TimedAction(action=action, start=start, end=r.clock))
    return True


def _item(item) -> str:
    kind, index, stage = item
    return f"{stage}{kind.value}{index}"


def _check_finished(schedule: Schedule, ranks, channels) -> None:
    num = schedule.num_stages
    waiting = {(r.rank, r.pos): f"waits on {r.row[r.pos]} from rank "
               f"{peer_stage(r.row[r.pos], num) % schedule.num_ranks}"
               for r in ranks if r.pos < len(r.row)}
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

