"""The prefix K/V cache of one training step: Phase A fills it, Phase B reads it, Phase C drains it.

See [Note: gradient accumulation into the cache] in docs/DESIGN.md. Per (group, layer) an entry
holds the K/V exactly as the attention hook saw them (post-RoPE, carrying the prefix graph), a
detached copy that suffix microbatches read, and fp32 gradient buffers that every read's backward
adds into. A group's entries are consumed once by `backward(group)` and then freed; any use after
that is a protocol error and raises.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["PrefixKVCache", "CacheProtocolError"]


class CacheProtocolError(RuntimeError):
    """A cache entry was used out of order (read after free, stored twice, ...)."""


@dataclasses.dataclass(eq=False)
class _Entry:
    k_graph: torch.Tensor  # as stored, with the prefix graph (any layout; [L, 1, H, D] from Megatron)
    v_graph: torch.Tensor
    k_leaf: torch.Tensor  # [L, H, D] detached view, requires_grad so reads build a graph node
    v_leaf: torch.Tensor
    grad_k: Optional[torch.Tensor] = None  # fp32 [L, H, D], allocated at the first gradient
    grad_v: Optional[torch.Tensor] = None
    num_reads: int = 0

    def accumulate(self, gk: Optional[torch.Tensor], gv: Optional[torch.Tensor]) -> None:
        # fp32 accumulation: the sum over many microbatches keeps the bits dense training keeps.
        if gk is not None:
            if self.grad_k is None:
                self.grad_k = torch.zeros(self.k_leaf.shape, dtype=torch.float32, device=gk.device)
            self.grad_k.add_(gk)
        if gv is not None:
            if self.grad_v is None:
                self.grad_v = torch.zeros(self.v_leaf.shape, dtype=torch.float32, device=gv.device)
            self.grad_v.add_(gv)


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


class PrefixKVCache:
    """Per-step cache of prefix K/V for every (group, layer) on this rank."""

    def __init__(self) -> None:
        self._entries: Dict[int, Dict[int, _Entry]] = {}
        self._freed: set = set()

    # ---- Phase A
    def store(self, group: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep `k`, `v` (carrying the prefix graph) of `group` at `layer`.

        Megatron gives [L, 1, H, D] (sbhd, one row); they are read back as [L, H, D].
        """
        self._check_live(group)
        layers = self._entries.setdefault(group, {})
        if layer in layers:
            raise CacheProtocolError(f"group {group} layer {layer}: prefix K/V stored twice")
        if k.dim() == 4:
            assert k.shape[1] == 1 and v.shape[1] == 1, "prefix rows are run one group at a time"
        k_leaf = k.detach().reshape(k.shape[0], *k.shape[-2:]).requires_grad_(True)
        v_leaf = v.detach().reshape(v.shape[0], *v.shape[-2:]).requires_grad_(True)
        layers[layer] = _Entry(k_graph=k, v_graph=v, k_leaf=k_leaf, v_leaf=v_leaf)

    # ---- Phase B
    def read(self, group: int, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cached [L, H, D] K/V of `group` at `layer`; their gradients accumulate in fp32."""
        entry = self._entry(group, layer)
        entry.num_reads += 1
        return _AccumulateInto.apply(entry.k_leaf, entry.v_leaf, entry)

    # ---- Phase C
    def backward(self, group: int, *, output: Optional[torch.Tensor] = None,
                 output_grad: Optional[torch.Tensor] = None) -> None:
        """Run the prefix backward of `group` once with the accumulated gK/gV, then free it.

        On a pipeline stage before the last, the prefix's output hidden states (`output`) also
        get their gradient (`output_grad`) from the next stage's prefix backward: one
        autograd call covers both.
        """
        layers = self._live_layers(group)
        tensors: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        if output is not None and output_grad is not None and output.requires_grad:
            tensors.append(output)
            grads.append(output_grad)
        for entry in layers.values():
            for graph, grad in ((entry.k_graph, entry.grad_k), (entry.v_graph, entry.grad_v)):
                if grad is not None and graph.requires_grad:
                    tensors.append(graph)
                    grads.append(grad.to(graph.dtype).reshape(graph.shape))
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.free(group)

    def free(self, group: int) -> None:
        """Drop `group`'s entries (after Phase C, or without backward in forward-only steps)."""
        self._live_layers(group)
        del self._entries[group]
        self._freed.add(group)

    # ---- introspection
    def layers(self, group: int) -> Tuple[int, ...]:
        """Layers stored for `group` (sorted)."""
        return tuple(sorted(self._live_layers(group)))

    def live_groups(self) -> Tuple[int, ...]:
        """Groups with entries not yet freed."""
        return tuple(sorted(self._entries))

    def num_reads(self, group: int) -> int:
        """How many (microbatch, layer) reads `group` has served."""
        return sum(e.num_reads for e in self._live_layers(group).values())

    def nbytes(self) -> int:
        """Bytes held by live K/V copies and gradient buffers (excluding the prefix graphs)."""
        total = 0
        for layers in self._entries.values():
            for e in layers.values():
                for t in (e.k_leaf, e.v_leaf, e.grad_k, e.grad_v):
                    if t is not None:
                        total += t.numel() * t.element_size()
        return total

    def _check_live(self, group: int) -> None:
        if group in self._freed:
            raise CacheProtocolError(f"group {group}: its prefix cache was already freed")

    def _live_layers(self, group: int) -> Dict[int, _Entry]:
        self._check_live(group)
        if group not in self._entries:
            raise CacheProtocolError(f"group {group}: no prefix K/V stored (Phase A missing)")
        return self._entries[group]

    def _entry(self, group: int, layer: int) -> _Entry:
        layers = self._live_layers(group)
        if layer not in layers:
            raise CacheProtocolError(f"group {group} layer {layer}: no prefix K/V stored")
        return layers[layer]
