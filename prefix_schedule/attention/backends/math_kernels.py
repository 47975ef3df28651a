"""Plain-torch attention kernels on [B, H, L, D] runs (any device and dtype): dense scores with
an optional causal / sliding-window mask (VarlenCall.window's meaning). The "math" backend runs
them for every call; the "torch" backend for windowed calls (torch_cpu.py)."""
from __future__ import annotations

import math

import torch

from prefix_schedule.attention.backends._base import acc_dtype

__all__ = ["math_bwd", "math_fwd"]


def _keep(nq: int, nk: int, causal: bool, window, device) -> torch.Tensor | None:
    """[nq, nk] visible keys (None: all); `window` as VarlenCall.window."""
    if not causal and window is None:
        return None
    pos = torch.arange(nq, device=device)[:, None] + (0 if causal else nk)
    cols = torch.arange(nk, device=device)[None, :]
    keep = cols <= pos
    if window is not None:
        keep &= cols >= pos - window
    return keep


def _scores(q, k, causal, scale, window=None):
    rep = q.shape[1] // k.shape[1]
    acc = acc_dtype(q.dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), k.repeat_interleave(rep, 1).to(acc)) * scale
    keep = _keep(s.shape[-2], s.shape[-1], causal, window, s.device)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return s, rep, acc


def math_fwd(q, k, v, causal, scale, window=None):
    """Dense [B, H, L, D] attention returning (out, natural-log LSE [B, H, L]). Every query row
    must see a key (the two-part layouts guarantee it)."""
    s, rep, acc = _scores(q, k, causal, scale, window)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), v.repeat_interleave(rep, 1).to(acc))
    return out.to(q.dtype), lse


def math_bwd(g, q, k, v, out, lse, causal, scale, window=None):
    """Gradients from the given (possibly merged) out and LSE, like a flash kernel's backward."""
    s, rep, acc = _scores(q, k, causal, scale, window)
    p = torch.exp(s - lse[..., None].to(acc))
    g, vr = g.to(acc), v.repeat_interleave(rep, 1).to(acc)
    dv = torch.einsum("bhqk,bhqd->bhkd", p, g)
    ds = p * (torch.einsum("bhqd,bhkd->bhqk", g, vr) - (g * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, k.repeat_interleave(rep, 1).to(acc)) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)) * scale

    def fold(x):  # sum the query-head copies of each kv head back (GQA)
        return x.unflatten(1, (k.shape[1], rep)).sum(2).to(q.dtype)

    return dq.to(q.dtype), fold(dk), fold(dv)
