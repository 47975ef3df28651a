"""MoE router statistics of a cached prefix: what Phase A records, Phase B reads, Phase C drains.

[Note: logical prefix tokens]
Dense training routes every prefix token once per trajectory that holds it; reuse routes it once.
Every router-wide quantity of a suffix microbatch must therefore count the prefix tokens of the
trajectories it holds with their multiplicity, as the dense microbatch holding those
trajectories would ("the dense packing", docs/DESIGN.md "MoE"). Per (group, chunk, MoE layer)
Phase A records, from the real (unpadded) prefix tokens:
- `counts` [E]: top-k assignments of the aux-loss routing (no grad: Megatron counts a map);
- `probs` [E]: the sum of the aux-loss scores, carrying the prefix graph;
- `lse2` []: the sum of logsumexp(logits)^2 (z-loss), carrying the prefix graph;
- `num_tokens`.
A sum no statistic reads (scores without aux losses, lse2 without z-loss) is a constant zero
with no graph: Phase C then runs no backward for it.
A suffix microbatch holding n_g trajectories of group g adds n_g x these to its own sums
(probabilities through `read`, whose backward accumulates the prefix's share of the aux-loss and
z-loss gradient in fp32, as gK/gV do); Phase C runs backward once from `probs` / `lse2` with the
accumulated gradients, together with K/V. Counts for the aux-loss-free expert bias are added in
Phase A, multiplicity times, and never again (not by a Phase C recompute).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Tuple

import torch

__all__ = ["RouterStats", "PrefixRouterRead"]


@dataclasses.dataclass(eq=False)
class RouterStats:
    """One (group, chunk, layer)'s prefix router statistics."""

    counts: torch.Tensor
    """[E] fp32 top-k assignments of the aux-loss routing over the real prefix tokens."""
    probs_graph: torch.Tensor
    """[E] sum of the aux-loss scores over the real prefix tokens, with the prefix graph."""
    lse2_graph: torch.Tensor
    """[] sum of logsumexp(router logits)^2 over the real prefix tokens, with the prefix graph."""
    num_tokens: int
    """Real prefix tokens routed."""
    probs_leaf: torch.Tensor = dataclasses.field(init=False)
    lse2_leaf: torch.Tensor = dataclasses.field(init=False)
    grad_probs: Optional[torch.Tensor] = None
    grad_lse2: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.counts = self.counts.detach().float()
        self.probs_leaf = self.probs_graph.detach().float().requires_grad_(True)
        self.lse2_leaf = self.lse2_graph.detach().float().requires_grad_(True)

    def accumulate(self, g_probs: Optional[torch.Tensor], g_lse2: Optional[torch.Tensor]) -> None:
        if g_probs is not None:
            self.grad_probs = (g_probs.float().clone() if self.grad_probs is None
                               else self.grad_probs.add_(g_probs))
        if g_lse2 is not None:
            self.grad_lse2 = (g_lse2.float().clone() if self.grad_lse2 is None
                              else self.grad_lse2.add_(g_lse2))

    def backward_pairs(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """(graph tensor, accumulated gradient) pairs for Phase C."""
        for graph, grad in ((self.probs_graph, self.grad_probs), (self.lse2_graph, self.grad_lse2)):
            if grad is not None and graph.requires_grad:
                yield graph, grad.to(graph.dtype).reshape(graph.shape)


class _AccumulateStats(torch.autograd.Function):
    """Identity on the prefix sums whose backward adds the gradient into the entry's buffers."""

    @staticmethod
    def forward(ctx, probs, lse2, entry):
        ctx.entry = entry
        ctx.set_materialize_grads(False)  # an unused sum (no z-loss, say) gets no zero buffer
        return probs.view_as(probs), lse2.view_as(lse2)

    @staticmethod
    def backward(ctx, g_probs, g_lse2):
        ctx.entry.accumulate(g_probs, g_lse2)
        return None, None, None


@dataclasses.dataclass(frozen=True)
class PrefixRouterRead:
    """A group's prefix statistics at one layer, all chunks summed (what a suffix reads)."""

    counts: torch.Tensor
    """[E] detached."""
    probs: torch.Tensor
    """[E] differentiable: its gradient lands in the chunks' buffers."""
    lse2: torch.Tensor
    """[] differentiable, likewise."""
    num_tokens: int


def read_stats(entries: List[RouterStats]) -> PrefixRouterRead:
    """Sum `entries` (a group's chunks at one layer) through their gradient accumulators."""
    parts = [_AccumulateStats.apply(e.probs_leaf, e.lse2_leaf, e) for e in entries]
    return PrefixRouterRead(counts=sum(e.counts for e in entries),
                            probs=sum(p for p, _ in parts), lse2=sum(z for _, z in parts),
                            num_tokens=sum(e.num_tokens for e in entries))
