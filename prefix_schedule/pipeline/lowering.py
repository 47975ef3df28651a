"""Lowering: a chain of small passes from a compute-only plan to what a rank executes.

    compute-only --add_p2p--> + sends/receives --add_grad_reduce--> + grad-reduce placeholder

Each pass is a pure function Schedule -> Schedule; `lower` runs `PASSES` in order.

[Note: p2p posting order]
With one stage per rank, rank s sends forward outputs (PF, SF) only to s+1 and gradients (SB, PB)
only to s-1, so each ordered pair (src, dst) is one channel carrying one direction of data.
With PP=2 the previous and next peer are the same rank, and matching by posting order has bitten
before (two same-shaped tensors to one peer, posted in different orders on the two sides, were
silently crossed). So the rule, for every channel src -> dst:

    the receives that dst posts from src are, in order, exactly the sends that src posts to dst.

`add_p2p` guarantees it: a send follows the compute that produced its data at once; a receive is
posted in the sender's send order, so when a compute needs an item that the sender sent after
others not yet received, those others are received first (earlier than their consumer needs
them, never later). That costs no time: an item sent earlier is available no later than the one
the rank waits for. It also adds no deadlock when sends do not block (isend): receiving in
sender order waits only for sends that precede, on the sender, the one the compute needs.
So matching by (kind, index) and matching by posting order agree, and an executor may use either;
`simulate` checks the rule and fails on any mismatch. Prefix and suffix tensors differ in shape:
the receiver learns which one comes next from its own list, never from arrival order.
"""

from __future__ import annotations

from typing import Callable, Optional

from prefix_schedule.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, peer_stage

__all__ = ["PASSES", "add_grad_reduce", "add_p2p", "lower", "peer_of", "recv_kind", "send_kind"]

_SEND = {ActionKind.PREFIX_FORWARD: ActionKind.SEND_PREFIX_FORWARD,
         ActionKind.SUFFIX_FORWARD: ActionKind.SEND_SUFFIX_FORWARD,
         ActionKind.SUFFIX_BACKWARD: ActionKind.SEND_SUFFIX_BACKWARD,
         ActionKind.PREFIX_BACKWARD: ActionKind.SEND_PREFIX_BACKWARD}
_RECV = {ActionKind.PREFIX_FORWARD: ActionKind.RECV_PREFIX_FORWARD,
         ActionKind.SUFFIX_FORWARD: ActionKind.RECV_SUFFIX_FORWARD,
         ActionKind.SUFFIX_BACKWARD: ActionKind.RECV_SUFFIX_BACKWARD,
         ActionKind.PREFIX_BACKWARD: ActionKind.RECV_PREFIX_BACKWARD}


def send_kind(compute: ActionKind) -> ActionKind:
    """The p2p kind that ships `compute`'s output (activations or input gradient)."""
    return _SEND[compute]


def recv_kind(compute: ActionKind) -> ActionKind:
    """The p2p kind that receives the input `compute` needs from the neighbouring stage."""
    return _RECV[compute]


peer_of = peer_stage  # the name the passes and the simulator have used


def _needs_input(action: Action, num_stages: int) -> bool:
    """True when a compute action consumes data from a neighbour (the input side of peer_of)."""
    upstream = action.stage - 1 if action.kind.is_forward else action.stage + 1
    return 0 <= upstream < num_stages


def _check_compute_only(schedule: Schedule, pass_name: str) -> None:
    for row in schedule.actions:
        for action in row:
            if not action.kind.is_compute:
                raise ScheduleError(f"{pass_name} takes a compute-only plan but found {action}; "
                                    "pass the output of build_schedule (or from_text of one)")


def add_p2p(schedule: Schedule) -> Schedule:
    """Add a send after each compute whose output a neighbour needs, and the matching receives
    before their consumers, in the sender's order (see [Note: p2p posting order])."""
    _check_compute_only(schedule, "add_p2p")
    num = schedule.num_stages
    with_sends = [_add_sends(row, num) for row in schedule.actions]
    channels = {}  # (src, dst) -> the (kind, index) items src sends to dst, in posting order
    for src, row in enumerate(with_sends):
        for action in row:
            if action.kind.is_send:
                channels.setdefault((src, peer_of(action, num)), []).append(
                    (action.kind.compute, action.index))
    rows = [_add_recvs(row, rank, num, channels) for rank, row in enumerate(with_sends)]
    return Schedule(num_stages=num, actions=tuple(rows))


def _add_sends(row, num_stages: int) -> list[Action]:
    out = []
    for action in row:
        out.append(action)
        if peer_of(action, num_stages) is not None:
            out.append(Action(stage=action.stage, kind=send_kind(action.kind), index=action.index))
    return out


def _add_recvs(row, rank: int, num_stages: int, channels) -> tuple[Action, ...]:
    out, cursor, received = [], {}, set()
    for action in row:
        if action.kind.is_compute and _needs_input(action, num_stages):
            src = rank - 1 if action.kind.is_forward else rank + 1
            items = channels.get((src, rank), [])
            item = (action.kind, action.index)
            if item not in items:
                raise ScheduleError(f"{action} needs {src}{send_kind(action.kind).value}"
                                    f"{action.index} but rank {src} never sends it; validate "
                                    "the plan first (validate_schedule)")
            while item not in received:  # receive in the sender's order up to the needed item
                kind, index = items[cursor.get(src, 0)]
                cursor[src] = cursor.get(src, 0) + 1
                received.add((kind, index))
                out.append(Action(stage=rank, kind=recv_kind(kind), index=index))
        out.append(action)
    return tuple(out)


def add_grad_reduce(schedule: Schedule) -> Schedule:
    """Placeholder pass: one REDUCE_GRAD at the end of each rank's list (index 0: the rank's only
    model chunk). It goes after the last send so no peer waits on the reduce."""
    rows = []
    for rank, row in enumerate(schedule.actions):
        if any(a.kind is ActionKind.REDUCE_GRAD for a in row):
            raise ScheduleError(f"rank {rank} already has a grad reduce; add_grad_reduce runs once")
        rows.append(row + (Action(stage=rank, kind=ActionKind.REDUCE_GRAD, index=0),))
    return Schedule(num_stages=schedule.num_stages, actions=tuple(rows))


PASSES: tuple[Callable[[Schedule], Schedule], ...] = (add_p2p, add_grad_reduce)


def lower(schedule: Schedule) -> Schedule:
    """Run every pass of `PASSES` on a compute-only plan."""
    for lowering_pass in PASSES:
        schedule = lowering_pass(schedule)
    return schedule
