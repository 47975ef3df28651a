"""Torch equivalents of the mamba-ssm / causal-conv1d functions Megatron's Mamba mixer imports
(CPU layer only).

megatron-core 0.19's `ssm/mamba_mixer.py` takes its training kernels from mamba-ssm (Triton) and
causal-conv1d (CUDA); without them `MambaMixer.__init__` refuses to build (`HAVE_MAMBA_SSM`) and
`RMSNormGated` is a `MagicMock`. `install()` (called by `cpu_support.enable_cpu_support`, never
with CUDA) gives those module names torch functions with the semantics Megatron relies on,
written against the libraries' own torch reference implementations (mamba-ssm 2.3.x:
`ops/triton/ssd_combined.py::mamba_split_conv1d_scan_ref`, `ssd_chunk_scan_combined_ref`,
`ops/triton/layernorm_gated.py::rms_norm_ref`; causal-conv1d 1.6.x:
`causal_conv1d_interface.py::causal_conv1d_ref`):

* `causal_conv1d_fn(x [B, D, L], weight [D, W], bias, seq_idx, initial_states [B, D, W-1],
  return_final_states, activation)`: depthwise causal conv (zeros, or `initial_states`, before the
  first step; restarting at each `seq_idx` boundary), then SiLU; the final states are the last
  W-1 inputs (zero-padded when L < W-1).
* `mamba_chunk_scan_combined(x [B, L, H, P], dt [B, L, H], A [H], B, C [B, L, G, N], chunk_size,
  D, z, dt_bias, initial_states [B, H, P, N], seq_idx, dt_softplus, dt_limit,
  return_final_states)`: the SSD recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,
  y_t = C_t . h_t + D x_t (times silu(z_t) with z), dt = softplus(dt + dt_bias) clamped to
  dt_limit; computed in fp32 (float64 stays float64), chunked as the Mamba-2 paper's minimal
  SSD (`ssd_minimal_discrete`). The result is the same recurrence whatever `chunk_size`.
* `mamba_split_conv1d_scan_combined(zxbcdt, ...)`: split [z, xBC, dt], the conv, the scan gated by
  z (or `rms_norm_ref` of it with `rmsnorm_weight`), optional out-projection.
* `RMSNormGated`: `rms_norm_ref` as a module (per-group RMS norm; `norm_before_gate=False`
  normalises x * silu(z)).
Prefix reuse passes states in and out of these through its own hook (megatron_patches/mamba.py).
"""

from __future__ import annotations

import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["install", "causal_conv1d_fn", "mamba_chunk_scan_combined",
           "mamba_split_conv1d_scan_combined", "RMSNormGated", "rms_norm_ref", "ssd_scan"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _segments(seq_idx: Optional[torch.Tensor], length: int) -> List[Tuple[int, int]]:
    """[start, end) spans of equal seq_idx along a row (one span without seq_idx)."""
    if seq_idx is None:
        return [(0, length)]
    if seq_idx.shape[0] != 1:
        raise ValueError("seq_idx with batch > 1: the CPU Mamba path packs one row at a time")
    ids = seq_idx[0].tolist()
    bounds = [0] + [i for i in range(1, length) if ids[i] != ids[i - 1]] + [length]
    return list(zip(bounds[:-1], bounds[1:]))


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     seq_idx: Optional[torch.Tensor] = None,
                     initial_states: Optional[torch.Tensor] = None,
                     return_final_states: bool = False, final_states_out=None,
                     activation: Optional[str] = None):
    """causal-conv1d's `causal_conv1d_fn` (its `causal_conv1d_ref`, plus seq_idx restarts)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn: activation {activation!r}; supported: None, silu")
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise ValueError("causal_conv1d_fn: seq_idx with initial/final states is not supported "
                         "(as in causal-conv1d)")
    width = weight.shape[-1]
    dtype_in = x.dtype
    outs = []
    for a, b in _segments(seq_idx, x.shape[-1]):
        seg = x[..., a:b].to(weight.dtype)
        head = (seg.new_zeros(seg.shape[:-1] + (width - 1,)) if initial_states is None
                else initial_states.to(weight.dtype))
        window = torch.cat([head, seg], dim=-1)
        outs.append(F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0]))
    out = torch.cat(outs, dim=-1)
    out = (out if activation is None else F.silu(out)).to(dtype_in)
    if not return_final_states:
        return out
    full = x if initial_states is None else torch.cat([initial_states.to(x.dtype), x], dim=-1)
    final = F.pad(full, (width - 1 - full.shape[-1], 0))[..., -(width - 1):].to(dtype_in)
    if final_states_out is not None:
        final_states_out.copy_(final)
        final = final_states_out
    return out, final


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = sum(a[j+1 .. i]) for j <= i, -inf above."""
    length = a.shape[-1]
    a = a[..., None].expand(*a.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), -1)
    sums = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), 0)
    return sums.masked_fill(~keep, -math.inf)


def ssd_scan(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, chunk: int,
             initial_state: Optional[torch.Tensor] = None):
    """The SSD recurrence h_t = exp(a_t) h_{t-1} + b_t x_t^T, y_t = h_t^T c_t, chunked.

    x [B, L, H, P] (already times dt), a [B, L, H] (dt * A), b, c [B, L, H, N];
    initial_state [B, H, P, N]. Returns y [B, L, H, P] and the final state [B, H, P, N]."""
    batch, length, heads, hdim = x.shape
    pad = (-length) % chunk
    if pad:  # padded steps: a = 0 (decay 1) and x = 0 keep the state as it is
        x, a, b, c = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, a, b, c))
    n_chunks = x.shape[1] // chunk
    x, b, c = (t.reshape(batch, n_chunks, chunk, heads, t.shape[-1]) for t in (x, b, c))
    a = a.reshape(batch, n_chunks, chunk, heads).permute(0, 3, 1, 2)  # [B, H, c, l]
    a_cum = torch.cumsum(a, dim=-1)
    decay = torch.exp(_segsum(a))  # [B, H, c, l, s]
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", c, b, decay, x)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, to_end, x)
    if initial_state is None:
        initial_state = states.new_zeros(states[:, :1].shape)
    else:
        initial_state = initial_state.to(states.dtype)[:, None]
    states = torch.cat([initial_state, states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [B, H, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    states, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, states, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(batch, n_chunks * chunk, heads, hdim)[:, :length]
    return y, final


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False,
                              state_dtype=None):
    """mamba-ssm's `mamba_chunk_scan_combined` (its `ssd_chunk_scan_combined_ref` semantics,
    with initial/final states and seq_idx restarts)."""
    if cu_seqlens is not None or return_varlen_states:
        raise ValueError("mamba_chunk_scan_combined: cu_seqlens / varlen states are not "
                         "implemented by the CPU path (Megatron's training path does not pass them)")
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise ValueError("mamba_chunk_scan_combined: seq_idx with initial/final states is not "
                         "supported by the CPU path")
    cdt = _compute_dtype(x)
    heads, groups = x.shape[2], B.shape[2]
    delta = dt.to(cdt)
    if dt_bias is not None:
        delta = delta + dt_bias.to(cdt)
    if dt_softplus:
        delta = F.softplus(delta)
    if tuple(dt_limit) != (0.0, float("inf")):
        delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])
    xs = x.to(cdt)
    bh = B.to(cdt).repeat_interleave(heads // groups, dim=2)
    ch = C.to(cdt).repeat_interleave(heads // groups, dim=2)
    a = delta * A.to(cdt)
    outs, final = [], None
    for s, e in _segments(seq_idx, x.shape[1]):
        y, final = ssd_scan(xs[:, s:e] * delta[:, s:e, :, None], a[:, s:e], bh[:, s:e],
                            ch[:, s:e], chunk_size, initial_states)
        outs.append(y)
    y = torch.cat(outs, dim=1)
    if D is not None:
        d = D.to(cdt)
        y = y + xs * (d[:, None] if d.dim() == 1 else d)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    y = y.to(x.dtype)
    if return_final_states:
        return y, final.to(state_dtype if state_dtype is not None else cdt)
    return y


def rms_norm_ref(x, weight, bias=None, z=None, eps=1e-6, group_size=None,
                 norm_before_gate=True):
    """mamba-ssm's `rms_norm_ref` (upcast=True; float64 stays float64)."""
    cdt = _compute_dtype(x)
    dtype = x.dtype
    w = weight.to(cdt)
    x = x.to(cdt)
    z = z.to(cdt) if z is not None else None
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    size = x.shape[-1] if group_size is None else group_size
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    out = (xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)).reshape(x.shape) * w
    if bias is not None:
        out = out + bias.to(cdt)
    if z is not None and norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


class RMSNormGated(torch.nn.Module):
    """mamba-ssm's `ops.triton.layernorm_gated.RMSNorm` (weight init ones, no bias)."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True,
                 device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x, z=None):
        return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps,
                            group_size=self.group_size, norm_before_gate=self.norm_before_gate)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, float("inf")), return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                     outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """mamba-ssm's fused training op (its `mamba_split_conv1d_scan_ref`, with states)."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("mamba_split_conv1d_scan_combined: a 1-D D needs headdim")
        heads = D.shape[0]
    else:
        heads, headdim = D.shape
    dim = heads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - heads) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, heads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
                           activation=activation).transpose(1, 2)
    x, b, c = torch.split(xbc, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    batch, length = x.shape[:2]
    zh = z.reshape(batch, length, heads, headdim)
    result = mamba_chunk_scan_combined(
        x.reshape(batch, length, heads, headdim), dt, A, b.reshape(batch, length, ngroups, dstate),
        c.reshape(batch, length, ngroups, dstate), chunk_size, D=D.float() if D.dtype != torch.float64 else D,
        z=zh if rmsnorm_weight is None else None, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states,
        state_dtype=state_dtype)
    out, final = result if return_final_states else (result, None)
    out = out.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = rms_norm_ref(out, rmsnorm_weight, None, z=z, eps=rmsnorm_eps,
                           group_size=dim // ngroups, norm_before_gate=norm_before_gate)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


def _stock_sharded_state_dict(stock):
    """Megatron's `ExtendedRMSNorm.sharded_state_dict` function. Without mamba-ssm its base
    `RMSNormGated` is a MagicMock instance, so the class statement called the mock's type with
    (name, bases, namespace): the class body sits in that mock's return value."""
    body = stock.__dict__ if isinstance(stock, type) else getattr(stock, "_mock_return_value", {})
    method = body.get("sharded_state_dict") if isinstance(body, dict) else None
    if method is None:
        raise RuntimeError("megatron.core.ssm.mamba_mixer.ExtendedRMSNorm has no "
                           "sharded_state_dict: this megatron-core is not one the CPU layer knows")
    return method


def install() -> None:
    """Give Megatron's Mamba mixer these functions where mamba-ssm is missing (CPU layer only)."""
    try:
        from megatron.core.ssm import mamba_mixer
    except ImportError:  # an older megatron-core without the module: nothing to stand in for
        return
    if mamba_mixer.HAVE_MAMBA_SSM:  # the real kernels: nothing to replace
        return
    this = sys.modules[__name__]
    for name in ("causal_conv1d_fn", "mamba_chunk_scan_combined",
                 "mamba_split_conv1d_scan_combined"):
        setattr(mamba_mixer, name, getattr(this, name))
    norm = type("ExtendedRMSNorm", (RMSNormGated,), {
        "__doc__": "RMSNormGated (torch) with Megatron's sharded state dict (CPU layer).",
        "sharded_state_dict": _stock_sharded_state_dict(mamba_mixer.ExtendedRMSNorm)})
    mamba_mixer.RMSNormGated, mamba_mixer.ExtendedRMSNorm = RMSNormGated, norm
    mamba_mixer.HAVE_MAMBA_SSM = True  # the constructor's check; these stand in for mamba-ssm
