"""All pipeline point-to-point traffic of the prefix-reuse executor, in one place.

[Note: p2p ordering rule]
Every rank holds the same lowered schedule, so for each ordered pair of neighbouring ranks
(a -> b) the sequence of tensors a sends equals, in order, the sequence b receives; the
lowering pass produces that and the simulator checks it (prefix_schedule/pipeline/lowering.py,
simulate.py). Matching is therefore FIFO per direction and never depends on two same-shaped
tensors racing: with PP=2 the previous and next peer are the same rank, but the two directions
carry different kinds of traffic (0 -> 1 forward activations, 1 -> 0 gradients) and each is
matched in its own posting order. NCCL matches same-peer operations in FIFO order too, so the
rule holds there; gloo gets a per-direction tag on top.

Sends are posted asynchronously (`isend`) and their handles kept until `wait_all()`: a blocking
send on both sides of a pair (stage s sends a forward while stage s+1 sends a backward) would
deadlock, and asynchronous sends make the schedule's receive order the only thing that matters.
Receives block. Shapes are never exchanged: every rank derives them from the shared plan.

Set PREFIX_REUSE_P2P_LOG=1 to log every operation with rank, step counter and label (hangs
then show the last operation each rank posted).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["PipelineP2P"]

_LOG = logging.getLogger("megatron_patches.p2p")
_TAG_FORWARD, _TAG_BACKWARD = 1, 2


class PipelineP2P:
    """Asynchronous sends / blocking receives between neighbouring pipeline stages."""

    def __init__(self, *, group, prev_rank: Optional[int], next_rank: Optional[int],
                 rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.group = group
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.rank = rank
        self.dtype = dtype
        self.device = device
        self._pending: List = []
        self._count = 0
        self._verbose = os.environ.get("PREFIX_REUSE_P2P_LOG", "") not in ("", "0")
        # gloo honours tags; NCCL ignores them (FIFO per pair, see the note above).
        self._use_tags = dist.get_backend(group) == "gloo"

    def _log(self, op: str, peer: int, label: str, shape) -> None:
        self._count += 1
        if self._verbose:
            _LOG.warning("[p2p rank %d #%d] %s %s peer=%d shape=%s", self.rank, self._count, op,
                         label, peer, tuple(shape))

    def _send(self, tensor: torch.Tensor, peer: int, tag: int, label: str) -> None:
        tensor = tensor.detach().contiguous()
        self._log("send", peer, label, tensor.shape)
        handle = dist.isend(tensor, dst=peer, group=self.group,
                            tag=tag if self._use_tags else 0)
        self._pending.append((handle, tensor))  # keep the buffer alive until the send is done

    def _recv(self, shape: Sequence[int], peer: int, tag: int, label: str,
              requires_grad: bool) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=self.dtype, device=self.device)
        self._log("recv", peer, label, buffer.shape)
        dist.irecv(buffer, src=peer, group=self.group, tag=tag if self._use_tags else 0).wait()
        return buffer.requires_grad_(requires_grad)

    def send_forward(self, tensor: torch.Tensor, label: str) -> None:
        """Activations to the next stage."""
        assert self.next_rank is not None, f"{label}: the last stage sends no activations"
        self._send(tensor, self.next_rank, _TAG_FORWARD, label)

    def recv_forward(self, shape: Sequence[int], label: str) -> torch.Tensor:
        """Activations from the previous stage (a leaf that collects its gradient)."""
        assert self.prev_rank is not None, f"{label}: the first stage receives no activations"
        return self._recv(shape, self.prev_rank, _TAG_FORWARD, label, requires_grad=True)

    def send_backward(self, tensor: torch.Tensor, label: str) -> None:
        """Gradient of this stage's input to the previous stage."""
        assert self.prev_rank is not None, f"{label}: the first stage sends no gradients"
        self._send(tensor, self.prev_rank, _TAG_BACKWARD, label)

    def recv_backward(self, shape: Sequence[int], label: str) -> torch.Tensor:
        """Gradient of this stage's output from the next stage."""
        assert self.next_rank is not None, f"{label}: the last stage receives no gradients"
        return self._recv(shape, self.next_rank, _TAG_BACKWARD, label, requires_grad=False)

    def wait_all(self) -> None:
        """Complete every outstanding send (end of step)."""
        for handle, _ in self._pending:
            handle.wait()
        self._pending.clear()
