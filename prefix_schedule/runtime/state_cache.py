"""Cache entries for layers whose prefix is summarised by a recurrent state instead of K/V.

[Note: recurrent prefix state]
A linear-attention or state-space layer (Gated DeltaNet; Mamba-2 alike) carries, at the end of a
prefix, a fixed-size state per sequence: the recurrent state (GDN: [HV, K, V] per value head) and
the short causal convolution's tail (the last kernel_size - 1 *inputs* of the conv). A suffix
resumes from them exactly: in real arithmetic the layer's output on [prefix; suffix] equals the
prefix run followed by the suffix run started from that state. So Phase A stores each named state
tensor of the layer (with its prefix graph), Phase B reads a detached leaf of it per suffix
sequence -- every sequence of a packed row starts from its own group's state -- and the read's
backward adds d(state) into an fp32 buffer, exactly like gK/gV ([Note: gradient accumulation into
the cache] in docs/DESIGN.md). Phase C hands those buffers to the same autograd call as the
attention layers' gK/gV. The cache is layer-agnostic: a layer stores any named tensors
(`PrefixKVCache.store_state(group, layer, name, tensor)`), reads them back by name, and the cache
never looks inside.

Chunks: chunk c's state is the state after chunks 0..c (it started from chunk c-1's, or its
tree parent's), so a reader of a chain reads the state of the chunk its length ends with: the
last, or an earlier one (a trajectory following a tree node with children stops one token before
the node's end; StepPlan.state_reads cuts the node into units there). A reader that stops inside
a chunk would need a state in the middle of it: refused.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["CacheProtocolError", "StateCacheMixin", "StateEntry"]


class CacheProtocolError(RuntimeError):
    """A cache entry was used out of order (read after free, stored twice, ...)."""


@dataclasses.dataclass(eq=False)
class _State:
    graph: torch.Tensor  # as the layer produced it in Phase A (carries the prefix graph)
    leaf: torch.Tensor  # detached copy, requires_grad: reads build a node on it
    grad: Optional[torch.Tensor] = None  # fp32, allocated at the first gradient


class _AccumulateInto(torch.autograd.Function):
    """Identity on a cached state whose backward adds its gradient into the fp32 buffer."""

    @staticmethod
    def forward(ctx, leaf, state):
        ctx.state = state
        return leaf.view_as(leaf)

    @staticmethod
    def backward(ctx, grad):
        state = ctx.state
        if state.grad is None:
            state.grad = torch.zeros(state.leaf.shape, dtype=torch.float32, device=grad.device)
        state.grad.add_(grad)
        return None, None


class _InjectStateGrad(torch.autograd.Function):
    """Identity on a layer output whose backward also gives `tensor` (the state the layer
    reached, recomputed with its graph) the cached state's accumulated fp32 gradient, read when
    the backward runs: [Note: prefix full recompute] in docs/DESIGN.md. Nothing downstream of the
    layer consumes that state, so without this its gradient would never enter the backward."""

    @staticmethod
    def forward(ctx, out, tensor, state):
        ctx.state, ctx.dtype = state, tensor.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        grad = ctx.state.grad
        if grad is not None:
            grad = grad.to(ctx.dtype).reshape(ctx.state.leaf.shape)
        return grad_out, grad, None


@dataclasses.dataclass(eq=False)
class StateEntry:
    """The named state tensors one layer stored for one (group, chunk): [Note: recurrent prefix
    state]. Same protocol as a K/V entry: `backward_pairs` for Phase C, `owned` for accounting."""

    num_tokens: int
    """Real prefix tokens of the chunk the state summarises (the end of a reader's span)."""
    states: Dict[str, _State] = dataclasses.field(default_factory=dict)
    num_reads: int = 0

    def store(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.states:
            raise ValueError(f"state {name!r} stored twice")
        self.states[name] = _State(graph=tensor, leaf=tensor.detach().requires_grad_(True))

    def read(self, name: str) -> torch.Tensor:
        """The state `name` through an accumulator: its gradient lands in the fp32 buffer."""
        if name not in self.states:
            raise KeyError(name)
        self.num_reads += 1
        state = self.states[name]
        return _AccumulateInto.apply(state.leaf, state)

    def state(self, name: str, tensor: torch.Tensor) -> _State:
        """The stored state `name`, checked against a re-run's `tensor` of it."""
        if name not in self.states:
            raise KeyError(name)
        state = self.states[name]
        if tensor.shape != state.leaf.shape:
            raise ValueError(f"the re-run prefix forward gave state {name!r} of shape "
                             f"{tuple(tensor.shape)}, Phase A {tuple(state.leaf.shape)}")
        return state

    def backward_pairs(self) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(prefix-graph tensor, accumulated fp32 gradient or None) per stored state."""
        return [(s.graph, s.grad) for s in self.states.values()]

    def graphs(self) -> Iterator[torch.Tensor]:
        for s in self.states.values():
            yield s.graph

    def owned(self) -> Iterator[torch.Tensor]:
        """The detached copies and fp32 gradient buffers (not the prefix graphs)."""
        for s in self.states.values():
            yield s.leaf
            if s.grad is not None:
                yield s.grad


class StateCacheMixin:
    """`store_state` / `read_state` of PrefixKVCache (cache.py): state entries live beside the
    K/V entries in its (group, chunk) -> layer map and are freed with them."""

    def store_state(self, group: int, layer: int, name: str, tensor: torch.Tensor, *,
                    chunk: int = 0, num_tokens: int) -> None:
        """Keep the recurrent state `name` (with its prefix graph) that `layer` reached at the end
        of `group`'s chunk `chunk` ([Note: recurrent prefix state]); `num_tokens`: the chunk's
        real tokens."""
        self._check_live(group, chunk)
        layers = self._entries.setdefault((group, chunk), {})
        entry = layers.setdefault(layer, StateEntry(num_tokens=num_tokens))
        if not isinstance(entry, StateEntry):
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: holds K/V, not state")
        try:
            entry.store(name, tensor)
        except ValueError as error:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: {error}") from None
        self._to_local.setdefault((group, chunk), None)
        ptr = tensor.untyped_storage().data_ptr()
        self._storages[ptr] = self._storages.get(ptr, 0) + 1

    def rebind_state(self, group: int, layer: int, name: str, tensor: torch.Tensor, *,
                     chunk: int = 0) -> None:
        """Phase C under full recompute without checkpoints (`PrefixKVCache.rebind` for K/V):
        the re-run forward's `tensor` (same values, now with its graph) becomes the state's graph
        tensor; its leaf and fp32 gradient stay."""
        state = self._stored_state(group, chunk, layer, name, tensor)
        self._forget_storage(state.graph)
        ptr = tensor.untyped_storage().data_ptr()
        self._storages[ptr] = self._storages.get(ptr, 0) + 1
        state.graph = tensor

    def inject_state_grad(self, group: int, layer: int, name: str, out: torch.Tensor,
                          tensor: torch.Tensor, *, chunk: int = 0) -> torch.Tensor:
        """Phase C under full recompute with Megatron's checkpointing ([Note: prefix full
        recompute] in docs/DESIGN.md): `out` (the layer's output, computed along with the state
        `tensor` it reached at the end of the unit), whose backward also hands the state `name`'s
        accumulated fp32 gradient to `tensor`."""
        state = self._stored_state(group, chunk, layer, name, tensor)
        return _InjectStateGrad.apply(out, tensor, state)

    def _stored_state(self, group: int, chunk: int, layer: int, name: str,
                      tensor: torch.Tensor) -> _State:
        entry = self._entry(group, chunk, layer)
        if not isinstance(entry, StateEntry):
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: holds K/V, not state")
        try:
            return entry.state(name, tensor)
        except KeyError:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: no state {name!r} "
                                     "stored") from None
        except ValueError as error:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: {error}") from None

    def read_state(self, group: int, layer: int, name: str, *,
                   before_chunk: Optional[int] = None, chunks: Optional[Tuple[int, ...]] = None,
                   length: Optional[int] = None) -> torch.Tensor:
        """The state `name` of `layer` after the chunks a reader attends to (as `read` selects
        them: its last chunk's state); gradients accumulate in that chunk's fp32 buffer. A
        `length` that ends inside the chain is refused (no state mid-chunk)."""
        if chunks is None:
            chunks = (tuple(self._chunks(group)) if before_chunk is None
                      else tuple(range(before_chunk)))
        if not chunks:
            raise CacheProtocolError(f"group {group}: a state read of no chunks")
        entries = [self._entry(group, c, layer) for c in chunks]
        if not all(isinstance(e, StateEntry) for e in entries):
            raise CacheProtocolError(f"group {group} layer {layer}: holds K/V, not state")
        ends = [sum(e.num_tokens for e in entries[:i + 1]) for i in range(len(entries))]
        last = len(entries) - 1 if length is None or length not in ends else ends.index(length)
        if length is not None and length != ends[last]:
            raise ValueError(f"group {group}: a reader attends to {length} of the {ends[-1]} "
                             "cached tokens of its chain, inside a prefix unit; a recurrent "
                             "layer's state exists only at a unit's end (plan with "
                             "plan_microbatches(..., state_reads=True))")
        try:
            return entries[last].read(name)
        except KeyError:
            raise CacheProtocolError(f"{_name(group, chunks[last])} layer {layer}: no state "
                                     f"{name!r} stored") from None


def _name(group: int, chunk: int) -> str:
    return f"group {group}" if chunk == 0 else f"group {group} chunk {chunk}"
