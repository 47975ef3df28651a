"""The dry run under NCCL point-to-point semantics (simulate(p2p="nccl" | "blocking")).

[Note: the NCCL p2p model]
- Every rank has one FIFO stream per peer rank. Posting a send/receive (or an exchange) puts its
  ops at the tail of the streams to their peers; the host does not wait (isend/irecv).
- An op is in flight once every op ahead of it in its stream belongs to a completed exchange or
  to its own exchange (the ops of one exchange are in flight together: one ncclGroupStart/End).
- Matching is FIFO per channel: the k-th send src -> dst meets the k-th receive dst <- src; it
  must name the same item ([Note: p2p posting order], lowering.py).
- A send completes only together with its matching receive (rendezvous, as a large message on
  NCCL does), at the later of the two in-flight times; an exchange (a single op is an exchange
  of one) completes when all its ops have, and only then frees its streams for the next ops.
- A compute waits for the exchanges holding its inputs (its stream waits on the group); a send
  is posted only when the host reaches it, after the compute that produced its data.
- blocking=True: the host also waits for every exchange it posts (a gloo mode in which a send
  waits for its receiver's acknowledgement). Deadlock-free there implies deadlock-free above.
A deadlock report names, for every stuck rank, what it waits on and the stream op that blocks
that, so the cycle can be read off ("who waits on whom").
"""

from __future__ import annotations

from typing import Optional

from prefix_schedule.pipeline.ir import ActionKind, Schedule, ScheduleError, format_grid
from prefix_schedule.pipeline.sim_common import (CostFn, DeadlockError, RankState, SimResult,
                                                 TimedAction, check_compute, protocol_error,
                                                 result_of, run_compute)

__all__ = ["run_nccl"]

_EXCHANGE = ActionKind.EXCHANGE


class _Op:
    __slots__ = ("action", "rank", "peer", "peer_stage", "group", "posted", "ready", "done",
                 "partner")

    def __init__(self, action, rank, peer, peer_stage_, group, posted) -> None:
        self.action, self.rank, self.peer, self.peer_stage = action, rank, peer, peer_stage_
        self.group, self.posted = group, posted
        self.ready: Optional[float] = None   # in flight since (None: queued behind others)
        self.done: Optional[float] = None
        self.partner: Optional[_Op] = None

    def item(self) -> tuple:
        """(compute kind, index, receiving stage) of the data this op moves."""
        a = self.action
        return a.kind.compute, a.index, (self.peer_stage if a.kind.is_send else a.stage)


class _Group:
    __slots__ = ("ops", "left", "done", "rank", "step")

    def __init__(self, rank: int, step: int) -> None:
        self.ops: list = []
        self.left = 0
        self.done: Optional[float] = None
        self.rank, self.step = rank, step


class _Streams:
    """Every rank's per-peer FIFO streams, the channel matching and completion."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.fifo: dict = {}    # (rank, peer) -> [ops], with a head index in self.head
        self.head: dict = {}
        self.free: dict = {}    # (rank, peer) -> when its last completed exchange completed
        self.sends: dict = {}   # (src, dst) -> sends posted, in order
        self.recvs: dict = {}   # (src, dst) -> receives posted by dst, in order
        self.work: list = []

    def post(self, group: _Group) -> None:
        for op in group.ops:
            key = (op.rank, op.peer)
            queue = self.fifo.setdefault(key, [])
            queue.append(op)
            head = self.head.setdefault(key, 0)
            if queue[head].group is group:
                op.ready = max(op.posted, self.free.get(key, 0.0))
                self.work.append(op)
            channel = (op.rank, op.peer) if op.action.kind.is_send else (op.peer, op.rank)
            mine, theirs = (self.sends, self.recvs) if op.action.kind.is_send else (self.recvs,
                                                                                    self.sends)
            posted = mine.setdefault(channel, [])
            posted.append(op)
            other = theirs.get(channel, [])
            if len(other) >= len(posted):
                self._pair(op, other[len(posted) - 1])
        self._drain()

    def _pair(self, op: _Op, other: _Op) -> None:
        if op.item() != other.item():
            send, recv = (op, other) if op.action.kind.is_send else (other, op)
            raise _Mismatch(recv, send)
        op.partner, other.partner = other, op
        self.work.append(op)

    def _drain(self) -> None:
        while self.work:
            op = self.work.pop()
            other = op.partner
            if (op.done is None and other is not None and op.ready is not None
                    and other.ready is not None):
                op.done = other.done = max(op.ready, other.ready)
                for finished in (op.group, other.group):
                    finished.left -= 1
                    if finished.left == 0:
                        self._complete(finished)

    def _complete(self, group: _Group) -> None:
        group.done = max(op.done for op in group.ops)
        for key in {(op.rank, op.peer) for op in group.ops}:
            queue, head = self.fifo[key], self.head[key]
            while head < len(queue) and queue[head].group.done is not None:
                head += 1
            self.head[key], self.free[key] = head, group.done
            if head < len(queue):
                nxt = queue[head].group
                for op in queue[head:]:
                    if op.group is not nxt:
                        break
                    op.ready = max(op.posted, group.done)
                    self.work.append(op)


class _Mismatch(Exception):
    def __init__(self, recv: _Op, send: _Op) -> None:
        self.recv, self.send = recv, send


def run_nccl(schedule: Schedule, cost: CostFn, memory: CostFn, *, blocking: bool) -> SimResult:
    ranks = [RankState(rank=r, row=row) for r, row in enumerate(schedule.actions)]
    streams = _Streams(schedule)
    inputs: list[dict] = [{} for _ in ranks]   # (kind, index, stage) -> the receive's group
    posted_at: list[Optional[_Group]] = [None] * len(ranks)  # blocking: group posted at r.pos
    exchanges: list = []  # (rank state, timeline index, group): end times filled in at the end
    progress = True
    while progress:
        progress = False
        for r in ranks:
            while r.pos < len(r.row):
                if not _step(r, schedule, streams, inputs[r.rank], posted_at, cost, memory,
                             blocking, exchanges):
                    break
                r.pos, progress = r.pos + 1, True
    _check_finished(schedule, ranks, streams, inputs, posted_at)
    for r, i, group in exchanges:
        r.timeline[i] = TimedAction(action=r.timeline[i].action, start=r.timeline[i].start,
                                    end=group.done)
    return result_of(ranks)


def _step(r, schedule, streams, inputs, posted_at, cost, memory, blocking, exchanges) -> bool:
    action = r.row[r.pos]
    kind = action.kind
    if kind.is_compute:
        group = inputs.get((kind, action.index, action.stage))
        check_compute(schedule, r, action, group is not None)
        if group is not None and group.done is None:
            return False
        start = r.clock if group is None else max(r.clock, group.done)
        run_compute(r, action, start, cost, memory)
        return True
    if kind is not _EXCHANGE and not (kind.is_send or kind.is_recv):
        r.timeline.append(TimedAction(action=action, start=r.clock, end=r.clock))
        return True  # REDUCE_GRAD
    group = posted_at[r.rank] or _post(r, schedule, streams, inputs, action)
    if blocking and group.done is None:
        posted_at[r.rank] = group
        return False
    posted_at[r.rank] = None
    if blocking:
        r.clock = max(r.clock, group.done)
    exchanges.append((r, len(r.timeline), group))
    r.timeline.append(TimedAction(action=action, start=group.ops[0].posted, end=r.clock))
    return True


def _post(r, schedule, streams, inputs, action) -> _Group:
    group = _Group(r.rank, r.pos)
    num, ranks = schedule.num_stages, schedule.num_ranks
    for op in (action.ops if action.kind is _EXCHANGE else (action,)):
        stage, kind, index, _ = op
        other = stage + 1 if kind.is_forward == kind.is_send else stage - 1
        if not 0 <= other < num:
            protocol_error(schedule, r, f"{op} has no peer: there is no stage {other}")
        if kind.is_send and (kind.compute, index, stage) not in r.done:
            protocol_error(schedule, r, f"sends {kind.compute.value}{index} before computing it")
        if stage % ranks != r.rank:
            protocol_error(schedule, r, f"{op} belongs to rank {stage % ranks}")
        group.ops.append(_Op(op, r.rank, other % ranks, other, group, r.clock))
        if kind.is_recv:
            inputs[(kind.compute, index, stage)] = group
    group.left = len(group.ops)
    try:
        streams.post(group)
    except _Mismatch as bad:
        recv, send = bad.recv, bad.send
        raise _error_at(schedule, _where(recv), f"posting order mismatch: {recv.action} meets "
                                f"{send.action} of rank {send.rank} (step {send.group.step}) on "
                                "their channel") from None
    return group


def _where(op: _Op) -> tuple[int, int]:
    return op.rank, op.group.step


def _error_at(schedule: Schedule, where: tuple[int, int], problem: str) -> Exception:
    rank, step = where
    return ScheduleError(f"rank {rank} step {step}: {schedule.actions[rank][step]} {problem}\n"
                         + format_grid(schedule, {where: problem}))


def _check_finished(schedule, ranks, streams, inputs, posted_at) -> None:
    marks, lines = {}, []
    for r in ranks:
        if r.pos == len(r.row):
            continue
        action = r.row[r.pos]
        if posted_at[r.rank] is not None:
            group = posted_at[r.rank]
            what = f"its exchange {action} to complete"
        else:
            group = inputs[r.rank][(action.kind, action.index, action.stage)]
            what = f"{_ops_text(group)} (posted at step {group.step}) for its input"
        marks[(r.rank, r.pos)] = "waits"
        lines.append(f"rank {r.rank} waits at step {r.pos} ({action}) for {what}; "
                     + "; ".join(_why(op, streams) for op in group.ops if op.done is None))
    if lines:
        raise DeadlockError("deadlock under NCCL semantics (one FIFO stream per rank pair, "
                            "rendezvous sends):\n  " + "\n  ".join(lines) + "\n"
                            + format_grid(schedule, marks))
    for queue in streams.fifo.values():
        for op in queue:
            if op.done is None:
                raise _error_at(schedule, _where(op), f"{op.action}: rank {op.peer} never "
                                        f"{'receives' if op.action.kind.is_send else 'sends'} it")


def _ops_text(group: _Group) -> str:
    return "+".join(str(op.action) for op in group.ops)


def _why(op: _Op, streams: _Streams, depth: int = 1) -> str:
    """Why `op` (rank op.rank) has not completed: who it waits on (and, `depth` levels deep,
    on whom that waits)."""
    blocker = _blocker(op, streams)
    if blocker is not None:
        text = (f"{op.action} is queued behind {blocker.action} (step {blocker.group.step}) in "
                f"rank {op.rank}'s stream to rank {op.peer}")
        return text + (f", and {_why(blocker, streams, depth - 1)}" if depth else "")
    other = op.partner
    if other is None:
        verb = "receive" if op.action.kind.is_send else "send"
        return f"{op.action} waits for rank {op.peer} to post the matching {verb}"
    blocker = _blocker(other, streams)
    text = f"{op.action} waits for rank {other.rank}'s {other.action} (step {other.group.step})"
    if blocker is not None:
        text += (f", queued behind {blocker.action} (step {blocker.group.step}) in its stream to "
                 f"rank {op.rank}")
    return text


def _blocker(op: _Op, streams: _Streams) -> Optional[_Op]:
    if op.ready is not None:
        return None
    queue = streams.fifo[(op.rank, op.peer)]
    return queue[streams.head[(op.rank, op.peer)]]
