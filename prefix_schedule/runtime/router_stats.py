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

[Note: prefix router stats under full recompute]
With Megatron's full activation recompute Phase A runs the prefix under no_grad ([Note: prefix
full recompute] in docs/DESIGN.md): it records the same sums as values (no graph; Phase B only
reads values and accumulates their gradients into the entry) and counts the expert bias there,
once, as above: keyed on the step's recompute mode (`PrefixForwardContext.full_recompute`), not
on grad mode. A forward-only step keeps Megatron's checkpoints in Phase A, so its routers count
by grad mode exactly where stock's do (nothing inside a checkpoint). Phase C re-runs the prefix
with Megatron's checkpoints; wherever a router runs with grad in that re-run (a checkpoint's
recompute inside backward, or a layer the `block` method runs whole), it recomputes the sums
with their graph from the re-run logits and wraps its returned probabilities in `inject`, whose
backward hands the sums the accumulated fp32 `grad_probs` / `grad_lse2` (as a recurrent state's
gradient is injected, state_cache.py): the probabilities feed the layer's output, so the
backward reaches them. A last stage without a final norm re-runs its prefix whole instead and
`rebind`s the sums' graph to the entry, which Phase C's autograd call then drives through
`backward_pairs`. Dense full recompute counts its aux losses, z-loss and expert bias only in its
re-run (grad enabled), once: so does reuse.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Optional, Tuple

import torch

__all__ = ["RouterStats", "PrefixRouterRead", "inject", "rebind"]


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


class _InjectStatsGrad(torch.autograd.Function):
    """Identity on a router's probabilities whose backward also gives the prefix sums recomputed
    with them (`probs`, `lse2`) the entry's accumulated gradients, read when the backward runs."""

    @staticmethod
    def forward(ctx, out, probs, lse2, entry):
        ctx.entry = entry
        ctx.meta = ((probs.shape, probs.dtype), (lse2.shape, lse2.dtype))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        grads = []
        for grad, (shape, dtype), needed in zip((ctx.entry.grad_probs, ctx.entry.grad_lse2),
                                                ctx.meta, ctx.needs_input_grad[1:3]):
            grads.append(grad.to(dtype).reshape(shape) if grad is not None and needed else None)
        return grad_out, grads[0], grads[1], None


def inject(entry: RouterStats, out: torch.Tensor, recomputed: RouterStats) -> torch.Tensor:
    """`out` (the router's probabilities) whose backward also drives `recomputed`'s sums (the
    re-run's, with graph) with `entry`'s accumulated gradients: [Note: prefix router stats under
    full recompute]."""
    _check_same(entry, recomputed)
    return _InjectStatsGrad.apply(out, recomputed.probs_graph, recomputed.lse2_graph, entry)


def rebind(entry: RouterStats, recomputed: RouterStats) -> None:
    """The re-run's sums (same values, now with their graph) become `entry`'s graph tensors; its
    leaves and gradients stay."""
    _check_same(entry, recomputed)
    entry.probs_graph, entry.lse2_graph = recomputed.probs_graph, recomputed.lse2_graph


def _check_same(entry: RouterStats, recomputed: RouterStats) -> None:
    assert (recomputed.num_tokens == entry.num_tokens
            and recomputed.probs_graph.shape == entry.probs_graph.shape), (
        "the re-run prefix routed another number of tokens or experts than Phase A")
