"""All pipeline point-to-point traffic of the prefix-reuse executor, in one place.

[Note: p2p ordering rule (NCCL's, not gloo's)]
Every rank holds the same lowered schedule. Each p2p entry of a rank's row -- one send, one
receive, or a grouped exchange of several -- is posted as ONE `torch.distributed.
batch_isend_irecv` call, as Megatron's p2p_communication does with `batch_p2p_comm=True`
(`_batched_p2p_ops`), in row order. What that means on NCCL (PyTorch ProcessGroupNCCL): batched
ops run on the process group's own communicator and CUDA stream, so all p2p entries of a rank
form ONE FIFO, whichever peer they talk to; an entry completes only when every op in it has met
its peer's matching op (a large send waits for the receiver: rendezvous), and the next entry
starts after it. Matching is FIFO per (sender, receiver) pair with no tags: the k-th tensor that
a sends to b is the k-th that b receives from a. So, for the schedule to run:
  1. per ordered pair (a -> b), b's receives from a name, in order, exactly a's sends to b
     (prefix_schedule/pipeline/lowering.py, [Note: p2p posting order]);
  2. no two ranks may each wait, at the head of their FIFO, on an op that the other posts
     behind its own head (two crossing sends deadlock: lowering pairs them into one grouped
     exchange, as Megatron's send_forward_recv_backward does). The schedule layer proves its
     plans deadlock-free even when the host waits for each exchange before posting the next
     (prefix_schedule/pipeline/nccl.py, blocking mode), which covers one FIFO per rank; this
     module never reorders anything.
Gloo buffers sends and would hide rule 2: `PREFIX_REUSE_P2P_STRICT=1` (tests) replaces the
transport by `_StrictGlooTransport`, which emulates the NCCL semantics above on gloo.

Receives return a `Received` handle; the data is waited for only when a compute needs it (the
compute stream waits on NCCL; the host does not). A sent tensor is held until its work has
completed, then released (`release_completed`), so memory follows the schedule, not the step.
Shapes are never exchanged: every rank derives them from the shared plan.

Set PREFIX_REUSE_P2P_LOG=1 to log every operation with rank, per-rank counter and label (a hang
then shows the last operation each rank posted).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["P2POp", "PipelineP2P", "Received", "P2PDeadlockError", "strict_mode_requested"]

_LOG = logging.getLogger("megatron_patches.runtime.p2p")
STRICT_ENV = "PREFIX_REUSE_P2P_STRICT"
STALL_ENV = "PREFIX_REUSE_P2P_STRICT_STALL_S"
_DATA_TAG, _ACK_TAG = 0, 1


class P2PDeadlockError(RuntimeError):
    """Strict mode: an operation waited longer than the stall limit for its peer."""


def strict_mode_requested() -> bool:
    """True when PREFIX_REUSE_P2P_STRICT is set (to anything but '' or '0')."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


@dataclasses.dataclass(kw_only=True)
class P2POp:
    """One send (`tensor` set) or receive (`shape` set) of an entry."""

    peer: int
    """Global rank of the other side."""
    label: str
    """What it carries (the schedule action), for logs and errors."""
    tensor: Optional[torch.Tensor] = None
    """The data to send (None for a receive)."""
    shape: Optional[Sequence[int]] = None
    """Shape of the buffer to receive into (None for a send)."""
    requires_grad: bool = False
    """Whether the received buffer is a leaf that collects its gradient."""
    is_send: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.is_send = self.tensor is not None


class Received:
    """A posted receive; `wait()` returns the filled buffer (idempotent)."""

    def __init__(self, buffer: torch.Tensor, requires_grad: bool, wait: Callable[[], None]):
        self._buffer, self._requires_grad, self._wait = buffer, requires_grad, wait

    def wait(self) -> torch.Tensor:
        if self._wait is not None:
            self._wait()
            self._wait = None
            self._buffer.requires_grad_(self._requires_grad)
        return self._buffer


class PipelineP2P:
    """Posts one row entry at a time; see [Note: p2p ordering rule (NCCL's, not gloo's)]."""

    def __init__(self, *, group, rank: int, dtype: torch.dtype, device: torch.device,
                 strict: Optional[bool] = None) -> None:
        self.rank, self.dtype, self.device = rank, dtype, device
        strict = strict_mode_requested() if strict is None else strict
        if strict and dist.get_backend(group) != "gloo":
            raise ValueError(f"{STRICT_ENV}=1 emulates NCCL on gloo for tests; the pipeline group "
                             f"uses {dist.get_backend(group)!r}: unset {STRICT_ENV}")
        self._transport = _StrictGlooTransport(group, rank) if strict else _BatchedTransport(group)
        self._count = 0
        self._verbose = os.environ.get("PREFIX_REUSE_P2P_LOG", "") not in ("", "0")

    def post(self, ops: Sequence[P2POp]) -> List[Optional[Received]]:
        """Post `ops` as one entry (one batch_isend_irecv); a `Received` per receive, else None."""
        buffers: List[Optional[torch.Tensor]] = []
        for op in ops:
            if op.is_send:
                op.tensor = op.tensor.detach().contiguous()
                buffers.append(None)
            else:
                buffers.append(torch.empty(tuple(op.shape), dtype=self.dtype, device=self.device))
            self._log(op, op.tensor if op.is_send else buffers[-1])
        wait = self._transport.post(list(ops), buffers)
        return [None if b is None else Received(b, op.requires_grad, wait)
                for op, b in zip(ops, buffers)]

    def send(self, tensor: torch.Tensor, peer: int, label: str) -> None:
        """A single send (an entry of one)."""
        self.post([P2POp(peer=peer, label=label, tensor=tensor)])

    def recv(self, shape: Sequence[int], peer: int, label: str, requires_grad: bool) -> Received:
        """A single receive (an entry of one)."""
        return self.post([P2POp(peer=peer, label=label, shape=shape,
                                requires_grad=requires_grad)])[0]

    def release_completed(self) -> None:
        """Drop the sent tensors whose work has completed."""
        self._transport.release_completed()

    def wait_all(self) -> None:
        """Complete every posted entry (end of step)."""
        self._transport.wait_all()

    def _log(self, op: P2POp, tensor: torch.Tensor) -> None:
        self._count += 1
        if self._verbose:
            _LOG.warning("[p2p rank %d #%d] %s %s peer=%d shape=%s", self.rank, self._count,
                         "send" if op.is_send else "recv", op.label, op.peer, tuple(tensor.shape))


class _BatchedTransport:
    """The product path: each entry is one batch_isend_irecv on the pipeline group."""

    def __init__(self, group) -> None:
        self.group = group
        self._sends: List[tuple] = []  # (works, labels, tensors) of entries with sends

    def post(self, ops: List[P2POp], buffers) -> Callable[[], None]:
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend if op.is_send else dist.irecv,
                       op.tensor if op.is_send else buffer, op.peer, self.group)
            for op, buffer in zip(ops, buffers)])
        sent = [op.tensor for op in ops if op.is_send]
        if sent:  # the tensors stay referenced until their work completes
            self._sends.append((works, sent))

        def wait() -> None:
            for work in works:
                work.wait()
        return wait

    def release_completed(self) -> None:
        self._sends = [entry for entry in self._sends
                       if not all(work.is_completed() for work in entry[0])]

    def wait_all(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends.clear()


@dataclasses.dataclass(eq=False)
class _Entry:
    ops: List[P2POp]
    buffers: List[Optional[torch.Tensor]]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[BaseException] = None

    def describe(self) -> str:
        return "[" + ", ".join(f"{'send' if op.is_send else 'recv'} {op.label} "
                               f"{'to' if op.is_send else 'from'} {op.peer}"
                               for op in self.ops) + "]"


class _StrictGlooTransport:
    """TEST-ONLY: NCCL's p2p semantics on gloo (see the note at the top of this module).

    One worker thread runs this rank's entries one after another (the FIFO). An entry posts all
    its ops at once (a grouped exchange completes as one); a receive acknowledges its data to
    the sender; a send completes only when its acknowledgement arrives, i.e. when the receiver
    has posted the matching receive (rendezvous, as for a large NCCL message). Data travel on
    one tag per pair in both directions, so FIFO matching is exercised as NCCL does it. A wait
    longer than PREFIX_REUSE_P2P_STRICT_STALL_S (default 60) seconds raises P2PDeadlockError
    with this rank's FIFO.
    """

    def __init__(self, group, rank: int) -> None:
        self.group, self.rank = group, rank
        self.stall_s = float(os.environ.get(STALL_ENV, "60"))
        self._fifo: "queue.Queue[Optional[_Entry]]" = queue.Queue()
        self._posted: List[_Entry] = []
        self._acks: List = []  # acknowledgements sent by the worker
        self._thread = threading.Thread(target=self._work, name="strict-p2p", daemon=True)
        self._thread.start()

    def post(self, ops: List[P2POp], buffers) -> Callable[[], None]:
        entry = _Entry(ops=ops, buffers=buffers)
        self._posted.append(entry)
        self._fifo.put(entry)
        return lambda: self._wait(entry)

    def _wait(self, entry: _Entry) -> None:
        if not entry.done.wait(self.stall_s):
            pending = [e.describe() for e in self._posted if not e.done.is_set()]
            raise P2PDeadlockError(
                f"p2p deadlock (strict NCCL semantics): rank {self.rank} waited "
                f"{self.stall_s:.0f} s for {entry.describe()}; its unfinished entries, oldest "
                f"first (the first one heads its FIFO): {pending}")
        if entry.error is not None:
            raise RuntimeError(f"rank {self.rank}: p2p entry {entry.describe()} failed") \
                from entry.error

    def _work(self) -> None:
        while (entry := self._fifo.get()) is not None:
            try:
                self._run(entry)
            except BaseException as error:  # noqa: BLE001 -- reported by the waiting thread
                entry.error = error
            for op in entry.ops:
                op.tensor = None  # the send has completed: release its buffer
            entry.done.set()

    def _run(self, entry: _Entry) -> None:
        group = self.group
        sends = [op for op in entry.ops if op.is_send]
        acks_in = [dist.irecv(torch.zeros(1, dtype=torch.int32), op.peer, group, _ACK_TAG)
                   for op in sends]
        works = [dist.isend(op.tensor, op.peer, group, _DATA_TAG) for op in sends]
        recvs = [(op, dist.irecv(buffer, op.peer, group, _DATA_TAG))
                 for op, buffer in zip(entry.ops, entry.buffers) if not op.is_send]
        for op, work in recvs:
            work.wait()
            self._acks.append(dist.isend(torch.ones(1, dtype=torch.int32), op.peer, group,
                                         _ACK_TAG))
        for work in works + acks_in:
            work.wait()

    def release_completed(self) -> None:
        self._posted = [e for e in self._posted if not e.done.is_set() or e.error is not None]

    def wait_all(self) -> None:
        for entry in list(self._posted):
            self._wait(entry)
        self._fifo.put(None)
        self._thread.join()
        for work in self._acks:
            work.wait()
        self._acks.clear()
        self._posted.clear()
