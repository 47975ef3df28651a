"""Lowering: a chain of small passes from a compute-only plan to what a rank executes.

    compute-only --add_grouped_p2p--> + exchanges --add_grad_reduce--> + grad-reduce placeholders

Each pass is a pure function Schedule -> Schedule; `lower` runs them in order.
`lower(..., group_exchanges=False)` runs `add_p2p` instead: single sends/receives only, safe
where sends never block (gloo), deadlocking under NCCL (tests/test_schedule_nccl.py).
`flatten_exchanges` turns each exchange back into its ops (sends first), for an executor that
posts sends asynchronously and knows no exchanges; `forward_only` keeps the forward half.

[Note: p2p posting order]
Under NCCL, send and receive between two ranks share one FIFO stream per rank pair; a send
completes only together with its matching receive (rendezvous), and the ops of one grouped
exchange are in flight together (nccl.py, [Note: the NCCL p2p model]). Matching is FIFO per
channel (src rank -> dst rank; with virtual stages one channel can carry activations and
gradients), so the rule, for every channel src -> dst:

    the receives that dst posts from src are, in order, exactly the sends that src posts to dst.

`add_grouped_p2p` keeps it and is deadlock-free under rendezvous semantics, even if every rank
blocked on each op or exchange until it completes (the strictest reading, e.g. a gloo mode in
which a send waits for its receiver). It plays the compute-only plan once with `cost` (any
positive costs: only the order they induce matters) and cuts each rank's row into gaps, gap k
lying between compute k-1 and compute k, L(k) = the modelled start of compute k. Every op gets
a time key: a message produced at time t is sent in the gap right after its producer and
received in the receiver's first gap with L >= t (never after its consumer, which starts at
>= t); both ops carry key t. Within a gap, ops are posted by (key, peer rank, sends first), and
a send and a receive with the same key and peer -- a crossing pair, two ranks sending to each
other at once -- form ONE exchange, as Megatron's send_forward_recv_backward /
send_backward_recv_forward. Why no wait can close into a cycle: a rank stuck on an op with key
t waits for its peer to post the counterpart (key t); the peer is stuck on an op posted before
that counterpart. Ops of earlier gaps have keys < t (on the receiving side every earlier gap has
L < t; on the sending side every earlier gap ends before the producer does), and within the gap
they have key <= t; so keys never grow along a chain of waits, and a cycle would need one key t
throughout. Among ops of one key, a rank waiting on peer b is held by an op to a peer c < a
(same key and peer a would share the exchange), and a chain a -> b -> c with c < a, ... strictly
decreases every second rank: no cycle. Receiving by send time keeps each channel FIFO.
Prefix and suffix tensors differ in shape: the receiver learns which one comes next from its own
list, never from arrival order. `simulate` checks the rule and fails on any mismatch.
"""

from __future__ import annotations

import functools
import operator
from bisect import bisect_left
from typing import Callable, Optional

from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, ScheduleError, peer_stage,
                                         unit_cost, without_gc)

__all__ = ["PASSES", "add_grad_reduce", "add_grouped_p2p", "add_p2p", "flatten_exchanges",
           "forward_only", "lower", "peer_of", "recv_kind", "send_kind"]

_SEND = {ActionKind.PREFIX_FORWARD: ActionKind.SEND_PREFIX_FORWARD,
         ActionKind.SUFFIX_FORWARD: ActionKind.SEND_SUFFIX_FORWARD,
         ActionKind.SUFFIX_BACKWARD: ActionKind.SEND_SUFFIX_BACKWARD,
         ActionKind.PREFIX_BACKWARD: ActionKind.SEND_PREFIX_BACKWARD}
_RECV = {ActionKind.PREFIX_FORWARD: ActionKind.RECV_PREFIX_FORWARD,
         ActionKind.SUFFIX_FORWARD: ActionKind.RECV_SUFFIX_FORWARD,
         ActionKind.SUFFIX_BACKWARD: ActionKind.RECV_SUFFIX_BACKWARD,
         ActionKind.PREFIX_BACKWARD: ActionKind.RECV_PREFIX_BACKWARD}
_new = functools.partial(tuple.__new__, Action)  # trusted construction: the ops are valid
_kind_of = operator.itemgetter(1)  # action -> its kind, in C
_EXCHANGE = ActionKind.EXCHANGE


def send_kind(compute: ActionKind) -> ActionKind:
    """The p2p kind that ships `compute`'s output (activations or input gradient)."""
    return _SEND[compute]


def recv_kind(compute: ActionKind) -> ActionKind:
    """The p2p kind that receives the input `compute` needs from the neighbouring stage."""
    return _RECV[compute]


peer_of = peer_stage  # the name the passes and the simulator have used


def _input_stage(action: Action, num_stages: int) -> Optional[int]:
    """The stage a compute action's input comes from (the input side of peer_stage), if any."""
    upstream = action.stage - 1 if action.kind.is_forward else action.stage + 1
    return upstream if 0 <= upstream < num_stages else None


def _check_compute_only(schedule: Schedule, pass_name: str) -> None:
    for row in schedule.actions:
        for action in row:
            if not action[1].is_compute:
                raise ScheduleError(f"{pass_name} takes a compute-only plan but found {action}; "
                                    "pass the output of build_schedule (or from_text of one)")


def _check_ranks(schedule: Schedule, pass_name: str) -> None:
    if schedule.num_ranks == 1 and schedule.num_model_chunks > 1:
        raise ScheduleError(f"{pass_name}: {schedule.num_model_chunks} model chunks on one rank "
                            "would send to itself; virtual stages need >= 2 ranks")


def _like(schedule: Schedule, rows) -> Schedule:
    """A schedule on `schedule`'s layout with `rows` (built here: only Actions)."""
    return Schedule._trusted(schedule.num_stages, tuple(map(tuple, rows)),
                             schedule.num_model_chunks)


# ---------------------------------------------------------------- ungrouped (buffered sends only)
def add_p2p(schedule: Schedule) -> Schedule:
    """Single sends and receives: a send right after each compute whose output a neighbour
    needs, the matching receives before their consumers in the sender's order. Safe only where
    sends never block; under NCCL crossing sends deadlock (use add_grouped_p2p)."""
    _check_compute_only(schedule, "add_p2p")
    _check_ranks(schedule, "add_p2p")
    num, ranks = schedule.num_stages, schedule.num_ranks
    with_sends = [_add_sends(row, num) for row in schedule.actions]
    channels: dict = {}  # (src, dst) -> the (kind, index, stage) items src sends, in order
    for src, row in enumerate(with_sends):
        for action in row:
            if action.kind.is_send:
                dst = peer_stage(action, num) % ranks
                channels.setdefault((src, dst), []).append(
                    (action.kind.compute, action.index, action.stage + (
                        1 if action.kind.is_forward else -1)))
    rows = [_add_recvs(row, rank, schedule, channels) for rank, row in enumerate(with_sends)]
    return _like(schedule, rows)


def _add_sends(row, num_stages: int) -> list[Action]:
    out = []
    for action in row:
        out.append(action)
        if peer_stage(action, num_stages) is not None:
            out.append(_new((action.stage, _SEND[action.kind], action.index, ())))
    return out


def _add_recvs(row, rank: int, schedule: Schedule, channels) -> tuple[Action, ...]:
    out, cursor, received = [], {}, set()
    positions = {src: {item: i for i, item in enumerate(items)}
                 for (src, dst), items in channels.items() if dst == rank}
    for action in row:
        upstream = _input_stage(action, schedule.num_stages) if action.kind.is_compute else None
        if upstream is not None:
            src = upstream % schedule.num_ranks
            item = (action.kind, action.index, action.stage)
            if item not in positions.get(src, {}):
                raise ScheduleError(f"{action} needs {upstream}{_SEND[action.kind].value}"
                                    f"{action.index} but rank {src} never sends it; validate "
                                    "the plan first (validate_schedule)")
            items = channels[(src, rank)]
            while item not in received:  # receive in the sender's order up to the needed item
                kind, index, stage = items[cursor.get(src, 0)]
                cursor[src] = cursor.get(src, 0) + 1
                received.add((kind, index, stage))
                out.append(_new((stage, _RECV[kind], index, ())))
        out.append(action)
    return tuple(out)


# ---------------------------------------------------------------- grouped exchanges
def compute_timeline(schedule: Schedule, cost: Optional[Callable[[Action], float]] = None
                     ) -> tuple[list[list[float]], list[list[float]]]:
    """(starts, ends): the modelled start and end of every compute of every row when the plan
    runs with `cost` (> 0) and free, instant p2p (each compute waits for its rank and for its
    peer dependency)."""
    cost = cost or unit_cost
    rows, num = schedule.actions, schedule.num_stages
    finish: dict = {}
    starts: list[list[float]] = [[] for _ in rows]
    ends: list[list[float]] = [[] for _ in rows]
    pos, clock = [0] * len(rows), [0.0] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            p, now, start_r, end_r = pos[r], clock[r], starts[r], ends[r]
            while p < len(row):
                action = row[p]
                stage, kind, index, _ = action
                up = stage - 1 if kind.is_forward else stage + 1
                if 0 <= up < num:
                    ready = finish.get((up, kind, index))
                    if ready is None:
                        break
                    if ready > now:
                        now = ready
                spent = cost(action)
                if not spent > 0:
                    raise ValueError(f"cost({action}) = {spent}: compute costs must be > 0")
                start_r.append(now)
                now += spent
                end_r.append(now)
                finish[(stage, kind, index)] = now
                p += 1
            if p != pos[r]:
                pos[r], clock[r], progress = p, now, True
    stuck = [f"rank {r} at {rows[r][pos[r]]}" for r in range(len(rows)) if pos[r] < len(rows[r])]
    if stuck:
        raise ScheduleError(f"cannot lower a plan that deadlocks ({', '.join(stuck)} wait "
                            "forever); validate it first (validate_schedule)")
    return starts, ends


@without_gc
def add_grouped_p2p(schedule: Schedule,
                    cost: Optional[Callable[[Action], float]] = None) -> Schedule:
    """Sends right after their producers, receives in the first gap after their send time,
    crossing pairs in one exchange ([Note: p2p posting order]). `cost` (default unit_cost, > 0)
    only shapes which gap a receive joins."""
    _check_compute_only(schedule, "add_grouped_p2p")
    _check_ranks(schedule, "add_grouped_p2p")
    num, ranks = schedule.num_stages, schedule.num_ranks
    starts, ends = compute_timeline(schedule, cost)
    # per rank: (gap k, time key, peer rank, 0 send / 1 receive, op); gap k precedes compute k.
    # The first four fields are unique per rank, so sorting never compares two ops.
    posts: list[list] = [[] for _ in range(ranks)]
    for r, row in enumerate(schedule.actions):
        mine, end_r = posts[r].append, ends[r]
        for k, (stage, kind, index, _) in enumerate(row):
            dst_stage = stage + 1 if kind.is_forward else stage - 1
            if not 0 <= dst_stage < num:
                continue
            sent, dst = end_r[k], dst_stage % ranks
            mine((k + 1, sent, dst, 0, _new((stage, _SEND[kind], index, ()))))
            posts[dst].append((bisect_left(starts[dst], sent), sent, r, 1,
                               _new((dst_stage, _RECV[kind], index, ()))))
    return _like(schedule, [_merge(row, sorted(posts[r]))
                            for r, row in enumerate(schedule.actions)])


def _merge(row: tuple, posts: list) -> tuple:
    """The row with its p2p posted in the gaps: per gap by (time, peer rank, send first); ops of
    the same gap, time and peer (a crossing pair) form one exchange."""
    out, i, n = [], 0, len(posts)
    for k in range(len(row) + 1):
        while i < n and posts[i][0] == k:
            j, head = i + 1, posts[i]
            while j < n and posts[j][0] == k and posts[j][1:3] == head[1:3]:
                j += 1
            if j == i + 1:
                out.append(head[4])
            else:
                ops = tuple(entry[4] for entry in posts[i:j])
                out.append(_new((ops[0][0], _EXCHANGE, 0, ops)))
            i = j
        if k < len(row):
            out.append(row[k])
    return tuple(out)


def flatten_exchanges(schedule: Schedule) -> Schedule:
    """Each exchange replaced by its ops in posting order (sends first). Equivalent wherever
    sends never block (gloo, or NCCL with isend and no grouping needed); for executors that do
    not post grouped exchanges yet."""
    return _like(schedule, [[op for action in row for op in (
        action.ops if action.kind is _EXCHANGE else (action,))] for row in schedule.actions])


def forward_only(schedule: Schedule) -> Schedule:
    """The forward half of a lowered plan (forward computes and their p2p; exchanges keep their
    forward ops): what a forward-only step runs. Still deadlock-free: it drops messages, never
    moves one."""
    rows = []
    for row in schedule.actions:
        out = []
        for action in row:
            if action.kind is _EXCHANGE:
                ops = tuple(op for op in action.ops if op.kind.is_forward)
                if len(ops) > 1:
                    out.append(_new((ops[0].stage, _EXCHANGE, 0, ops)))
                elif ops:
                    out.append(ops[0])
            elif action.kind.is_forward:
                out.append(action)
        rows.append(out)
    return _like(schedule, rows)


def add_grad_reduce(schedule: Schedule) -> Schedule:
    """Placeholder pass: one REDUCE_GRAD per model chunk (its stage, index 0) at the end of each
    rank's list, after the last send so no peer waits on the reduce."""
    rows = []
    for rank, row in enumerate(schedule.actions):
        if ActionKind.REDUCE_GRAD in map(_kind_of, row):
            raise ScheduleError(f"rank {rank} already has a grad reduce; add_grad_reduce runs once")
        rows.append(row + tuple(_new((s, ActionKind.REDUCE_GRAD, 0, ()))
                                for s in schedule.stages_of(rank)))
    return _like(schedule, rows)


PASSES: tuple[Callable[[Schedule], Schedule], ...] = (add_grouped_p2p, add_grad_reduce)


@without_gc
def lower(schedule: Schedule, *, group_exchanges: bool = True,
          cost: Optional[Callable[[Action], float]] = None) -> Schedule:
    """Run the passes on a compute-only plan: `add_grouped_p2p` (with `cost`), or `add_p2p`
    with `group_exchanges=False`, then `add_grad_reduce`."""
    if group_exchanges:
        schedule = add_grouped_p2p(schedule, cost)
    else:
        schedule = add_p2p(schedule)
    return add_grad_reduce(schedule)
