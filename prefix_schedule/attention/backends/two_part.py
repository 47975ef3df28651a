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

__all__ = ["PrefixLayout", "prefix_layout", "suffix_call", "two_part_attention"]


@functools.lru_cache(maxsize=1024)
def suffix_call(cu_seqlens: tuple[int, ...]) -> VarlenCall:
    """Part S: every suffix against itself, causal."""
    return VarlenCall(cu_q=cu_seqlens, cu_k=cu_seqlens, causal=True)


@dataclass(frozen=True)
class PrefixLayout:
    """Part P of one microbatch layout (host-side)."""

    call: Optional[VarlenCall]
    """The varlen call, or None when no slot has a prefix (part S alone is the answer)."""
    rows: Optional[tuple[tuple[int, int], ...]]
    """Query row ranges the call covers, in order; None means every row (no gather needed)."""
    prefix_lens: tuple[int, ...]
    """Prefix length per slot, to split the packed prefix gradient back."""


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
    return PrefixLayout(VarlenCall(cu_q=tuple(cu_q), cu_k=tuple(cu_k), causal=False), rows, prefix_lens)


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The slots' prefixes as one THD key buffer (copy-free with a single non-empty prefix)."""
    nonempty = [t for t in tensors if t.shape[0]]
    return nonempty[0] if len(nonempty) == 1 else torch.cat(nonempty)


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


class _TwoPart(torch.autograd.Function):
    """See the module docstring; the saved tensors are q, k, v, out, lse and the prefix inputs
    themselves (no packed or gathered copy is kept for backward)."""

    @staticmethod
    def forward(ctx, backend: Backend, s_call: VarlenCall, layout: PrefixLayout, scale, q, k, v,
                *prefix):
        pk, pv = prefix[:len(prefix) // 2], prefix[len(prefix) // 2:]
        out, lse, s_state = backend.varlen_fwd(q, k, v, s_call, scale)
        p_state = None
        if layout.call is not None:
            out_p, lse_p, p_state = backend.varlen_fwd(_take(q, layout.rows), _pack(pk), _pack(pv),
                                                       layout.call, scale)
            total = q.shape[0]
            out, lse = _merge(out, lse, _spread(out_p, layout.rows, total, 0.0),
                              _spread(lse_p, layout.rows, total, -math.inf, dim=1))
        ctx.backend, ctx.s_call, ctx.layout, ctx.scale = backend, s_call, layout, scale
        ctx.states = (s_state, p_state)
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        backend, layout, scale = ctx.backend, ctx.layout, ctx.scale
        pk, pv = prefix[:len(prefix) // 2], prefix[len(prefix) // 2:]
        g = grad_out.contiguous()
        # Both parts' backward get the MERGED out and lse (the ring-attention rule).
        dq, dk, dv = backend.varlen_bwd(g, q, k, v, out, lse, ctx.s_call, scale, ctx.states[0])
        if layout.call is None:
            return (None,) * 4 + (dq, dk, dv, *(torch.zeros_like(x) for x in prefix))
        rows = layout.rows
        dq_p, dpk, dpv = backend.varlen_bwd(_take(g, rows), _take(q, rows), _pack(pk), _pack(pv),
                                            _take(out, rows), _take(lse, rows, dim=1).contiguous(),
                                            layout.call, scale, ctx.states[1])
        dq = dq.to(lse.dtype) + _spread(dq_p.to(lse.dtype), rows, q.shape[0], 0.0)
        lens = list(layout.prefix_lens)
        return (None,) * 4 + (dq.to(q.dtype), dk, dv, *dpk.split(lens), *dpv.split(lens))


def two_part_attention(backend: Backend, q, k, v, prefix_k, prefix_v, cu_seqlens, slot_ranges,
                       scale: float) -> torch.Tensor:
    """Suffix rows (boundaries `cu_seqlens`, slot query ranges `slot_ranges`, all python ints)
    attending to their slot's prefix and causally to themselves, on `backend`'s kernels."""
    s_call = suffix_call(tuple(cu_seqlens))
    layout = prefix_layout(tuple(tuple(r) for r in slot_ranges),
                           tuple(int(p.shape[0]) for p in prefix_k), backend.empty_kv_ok)
    return _TwoPart.apply(backend, s_call, layout, scale, q, k, v, *prefix_k, *prefix_v)


def causal_attention(backend: Backend, q, k, v, scale: float) -> torch.Tensor:
    """Square causal self-attention on `backend`: its own kernel if it has one
    (`causal_attention` method), else part S of the two-part path with no prefix."""
    own = getattr(backend, "causal_attention", None)
    if own is not None:
        return own(q, k, v, scale)
    n = q.shape[0]
    empty = k.new_empty((0, *k.shape[1:]))
    return two_part_attention(backend, q, k, v, [empty], [empty], (0, n), ((0, n),), scale)
