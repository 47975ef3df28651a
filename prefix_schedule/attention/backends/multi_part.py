"""N key sets merged by log-sum-exp: the two-part rule ([Note: two-part attention merged by
log-sum-exp] in core.py) for any number of parts, each a varlen call over some query rows.

Part 0 covers every query row (its out/LSE start the merge); each further part covers the query
row ranges `rows` (None: all), packed in that order, against its own packed keys. Forward: each
part's kernel, merged one after another. Backward: each part's kernel backward with the MERGED
out and LSE of its rows; dq summed. Like _TwoPart, only the inputs, out and LSE are saved (a part
with several key tensors packs them again in backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from prefix_schedule.attention.backends._base import Backend, VarlenCall
from prefix_schedule.attention.backends.two_part import _merge, _pack, _spread, _take

__all__ = ["Part", "multi_part_attention"]


@dataclass(frozen=True)
class Part:
    """One key set: a varlen call over query rows `rows` (None: all rows, in order) against
    `num_keys` key (and value) tensors packed along the tokens."""

    call: VarlenCall
    rows: Optional[tuple[tuple[int, int], ...]]
    num_keys: int


class _MultiPart(torch.autograd.Function):

    @staticmethod
    def forward(ctx, backend: Backend, parts, scale, q, *kv):
        total = q.shape[0]
        out = lse = None
        states = []
        for part, (ks, vs) in zip(parts, _split(parts, kv)):
            o, l, state = backend.varlen_fwd(_take(q, part.rows), _pack(ks), _pack(vs),
                                             part.call, scale)
            states.append(state)
            if out is None:
                out, lse = o, l
            else:
                out, lse = _merge(out, lse, _spread(o, part.rows, total, 0.0),
                                  _spread(l, part.rows, total, -math.inf, dim=1))
        ctx.backend, ctx.parts, ctx.scale, ctx.states = backend, parts, scale, states
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *kv = ctx.saved_tensors
        g = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        dks, dvs = [], []
        for part, (ks, vs), state in zip(ctx.parts, _split(ctx.parts, kv), ctx.states):
            rows = part.rows
            dq_p, dk, dv = ctx.backend.varlen_bwd(
                _take(g, rows), _take(q, rows), _pack(ks), _pack(vs), _take(out, rows),
                _take(lse, rows, dim=1).contiguous(), part.call, ctx.scale, state)
            dq += _spread(dq_p.to(lse.dtype), rows, q.shape[0], 0.0)
            lens = [int(k.shape[0]) for k in ks]
            dks.append(dk.split(lens))
            dvs.append(dv.split(lens))
        grads = [g for dk, dv in zip(dks, dvs) for g in (*dk, *dv)]
        return (None, None, None, dq.to(q.dtype), *grads)


def _split(parts: Sequence[Part], kv):
    """Per part: (its key tensors, its value tensors) from the flat input list."""
    at = 0
    for part in parts:
        n = part.num_keys
        yield kv[at:at + n], kv[at + n:at + 2 * n]
        at += 2 * n


def multi_part_attention(backend: Backend, q: torch.Tensor, parts: Sequence[Part],
                         keys: Sequence[Sequence[torch.Tensor]],
                         values: Sequence[Sequence[torch.Tensor]], scale: float) -> torch.Tensor:
    """q [T, Hq, D] against each part's keys / values (lists of [n, Hkv, D], at least one
    non-empty per part), merged; parts[0] must cover every row. Differentiable."""
    if not parts or parts[0].rows is not None:
        raise ValueError("the first part must cover every query row (rows=None)")
    flat = []
    for part, ks, vs in zip(parts, keys, values):
        if len(ks) != part.num_keys or len(vs) != part.num_keys:
            raise ValueError(f"a part with {part.num_keys} key tensors got {len(ks)} / {len(vs)}")
        flat += [*ks, *vs]
    return _MultiPart.apply(backend, tuple(parts), scale, q, *flat)
