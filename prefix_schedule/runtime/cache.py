"""The prefix K/V cache of one training step: Phase A fills it, Phase B reads it, Phase C drains it.

See [Note: gradient accumulation into the cache] in docs/DESIGN.md. Per (group, chunk, layer) an
entry holds the K/V exactly as the attention hook saw them (post-RoPE, carrying the prefix graph),
a detached copy that suffix microbatches read, and fp32 gradient buffers that every read's
backward adds into. A chunk's entries are consumed once by `backward(group, chunk=c)` and then
freed; any use after that is a protocol error and raises. Unchunked prefixes are chunk 0.

[Note: CP prefix cache]
With context parallelism a rank runs only its zigzag rows of a prefix unit, but every suffix
query needs the whole prefix. Phase A's attention all-gathers each layer's K/V anyway; the entry
keeps that whole (real-token) K/V as the detached leaf that reads return, and its fp32 gK/gV
buffers are whole-prefix too: each rank accumulates what its own queries gave every prefix
token. Once, before the chunk's Phase C, one reduce-scatter over the CP group sums them and
hands each rank the rows it owns; the prefix backward then runs from those. No K/V moves in
Phase B beyond the suffix's own.

Chunks ([Note: prefix chunks] in units.py): a read of chunks 0..n-1 returns their K/V
concatenated along the tokens, each chunk through its own accumulator, so a gradient slice lands
in the buffer of the chunk it belongs to; chunk c's forward reads chunks < c that way, so chunk
c's backward feeds the buffers of the earlier chunks, which therefore run backward later.
Prefix trees ([Note: prefix trees] in planning/tree.py): `set_tree` gives a group's chunk
parents; a read names the chain it attends to (`chunks=`), and a chunk's backward waits for its
children instead of chunk c+1.
Recurrent layers (GDN, Mamba) store named state tensors instead: `store_state` / `read_state`,
[Note: recurrent prefix state] in state_cache.py; Phase C drains both kinds in one call.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from prefix_schedule.runtime.cache_grads import _AccumulateInto, _compact, _Entry, _InjectGrads
from prefix_schedule.runtime import router_stats
from prefix_schedule.runtime.router_stats import PrefixRouterRead, RouterStats, read_stats
from prefix_schedule.runtime.state_cache import CacheProtocolError, StateCacheMixin, StateEntry

__all__ = ["PrefixKVCache", "CacheProtocolError"]


class PrefixKVCache(StateCacheMixin):
    """Per-step cache of prefix K/V for every (group, chunk, layer) on this rank (and the
    recurrent layers' states: StateCacheMixin)."""

    def __init__(self) -> None:
        self._entries: Dict[Tuple[int, int], Dict[int, _Entry]] = {}  # (group, chunk) -> layers
        self._freed: set = set()  # (group, chunk)
        self._parents: Dict[int, Dict[int, Optional[int]]] = {}  # group -> chunk -> parent
        # MoE: (group, chunk) -> layer -> prefix router statistics ([Note: logical prefix tokens])
        self._router: Dict[Tuple[int, int], Dict[int, RouterStats]] = {}
        self._to_local: Dict[Tuple[int, int], Optional[Callable]] = {}  # CP: gK/gV -> local
        self._storages: Dict[int, int] = {}  # data_ptr of a stored K/V storage -> entries using it

    def set_tree(self, group: int, parents: Dict[int, Optional[int]]) -> None:
        """Declare `group`'s chunk tree (chunk -> parent chunk; None for the root). Without it
        chunk c continues chunk c-1."""
        self._parents[group] = dict(parents)

    # ---- Phase A
    def store(self, group: int, layer: int, k: torch.Tensor, v: torch.Tensor, *,
              chunk: int = 0, full=None, to_local: Optional[Callable] = None) -> None:
        """Keep `k`, `v` (carrying the prefix graph) of `group`'s chunk `chunk` at `layer`.

        Megatron gives [L, 1, H, D] (sbhd, one row); they are read back as [L, H, D].
        Context parallel ([Note: CP prefix cache]): `k`, `v` are this rank's zigzag rows, `full`
        the chunk's whole gathered K/V [L, H, D] (what reads return) and `to_local(grads,
        shapes)` the CP group's reduce-scatter of the whole-chunk gK/gV (None: zeros of that
        shape) to this rank's rows, which consumes the list. `full` may be a callable that
        returns them once an asynchronous gather is done (a packed row: [Note: packed CP prefix
        rows] in runtime/cp.py); the first read waits for it.
        """
        if (full is None) != (to_local is None):
            raise ValueError("a CP cache entry needs both `full` and `to_local`")
        self._check_live(group, chunk)
        layers = self._entries.setdefault((group, chunk), {})
        if layer in layers:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: prefix K/V stored "
                                     "twice")
        if k.dim() == 4:
            assert k.shape[1] == 1 and v.shape[1] == 1, "prefix rows are run one group at a time"
        if not (k.requires_grad or v.requires_grad):
            # no graph to keep (full recompute's Phase A): keep the K/V bytes, not the buffers
            # they view (Megatron's V is a slice of the whole fused QKV projection output)
            k, v = _compact(k), _compact(v)
        if layers and (to_local is None) != (self._to_local.get((group, chunk)) is None):
            raise CacheProtocolError(f"{_name(group, chunk)}: CP and non-CP layers mixed")
        self._to_local[(group, chunk)] = to_local
        if callable(full):
            layers[layer] = _Entry(k_graph=k, v_graph=v, k_leaf=None, v_leaf=None, pending=full)
        else:
            source_k, source_v = (k, v) if full is None else full
            layers[layer] = _Entry(
                k_graph=k, v_graph=v,
                k_leaf=source_k.detach().reshape(source_k.shape[0], *k.shape[-2:])
                .requires_grad_(True),
                v_leaf=source_v.detach().reshape(source_v.shape[0], *v.shape[-2:])
                .requires_grad_(True))
        for t in (k, v):
            ptr = t.untyped_storage().data_ptr()
            self._storages[ptr] = self._storages.get(ptr, 0) + 1

    def rebind(self, group: int, layer: int, k: torch.Tensor, v: torch.Tensor, *,
               chunk: int = 0) -> None:
        """Phase C under full recompute: the re-run forward's `k`, `v` (same values, now with
        their graph) become the entry's graph tensors; its leaves and gK/gV stay."""
        entry = self._entry(group, chunk, layer)
        if k.shape != entry.k_graph.shape or v.shape != entry.v_graph.shape:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: the re-run prefix "
                                     "forward gave K/V of another shape than Phase A")
        for old, new in ((entry.k_graph, k), (entry.v_graph, v)):
            self._forget_storage(old)
            ptr = new.untyped_storage().data_ptr()
            self._storages[ptr] = self._storages.get(ptr, 0) + 1
        entry.k_graph, entry.v_graph = k, v

    def inject_grads(self, group: int, layer: int, out: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, *, chunk: int = 0, padding: int = 0) -> torch.Tensor:
        """Phase C under full recompute with Megatron's checkpointing: `out` (the attention
        output computed from `k`, `v`, whose last `padding` rows were not cached), whose
        backward also adds the entry's gK/gV to the gradients of `k`, `v`."""
        return _InjectGrads.apply(out, k, v, self._entry(group, chunk, layer), padding)

    def store_router_stats(self, group: int, layer: int, stats: RouterStats, *,
                           chunk: int = 0) -> None:
        """Keep the prefix router statistics of `group`'s chunk `chunk` at MoE layer `layer`
        (GPTModel: after that layer's K/V; a HybridModel `E` layer may come before the chunk's
        first attention layer, whose K/V the same prefix forward stores next)."""
        self._check_live(group, chunk)
        self._entries.setdefault((group, chunk), {})
        layers = self._router.setdefault((group, chunk), {})
        if layer in layers:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: router statistics "
                                     "stored twice")
        layers[layer] = stats

    def inject_router_grads(self, group: int, layer: int, probs: torch.Tensor,
                            recomputed: RouterStats, *, chunk: int = 0) -> torch.Tensor:
        """Phase C under full recompute with Megatron's checkpointing: the router's `probs`,
        whose backward also hands the re-run's prefix sums `recomputed` the entry's accumulated
        gradients ([Note: prefix router stats under full recompute] in router_stats.py)."""
        return router_stats.inject(self._router_entry(group, chunk, layer), probs, recomputed)

    def rebind_router_stats(self, group: int, layer: int, recomputed: RouterStats, *,
                            chunk: int = 0) -> None:
        """Phase C under full recompute without checkpoints (`rebind` for K/V): the re-run's
        sums, with their graph, become the entry's."""
        router_stats.rebind(self._router_entry(group, chunk, layer), recomputed)

    def _router_entry(self, group: int, chunk: int, layer: int) -> RouterStats:
        stats = self._router.get((group, chunk), {}).get(layer)
        if stats is None:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: no router "
                                     "statistics stored (Phase A did not record them)")
        return stats

    def read_router_stats(self, group: int, layer: int) -> PrefixRouterRead:
        """`group`'s prefix router statistics at `layer`, all chunks summed; the gradients of
        the returned sums accumulate per chunk for Phase C."""
        return read_stats([self._router_entry(group, chunk, layer)
                           for chunk in self._chunks(group)])

    # ---- Phase B (and chunk forwards)
    def read(self, group: int, layer: int, *, before_chunk: Optional[int] = None,
             chunks: Optional[Tuple[int, ...]] = None,
             length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cached [L, H, D] K/V of `group` at `layer`: all its chunks (None; every one must be
        live), chunks 0..before_chunk-1, or the chain `chunks` (a tree), concatenated and cut to
        the first `length` rows (None: all); gradients accumulate per chunk in fp32."""
        if chunks is not None:
            if not chunks:
                raise CacheProtocolError(f"group {group}: a read of no chunks")
        elif before_chunk is None:
            chunks = self._chunks(group)
        else:
            chunks = range(before_chunk)
            if before_chunk < 1:
                raise CacheProtocolError(f"group {group}: before_chunk={before_chunk} reads "
                                         "nothing")
        parts = []
        for chunk in chunks:
            entry = self._entry(group, chunk, layer)
            if isinstance(entry, StateEntry):
                raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: holds "
                                         "recurrent state, not K/V")
            entry.num_reads += 1
            parts.append(_AccumulateInto.apply(*entry.leaves(), entry))
        if len(parts) == 1:  # unchunked: no copy
            k, v = parts[0]
        else:
            k, v = torch.cat([k for k, _ in parts]), torch.cat([v for _, v in parts])
        if length is not None and length < k.shape[0]:  # a reader after a node with children
            k, v = k[:length], v[:length]
        return k, v

    # ---- Phase C
    def backward(self, group: int, *, chunk: int = 0, output: Optional[torch.Tensor] = None,
                 output_grad: Optional[torch.Tensor] = None,
                 backward_fn: Callable = torch.autograd.backward,
                 packed: Sequence[Tuple[int, int]] = ()) -> None:
        """Run the prefix backward of `group`'s chunk once with its accumulated gK/gV, then free it.

        On a pipeline stage before the last, the prefix's output hidden states (`output`) also
        get their gradient (`output_grad`) from the next stage's prefix backward: one
        autograd call covers both. `backward_fn(tensors, grads)` runs it (an executor whose
        pipeline pseudo-frees sent outputs passes one without torch's shape checks). A later
        chunk of the group still live is a protocol error: its backward would add to this
        chunk's gK/gV afterwards. `packed`: further (group, chunk) entries stored by the same
        prefix row ([Note: packed CP prefix rows] in runtime/cp.py), run in the same autograd
        call (their K/V share one graph) with one `to_local` for all.
        """
        members = [(group, chunk), *packed]
        for g, c in members:
            self._live_layers(g, c)
            later = self._live_children(g, c)
            if later:
                raise CacheProtocolError(f"{_name(g, c)}: backward before that of chunk "
                                         f"{later[0]}, which still adds to its gK/gV")
        to_local = self._to_local.get((group, chunk))
        if any(self._to_local.get(m) is not to_local for m in members[1:]):
            raise CacheProtocolError(f"{_name(group, chunk)}: entries packed into one backward "
                                     "must come from one prefix row (one to_local)")
        tensors: List[torch.Tensor] = []
        grads: List[torch.Tensor] = []
        if output is not None and output_grad is not None and output.requires_grad:
            tensors.append(output)
            grads.append(output_grad)
        if to_local is not None:  # [Note: CP prefix cache]: one collective, every CP rank
            pairs = self._local_grads([self._entries[m] for m in members], to_local)
        else:
            pairs = [pair for m in members for entry in self._entries[m].values()
                     for pair in entry.backward_pairs()]
        for graph, grad in pairs:
            if grad is not None and graph.requires_grad:
                tensors.append(graph)
                grads.append(grad.to(graph.dtype).reshape(graph.shape))
        for m in members:
            for stats in self._router.get(m, {}).values():  # MoE prefix router share
                for graph, grad in stats.backward_pairs():
                    tensors.append(graph)
                    grads.append(grad)
        if tensors:
            backward_fn(tensors, grads)
        for g, c in members:
            self._free_chunk(g, c)

    @staticmethod
    def _local_grads(members: List[Dict[int, _Entry]], to_local: Callable) -> List[tuple]:
        """(graph, this rank's rows of the CP group's summed gK/gV) per K and V, member after
        member (a packed row's: [Note: packed CP prefix rows]); the entries give up their
        whole-prefix gK/gV, which `to_local` frees as it packs them ([Note: CP Phase C memory]
        in runtime/cp.py)."""
        graphs, grads, shapes = [], [], []
        for layers in members:
            for entry in layers.values():
                if isinstance(entry, StateEntry):
                    raise CacheProtocolError("a recurrent layer's prefix state under context "
                                             "parallelism is not supported")
                k_leaf, v_leaf = entry.leaves()
                graphs += [entry.k_graph, entry.v_graph]
                grads += [entry.grad_k, entry.grad_v]
                shapes += [k_leaf.shape, v_leaf.shape]
                entry.grad_k = entry.grad_v = None
        return list(zip(graphs, to_local(grads, shapes)))

    def free(self, group: int) -> None:
        """Drop every live chunk of `group` (forward-only steps; Phase C frees chunk by chunk)."""
        chunks = [c for g, c in self._entries if g == group]
        if not chunks:
            self._live_layers(group, 0)  # raises the precise error
        for chunk in chunks:
            self._free_chunk(group, chunk)

    # ---- introspection
    def layers(self, group: int, *, chunk: int = 0) -> Tuple[int, ...]:
        """Layers stored for `group`'s chunk `chunk` (sorted)."""
        return tuple(sorted(self._live_layers(group, chunk)))

    def live_groups(self) -> Tuple[int, ...]:
        """Groups with a chunk not yet freed."""
        return tuple(sorted({g for g, _ in self._entries}))

    def num_reads(self, group: int) -> int:
        """How many (read, chunk, layer) reads the live chunks of `group` have served."""
        return sum(e.num_reads for c in self._chunks(group)
                   for e in self._live_layers(group, c).values())

    def tensors(self) -> Iterator[torch.Tensor]:
        """The live K/V copies and fp32 gradient buffers (not the prefix graphs they came from)."""
        for layers in self._entries.values():
            for e in layers.values():
                yield from e.owned()

    def nbytes(self) -> int:
        """Bytes held by live K/V copies and gradient buffers (excluding the prefix graphs)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _live_children(self, group: int, chunk: int) -> List[int]:
        parents = self._parents.get(group)
        if parents is None:
            return [chunk + 1] if (group, chunk + 1) in self._entries else []
        return [c for g, c in self._entries if g == group and parents.get(c) == chunk]

    def holds_storage(self, t: torch.Tensor) -> bool:
        """True if `t` shares its storage with live cached K/V (they stay on the device)."""
        return t.untyped_storage().data_ptr() in self._storages

    def _free_chunk(self, group: int, chunk: int) -> None:
        for entry in self._entries[(group, chunk)].values():
            for graph in entry.graphs():
                self._forget_storage(graph)
        del self._entries[(group, chunk)]
        self._router.pop((group, chunk), None)
        self._to_local.pop((group, chunk), None)
        self._freed.add((group, chunk))

    def _forget_storage(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        self._storages[ptr] -= 1
        if not self._storages[ptr]:
            del self._storages[ptr]

    def _chunks(self, group: int) -> range:
        """0..n-1 for a group whose chunks are exactly those, all live; raises otherwise."""
        freed = sorted(c for g, c in self._freed if g == group)
        live = sorted(c for g, c in self._entries if g == group)
        if freed:  # a whole-group read must never silently miss a chunk
            self._check_live(group, freed[0])
        missing = next((c for c in range(len(live) + 1) if c not in live), 0)
        if missing < len(live) or not live:
            self._live_layers(group, missing)  # raises: Phase A missing
        return range(len(live))

    def _check_live(self, group: int, chunk: int) -> None:
        if (group, chunk) in self._freed:
            raise CacheProtocolError(f"{_name(group, chunk)}: its prefix cache was already freed")

    def _live_layers(self, group: int, chunk: int) -> Dict[int, _Entry]:
        self._check_live(group, chunk)
        if (group, chunk) not in self._entries:
            raise CacheProtocolError(f"{_name(group, chunk)}: no prefix K/V stored (Phase A "
                                     "missing)")
        return self._entries[(group, chunk)]

    def _entry(self, group: int, chunk: int, layer: int) -> _Entry:
        layers = self._live_layers(group, chunk)
        if layer not in layers:
            raise CacheProtocolError(f"{_name(group, chunk)} layer {layer}: no prefix K/V stored")
        return layers[layer]


def _name(group: int, chunk: int) -> str:
    return f"group {group}" if chunk == 0 else f"group {group} chunk {chunk}"
