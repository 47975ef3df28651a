"""The copy-free two-part path on any backend's varlen kernels.

See [Note: two-part attention merged by log-sum-exp] in prefix_schedule/attention/core.py and
[Note: varlen kernel contract] in _base.py. Part S is one call over the suffix sequences
(causal, square); part P is one call whose batch is the group slots (queries = the slot's
suffix tokens, keys = that slot's prefix, not causal). Both calls are described on the host
and cached by layout, so a layer's call costs no device sync and no metadata rebuild.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from prefix_schedule.attention.backends._base import Backend, VarlenCall

__all__ = ["PrefixLayout", "prefix_layout", "suffix_call", "two_part_attention",
           "windowed_prefix_layout"]


@functools.lru_cache(maxsize=1024)
def suffix_call(cu_seqlens: tuple[int, ...], window: Optional[int] = None) -> VarlenCall:
    """Part S: every suffix against itself, causal (and windowed: keys >= i - W)."""
    return VarlenCall(cu_q=cu_seqlens, cu_k=cu_seqlens, causal=True, window=window)


@dataclass(frozen=True)
class PrefixLayout:
    """Part P of one microbatch layout (host-side)."""

    call: Optional[VarlenCall]
    """The varlen call, or None when no slot has a prefix (part S alone is the answer)."""
    rows: Optional[tuple[tuple[int, int], ...]]
    """Query row ranges the call covers, one per entry, in order; None means every row."""
    prefix_lens: tuple[int, ...]
    """Prefix length per slot, to split the packed prefix gradient back."""
    keys: tuple[tuple[int, int, int], ...] = ()
    """Per entry (slot, first, end): the rows of that slot's prefix it reads."""
    whole: bool = True
    """Entries read whole prefixes, each slot at most once, in slot order (split, no scatter)."""


@functools.lru_cache(maxsize=1024)
def prefix_layout(slot_ranges: tuple[tuple[int, int], ...], prefix_lens: tuple[int, ...],
                  empty_kv_ok: bool) -> PrefixLayout:
    """Part P over the slots; slots without a prefix stay in the batch (empty key entry) when the
    kernel handles that, else their query rows are left out."""
    keep = [i for i, p in enumerate(prefix_lens) if p > 0 or empty_kv_ok]
    if not any(prefix_lens[i] for i in keep):
        return PrefixLayout(None, None, prefix_lens)
    cu_q, cu_k = [0], [0]
    for i in keep:
        a, b = slot_ranges[i]
        cu_q.append(cu_q[-1] + b - a)
        cu_k.append(cu_k[-1] + prefix_lens[i])
    rows = None if len(keep) == len(prefix_lens) else tuple(slot_ranges[i] for i in keep)
    keys = tuple((i, 0, prefix_lens[i]) for i in keep)
    return PrefixLayout(VarlenCall(cu_q=tuple(cu_q), cu_k=tuple(cu_k), causal=False), rows,
                        prefix_lens, keys)


# [Note: sliding windows]
# With Megatron's window_size = (W, 0), the token at absolute position p sees keys at positions
# p - W ... p (W + 1 keys; HF gpt-oss's sliding_window is W + 1). A suffix token at offset t after
# a P-token prefix therefore reads prefix rows >= P + t - W: only the prefix's last min(P, W)
# rows, and only its first min(n, W) tokens read the prefix at all. Part P becomes one entry per
# suffix sequence: queries = those first rows, keys = the last min(P, W) prefix rows (a transient
# copy per entry, at most W rows: entries of one slot overlap, and kernels write dK, they do not
# accumulate it), with VarlenCall.window = W. Part S is causal with the same window.
@functools.lru_cache(maxsize=1024)
def windowed_prefix_layout(cu_seqlens: tuple[int, ...], slot_ranges: tuple[tuple[int, int], ...],
                           prefix_lens: tuple[int, ...], window: int) -> PrefixLayout:
    """Part P under a sliding window of W = `window` (see [Note: sliding windows])."""
    cu_q, cu_k, rows, keys = [0], [0], [], []
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        slot = next(i for i, (lo, hi) in enumerate(slot_ranges) if lo <= a < hi)
        n, m = min(b - a, window), min(prefix_lens[slot], window)
        if n == 0 or m == 0:  # W = 0, or no prefix: nothing of the prefix is visible
            continue
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + m)
        rows.append((a, a + n))
        keys.append((slot, prefix_lens[slot] - m, prefix_lens[slot]))
    if not rows:
        return PrefixLayout(None, None, prefix_lens)
    call = VarlenCall(cu_q=tuple(cu_q), cu_k=tuple(cu_k), causal=False, window=window)
    return PrefixLayout(call, tuple(rows), prefix_lens, tuple(keys), whole=False)


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The slots' prefixes as one THD key buffer (copy-free with a single non-empty prefix)."""
    nonempty = [t for t in tensors if t.shape[0]]
    return nonempty[0] if len(nonempty) == 1 else torch.cat(nonempty)


def _pack_keys(tensors: Sequence[torch.Tensor], layout: PrefixLayout) -> torch.Tensor:
    if layout.whole:
        return _pack(tensors)
    return _pack([tensors[s][a:b] for s, a, b in layout.keys])


def _unpack_keys(d: torch.Tensor, layout: PrefixLayout) -> tuple[torch.Tensor, ...]:
    """The packed key gradient back to one tensor per slot (rows no entry read get 0)."""
    if layout.whole:
        return d.split(list(layout.prefix_lens))
    grads = [d.new_zeros((p, *d.shape[1:])) for p in layout.prefix_lens]
    at = 0
    for slot, a, b in layout.keys:
        grads[slot][a:b] += d[at:at + b - a]
        at += b - a
    return tuple(grads)


def _take(x: torch.Tensor, rows, dim: int = 0) -> torch.Tensor:
    if rows is None:
        return x
    return torch.cat([x.narrow(dim, a, b - a) for a, b in rows], dim)


def _spread(x: torch.Tensor, rows, total: int, fill: float, dim: int = 0) -> torch.Tensor:
    """Inverse of _take: rows outside `rows` get `fill`."""
    if rows is None:
        return x
    shape = list(x.shape)
    shape[dim] = total
    full = x.new_full(shape, fill)
    offset = 0
    for a, b in rows:
        full.narrow(dim, a, b - a).copy_(x.narrow(dim, offset, b - a))
        offset += b - a
    return full


def _merge(out_s, lse_s, out_p, lse_p):
    """out/lse of the union of the two key sets; out keeps out_s's dtype, lse is float32/64."""
    # flash-attn marks an entry without keys with LSE +inf (and out 0); as a merge weight it must
    # count as no mass, i.e. -inf.
    lse_p = lse_p.masked_fill(lse_p == math.inf, -math.inf)
    acc = torch.promote_types(lse_s.dtype, lse_p.dtype)
    lse_s, lse_p = lse_s.to(acc), lse_p.to(acc)
    lse = torch.logaddexp(lse_s, lse_p)
    w_s = torch.exp(lse_s - lse).T.unsqueeze(-1)
    w_p = torch.exp(lse_p - lse).T.unsqueeze(-1)
    out = w_s * out_s.to(acc) + w_p * out_p.to(acc)
    return out.to(out_s.dtype), lse.contiguous()


# [Note: attention sinks]
# softmax_type='learnable' (gpt-oss) adds one logit s_h per query head to every query's softmax
# denominator, with a zero value: out = sum_j e^{x_j} v_j / (e^{s_h} + sum_j e^{x_j}). It is a
# third key set of the merge -- a one-key part with LSE s_h and out 0 -- merged once, after the
# prefix and suffix parts, so it is counted once per query whatever the number of parts. The
# kernels' backward with the MERGED (sink-including) out and LSE then gives exact dq/dk/dv, and
# d s_h = -sum_i e^{s_h - lse_i} (dO_i . O_i), summed over every query row of the call (prefix
# chunks and suffix rows each add theirs; autograd sums the calls into the parameter's grad).
def _add_sink(out, lse, sink):
    lse_all = torch.logaddexp(lse, sink.to(lse.dtype)[:, None].expand_as(lse))
    out = (out.to(lse.dtype) * torch.exp(lse - lse_all).T.unsqueeze(-1)).to(out.dtype)
    return out, lse_all.contiguous()


def _sink_grad(grad_out, out, lse, sink):
    dot = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [T, H]
    return -(torch.exp(sink.to(lse.dtype)[:, None] - lse) * dot.T).sum(1).to(sink.dtype)


class _TwoPart(torch.autograd.Function):
    """See the module docstring; the saved tensors are q, k, v, out, lse and the prefix inputs
    themselves (no packed or gathered copy is kept for backward; a windowed part P re-packs its
    at most W rows per suffix in backward)."""

    @staticmethod
    def forward(ctx, backend: Backend, s_call: VarlenCall, layout: PrefixLayout, scale, sink, q, k,
                v, *prefix):
        pk, pv = prefix[:len(prefix) // 2], prefix[len(prefix) // 2:]
        out, lse, s_state = backend.varlen_fwd(q, k, v, s_call, scale)
        p_state = None
        if layout.call is not None:
            out_p, lse_p, p_state = backend.varlen_fwd(_take(q, layout.rows), _pack_keys(pk, layout),
                                                       _pack_keys(pv, layout), layout.call, scale)
            total = q.shape[0]
            out, lse = _merge(out, lse, _spread(out_p, layout.rows, total, 0.0),
                              _spread(lse_p, layout.rows, total, -math.inf, dim=1))
        if sink is not None:
            out, lse = _add_sink(out, lse, sink)
        ctx.backend, ctx.s_call, ctx.layout, ctx.scale = backend, s_call, layout, scale
        ctx.states = (s_state, p_state)
        ctx.has_sink = sink is not None
        ctx.save_for_backward(q, k, v, out, lse, *((sink,) if sink is not None else ()), *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sink = rest.pop(0) if ctx.has_sink else None
        prefix = rest
        backend, layout, scale = ctx.backend, ctx.layout, ctx.scale
        pk, pv = prefix[:len(prefix) // 2], prefix[len(prefix) // 2:]
        g = grad_out.contiguous()
        d_sink = _sink_grad(g, out, lse, sink) if sink is not None else None
        # Both parts' backward get the MERGED out and lse (the ring-attention rule).
        dq, dk, dv = backend.varlen_bwd(g, q, k, v, out, lse, ctx.s_call, scale, ctx.states[0])
        head = (None,) * 4 + (d_sink,)
        if layout.call is None:
            return head + (dq, dk, dv, *(torch.zeros_like(x) for x in prefix))
        rows = layout.rows
        dq_p, dpk, dpv = backend.varlen_bwd(_take(g, rows), _take(q, rows), _pack_keys(pk, layout),
                                            _pack_keys(pv, layout), _take(out, rows),
                                            _take(lse, rows, dim=1).contiguous(),
                                            layout.call, scale, ctx.states[1])
        dq = dq.to(lse.dtype) + _spread(dq_p.to(lse.dtype), rows, q.shape[0], 0.0)
        return head + (dq.to(q.dtype), dk, dv, *_unpack_keys(dpk, layout),
                       *_unpack_keys(dpv, layout))


def two_part_attention(backend: Backend, q, k, v, prefix_k, prefix_v, cu_seqlens, slot_ranges,
                       scale: float, *, sink: Optional[torch.Tensor] = None,
                       window: Optional[int] = None) -> torch.Tensor:
    """Suffix rows (boundaries `cu_seqlens`, slot query ranges `slot_ranges`, all python ints)
    attending to their slot's prefix and causally to themselves, on `backend`'s kernels.
    sink: [Hq] learnable softmax offsets ([Note: attention sinks]); window: W of Megatron's
    window_size (W, 0) ([Note: sliding windows]); the backend must support windows."""
    cu = tuple(cu_seqlens)
    slots = tuple(tuple(r) for r in slot_ranges)
    lens = tuple(int(p.shape[0]) for p in prefix_k)
    if window is not None:
        assert backend.supports_window, backend.name
        layout = windowed_prefix_layout(cu, slots, lens, window)
    else:
        layout = prefix_layout(slots, lens, backend.empty_kv_ok)
    return _TwoPart.apply(backend, suffix_call(cu, window), layout, scale, sink, q, k, v,
                          *prefix_k, *prefix_v)


def causal_attention(backend: Backend, q, k, v, scale: float, *, sink=None,
                     window: Optional[int] = None) -> torch.Tensor:
    """Square causal self-attention on `backend`: its own kernel if it has one
    (`causal_attention` method) and neither a sink nor a window is asked for, else part S of the
    two-part path with no prefix."""
    own = getattr(backend, "causal_attention", None)
    if own is not None and sink is None and window is None:
        return own(q, k, v, scale)
    n = q.shape[0]
    empty = k.new_empty((0, *k.shape[1:]))
    return two_part_attention(backend, q, k, v, [empty], [empty], (0, n), ((0, n),), scale,
                              sink=sink, window=window)
