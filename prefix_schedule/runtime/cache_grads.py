"""The per-entry pieces of the prefix K/V cache (runtime/cache.py): an entry's tensors and fp32
gradient buffers, and the two autograd Functions through which suffix reads accumulate gK/gV into
those buffers and Phase C hands them to the prefix graph ([Note: gradient accumulation into the
cache] in docs/DESIGN.md). Private to the cache: PrefixKVCache is the API.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, List, Optional, Tuple

import torch

__all__: list = []  # private helpers of runtime/cache.py


@dataclasses.dataclass(eq=False)
class _Entry:
    k_graph: torch.Tensor  # as stored, with the prefix graph (any layout; [L, 1, H, D] from Megatron)
    v_graph: torch.Tensor
    k_leaf: Optional[torch.Tensor]  # [L, H, D] detached, requires_grad: reads build a node
    v_leaf: Optional[torch.Tensor]
    grad_k: Optional[torch.Tensor] = None  # fp32 [L, H, D], allocated at the first gradient
    grad_v: Optional[torch.Tensor] = None
    num_reads: int = 0
    pending: Optional[Callable] = None  # CP packed rows: () -> (k, v) once the gather is done

    def leaves(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The detached whole K/V, waiting for a pending gather first ([Note: packed CP prefix
        rows] in runtime/cp.py)."""
        if self.pending is not None:
            k, v = self.pending()
            self.k_leaf = k.detach().requires_grad_(True)
            self.v_leaf = v.detach().requires_grad_(True)
            self.pending = None
        return self.k_leaf, self.v_leaf

    def accumulate(self, gk: Optional[torch.Tensor], gv: Optional[torch.Tensor]) -> None:
        # fp32 accumulation: the sum over many microbatches keeps the bits dense training keeps.
        k_leaf, v_leaf = self.leaves()
        if gk is not None:
            if self.grad_k is None:
                self.grad_k = torch.zeros(k_leaf.shape, dtype=torch.float32, device=gk.device)
            self.grad_k.add_(gk)
        if gv is not None:
            if self.grad_v is None:
                self.grad_v = torch.zeros(v_leaf.shape, dtype=torch.float32, device=gv.device)
            self.grad_v.add_(gv)

    def backward_pairs(self) -> List[tuple]:
        return [(self.k_graph, self.grad_k), (self.v_graph, self.grad_v)]

    def graphs(self) -> Iterator[torch.Tensor]:
        yield self.k_graph
        yield self.v_graph

    def owned(self) -> Iterator[torch.Tensor]:
        for t in (*self.leaves(), self.grad_k, self.grad_v):
            if t is not None:
                yield t


class _AccumulateInto(torch.autograd.Function):
    """Identity on the cached K/V whose backward adds the gradient into the entry's fp32 buffers."""

    @staticmethod
    def forward(ctx, k, v, entry):
        ctx.entry = entry
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gk, gv):
        ctx.entry.accumulate(gk, gv)
        return None, None, None


class _InjectGrads(torch.autograd.Function):
    """Identity on an attention output whose backward also gives the K/V it was computed from
    the entry's accumulated gK/gV (read when the backward runs: after every suffix read)."""

    @staticmethod
    def forward(ctx, out, k, v, entry, padding):
        ctx.entry, ctx.padding = entry, padding
        ctx.meta = (k.shape, k.dtype, v.shape, v.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        k_shape, k_dtype, v_shape, v_dtype = ctx.meta
        grads = []
        for grad, shape, dtype in ((ctx.entry.grad_k, k_shape, k_dtype),
                                   (ctx.entry.grad_v, v_shape, v_dtype)):
            if grad is not None:
                grad = grad.to(dtype).reshape(shape[0] - ctx.padding, *shape[1:])
                if ctx.padding:  # padding rows were never cached: no gradient from the cache
                    grad = torch.cat([grad, grad.new_zeros((ctx.padding,) + tuple(shape[1:]))])
            grads.append(grad)
        return grad_out, grads[0], grads[1], None, None



def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of just its elements when it views a larger storage."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t
