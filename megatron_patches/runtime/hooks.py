"""The functions installed into Megatron's hook points (see registry.py for the source patches).

Both hooks are inert unless the executor has set a reuse context (prefix_schedule.runtime.context), so a
process can train dense and with prefix reuse side by side.
"""

from __future__ import annotations

import functools

import torch

from prefix_schedule.attention import PackedMeta, causal_attention, shared_prefix_attention
from prefix_schedule.attention.cp import zigzag_attention
from prefix_schedule.runtime.context import (
    PrefixForwardContext,
    PrefixForwardDone,
    SuffixForwardContext,
    current_context,
)

__all__ = ["core_attention_hook", "positions_table", "rotary_pos_emb_hook"]


def _softmax_scale(attention_module, head_dim: int) -> float:
    core = attention_module.core_attention
    scale = getattr(core, "softmax_scale", None)
    if scale is None:
        scale = attention_module.config.softmax_scale
    return float(scale) if scale is not None else head_dim**-0.5


def _sink_and_window(module):
    """This layer's learnable (or off-by-one) softmax offsets and its window W, as Megatron's core
    attention applies them (DotProductAttention / TEDotProductAttention read the same fields)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    config = module.config
    sink = getattr(module.core_attention, "softmax_offset", None)
    window = None
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                 module.layer_number):
        left, right = config.window_size
        if right != 0:
            raise ValueError(f"window_size={tuple(config.window_size)}: prefix reuse runs causal "
                             "sliding windows only (window_size=(W, 0))")
        window = None if left < 0 else int(left)
    return sink, window


def core_attention_hook(module, query, key, value, attention_mask, *, attn_mask_type=None,
                        attention_bias=None, packed_seq_params=None, **extra_kwargs):
    """Megatron `Attention._run_core_attention` hook: q/k/v are post-RoPE `[s, 1, heads, d]`.

    Prefix context: store this layer's K/V (with their graph) in the cache, then plain causal
    attention over the prefix -- or stop the forward after the last layer's K/V; a prefix chunk
    c > 0 also attends to its group's cached chunks < c. Suffix context: the packed row attends to
    its groups' cached K/V and causally to itself.
    """
    context = current_context()
    if context is None:
        return NotImplemented
    if attention_bias is not None or packed_seq_params is not None or extra_kwargs:
        raise ValueError(
            "prefix reuse drives attention itself: attention_bias, packed_seq_params and extra "
            "core-attention arguments are not supported in reuse steps"
        )
    if query.shape[1] != 1:
        raise AssertionError("reuse rows are packed into batch size 1")
    scale = _softmax_scale(module, query.shape[-1])
    extra = dict(zip(("sink", "window"), _sink_and_window(module)))
    q, k, v = query[:, 0], key[:, 0], value[:, 0]
    if context.cp is not None:
        if extra["sink"] is not None or extra["window"] is not None:
            raise ValueError("context parallelism with attention sinks or sliding windows is not "
                             "implemented by prefix reuse; use context_parallel_size=1")
        out = _cp_attention(context, module.layer_number, q, k, v, key, value, scale)
    elif isinstance(context, PrefixForwardContext):
        if context.inject:  # [Note: prefix full recompute]: Phase C with Megatron's checkpoints
            out = _prefix_attention(context, module.layer_number, q, k, v, scale, extra)
            if torch.is_grad_enabled():
                out = context.cache.inject_grads(context.group, module.layer_number, out, key,
                                                 value, chunk=context.chunk,
                                                 padding=context.padding)
            return out.reshape(out.shape[0], 1, -1)
        if context.replay:  # [Note: prefix full recompute]: same K/V, now with their graph
            real = key.shape[0] - context.padding
            context.cache.rebind(context.group, module.layer_number, key[:real], value[:real],
                                 chunk=context.chunk)
            if context.stop_after_layer == module.layer_number and not context.stop_in_router:
                raise PrefixForwardDone()
        elif not context.recomputing:
            real = key.shape[0] - context.padding  # never cache the padding at the row's end
            stored_k, stored_v = (key, value) if not context.padding else (key[:real], value[:real])
            context.cache.store(context.group, module.layer_number, stored_k, stored_v,
                                chunk=context.chunk)
            if context.stop_after_layer == module.layer_number and not context.stop_in_router:
                raise PrefixForwardDone()
        out = _prefix_attention(context, module.layer_number, q, k, v, scale, extra)
    else:
        assert isinstance(context, SuffixForwardContext)
        prefix_k, prefix_v = [], []
        reads = context.slot_reads or (None,) * len(context.slot_groups)
        for group, chain in zip(context.slot_groups, reads):
            if group is None:
                empty = k.new_zeros((0,) + tuple(k.shape[1:]))
                prefix_k.append(empty)
                prefix_v.append(empty)
            else:  # a prefix tree: the chain of the slot's node ([Note: prefix trees])
                chunks, length = chain if chain is not None else (None, None)
                pk, pv = context.cache.read(group, module.layer_number, chunks=chunks,
                                            length=length)
                prefix_k.append(pk)
                prefix_v.append(pv)
        out = shared_prefix_attention(q, k, v, prefix_k, prefix_v, context.meta, scale=scale,
                                      **extra)
    return out.reshape(out.shape[0], 1, -1)


def _cp_attention(context, layer, q, k, v, key, value, scale):
    """A CP local row ([Note: zigzag CP layout], runtime/cp.py): the split sequences' K/V are
    all-gathered over the CP group in one collective (backward: one reduce-scatter), local
    queries attend through attention/cp.py. A prefix row caches its local K/V with the gathered
    whole ([Note: CP prefix cache], cache.py). A row of whole sequences gathers nothing."""
    cp, layout = context.cp.group, context.cp.layout
    prefix = isinstance(context, PrefixForwardContext)
    if prefix and context.packed:
        return _packed_prefix_attention(context, layer, q, k, v, key, value, scale)
    phases = ("A", "C") if prefix else ("B", "B")
    k_full = v_full = None
    if layout.split:
        kv_full = cp.all_gather_rows(torch.cat([k, v], dim=-1), layout, *phases)
        k_full, v_full = kv_full.split([k.shape[-1], v.shape[-1]], dim=-1)
    if prefix:
        if not context.recomputing:
            real = cp.index(layout, "real", k.device)
            context.cache.store(
                context.group, layer, key, value, chunk=context.chunk,
                full=(k_full.detach()[real], v_full.detach()[real]),
                to_local=cp.gradient_to_local(layout, key.device))
            if context.stop_after_layer == layer:
                raise PrefixForwardDone()
        cached = ([context.cache.read(context.group, layer, before_chunk=context.chunk)]
                  if context.chunk > 0 else [(None, None)])
    else:
        reads = {}
        cached = []
        for slot in context.meta.seq_slot:
            group = context.slot_groups[slot]
            if group is not None and group not in reads:
                reads[group] = context.cache.read(group, layer)
            cached.append(reads[group] if group is not None else (None, None))
    return zigzag_attention(q, k, v, k_full, v_full, layout, [c[0] for c in cached],
                            [c[1] for c in cached], scale=scale)


def _packed_prefix_attention(context, layer, q, k, v, key, value, scale):
    """A packed CP prefix row ([Note: packed CP prefix rows] in runtime/cp.py): each member
    prefix's local rows go into the cache with the whole prefix's K/V, which an asynchronous
    all-gather delivers by the first read; whole members attend locally, split ones through
    the usual all-gather of split rows."""
    cp, layout = context.cp.group, context.cp.layout
    if not context.recomputing:
        finish = cp.gather_all(torch.cat([k, v], dim=-1), layout, "A")
        real = cp.index(layout, "real", k.device)
        whole = []

        def member_kv(a, b):
            if not whole:  # the first reader waits; one copy per K and V for every member
                kv = finish()[real]
                whole.extend(t.contiguous() for t in kv.split([k.shape[-1], v.shape[-1]], -1))
            return whole[0][a:b], whole[1][a:b]

        to_local = cp.gradient_to_local(layout, key.device,
                                        spans=[(ra, rb) for _, ra, rb in context.packed])
        for group, ra, rb in context.packed:  # each keeps the whole local row as its graph
            context.cache.store(group, layer, key, value,
                                full=functools.partial(member_kv, ra, rb), to_local=to_local)
        if context.stop_after_layer == layer:
            raise PrefixForwardDone()
    k_full = v_full = None
    if layout.split:
        kv_full = cp.all_gather_rows(torch.cat([k, v], dim=-1), layout, "A", "C")
        k_full, v_full = kv_full.split([k.shape[-1], v.shape[-1]], dim=-1)
    none = [None] * len(layout.lengths)
    return zigzag_attention(q, k, v, k_full, v_full, layout, none, none, scale=scale)


def _prefix_attention(context, layer, q, k, v, scale, extra):
    if context.chunk == 0:
        return causal_attention(q, k, v, scale=scale, **extra)
    # [Note: prefix chunks] (units.py): the chunk attends like a suffix whose "prefix" is the
    # group's earlier chunks; through the reads, its backward adds to their gK/gV buffers.
    prefix_k, prefix_v = context.cache.read(context.group, layer, before_chunk=context.chunk,
                                            chunks=context.reads)
    meta = PackedMeta(cu_seqlens=(0, q.shape[0]), seq_slot=(0,))
    return shared_prefix_attention(q, k, v, [prefix_k], [prefix_v], meta, scale=scale, **extra)


def rotary_pos_emb_hook(model, rotary_pos_emb):
    """Megatron `GPTModel._preprocess` / `HybridModel.forward` hook: RoPE angles at the packed
    row's own positions.

    Suffix tokens continue at their group's cached prefix length, each sequence of the row
    separately; a prefix row starts at its chunk's offset (0 unchunked: the stock table).
    """
    return positions_table(model.rotary_pos_emb, rotary_pos_emb)


def _table(rope, length: int, **kwargs) -> torch.Tensor:
    """The RoPE angle table of `length` positions from a rotary module (Megatron's
    `YarnRotaryEmbedding` returns `(table, mscale)`: mscale does not depend on the length, so the
    caller keeps the stock call's)."""
    table = rope(length, **kwargs)
    return table[0] if isinstance(table, tuple) else table


def positions_table(rope, rotary_pos_emb):
    """`rotary_pos_emb` (the stock table from rotary module `rope`) at the current reuse row's
    positions (see rotary_pos_emb_hook); unchanged outside reuse steps."""
    context = current_context()
    if rotary_pos_emb is None or context is None:
        return rotary_pos_emb
    if context.cp is not None:  # local zigzag rows: the un-sharded table at their positions
        table = _table(rope, context.cp.max_position + 1, packed_seq=True)
        return torch.index_select(table, 0, context.cp.position_ids.to(table.device))
    if isinstance(context, PrefixForwardContext):
        offset = context.position_offset
        if offset == 0:
            return rotary_pos_emb
        # the stock table covers the row's full length (times TP under sequence parallelism)
        return _table(rope, offset + rotary_pos_emb.shape[0])[offset:]
    table = _table(rope, context.max_position + 1)  # [max_pos+1, 1, 1, d], lru-cached
    positions = context.position_ids.to(table.device)
    return torch.index_select(table, 0, positions)
