"""Fakes of mamba-ssm's and causal-conv1d's autograd Functions that save for backward exactly what
the real ones save (tensor for tensor, shape and dtype), for tests/test_memory_mamba.py only.

The CPU layer's torch stand-ins (megatron_patches/support/mamba_cpu.py) save whatever their torch
ops save (chunk-square decay matrices, ...); the GPU kernels save their inputs and a few outputs
and recompute the rest. Each fake has the real signature, computes its forward with the stand-in
under no_grad, saves the real list, and in backward recomputes the stand-in under enable_grad
(hidden from saved-tensor hooks, as a kernel's backward temporaries are). Sources (cite):
- causal-conv1d 1.7.0 causal_conv1d/causal_conv1d_interface.py `CausalConv1dFn.forward` lines
  24-25 (x made contiguous unless a channel dimension is), 56 `ctx.save_for_backward(x, weight,
  bias, seq_idx, initial_states)`; cpp_functions.py line 103 `out = torch.empty_like(x)` (the
  same save in v1.4.0 - v1.6.1.post4).
- mamba-ssm v2.3.2.post1 mamba_ssm/ops/triton/ssd_combined.py: `MambaChunkScanCombinedFn.forward`
  lines 596-603 (`save_for_backward(out if z is None else out_x, x, dt, dA_cumsum, A, B, C, D, z,
  dt_bias, initial_states, seq_idx)`, x/dt/B/C/z the arguments as given); `_mamba_chunk_scan_
  combined_fwd` 343-393; ssd_chunk_state.py `_chunk_cumsum_fwd` 718-725 (dA_cumsum fp32 [b, H,
  ceil(L/Q), Q]); ssd_chunk_scan.py `_chunk_scan_fwd` 1276-1278 (out, out_x: x's shape and
  dtype); `MambaSplitConv1dScanCombinedFn.forward` 819-893 (`save_for_backward(zxbcdt,
  conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states, seq_idx, rmsnorm_weight,
  rstd, outproj_weight, outproj_bias)`); layernorm_gated.py `LayerNormFn.forward` 341-366
  (`save_for_backward(x, weight, bias, mean, rstd, z)`, x 2-D, rstd fp32 [groups x rows]).
  The same lists in v2.2.6.post3 - v2.3.2.post1 and main (e9594ce).
`install(monkeypatch)` puts them where Megatron's MambaMixer and the CPU layer call them; it
refuses with CUDA or with the real mamba-ssm present (this module is never used outside tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_patches.support import mamba_cpu

__all__ = ["CausalConv1dFn", "LayerNormFn", "MambaChunkScanCombinedFn",
           "MambaSplitConv1dScanCombinedFn", "causal_conv1d_fn", "install",
           "load", "mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
           "rms_norm_forward", "save"]


def save(ctx, fn, tensors) -> None:
    """The one place the fakes save for backward (`fn`: the Function; a test may wrap this)."""
    ctx.save_for_backward(*tensors)


def load(ctx):
    """What `save` kept, in its order."""
    return ctx.saved_tensors


def _grads(outputs, grads_out, inputs):
    """d(outputs)/d(inputs) of a recomputed stand-in; None for inputs that are None."""
    pairs = [(o, g) for o, g in zip(outputs, grads_out) if g is not None]
    live = [t for t in inputs if t is not None and t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], live, [g for _, g in pairs],
                                     allow_unused=True)) if live else iter(())
    return [next(found) if t is not None and t.requires_grad else None for t in inputs]


def _leaves(*tensors):
    return [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None
            for t in tensors]


def _recompute():
    """Backward-time recompute: grads on, its saved tensors invisible to the meter's hooks."""
    class _Ctx:
        def __enter__(self):
            self.grad = torch.enable_grad()
            self.hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            self.grad.__enter__()
            self.hooks.__enter__()

        def __exit__(self, *exc):
            self.hooks.__exit__(*exc)
            self.grad.__exit__(*exc)
    return _Ctx()


class CausalConv1dFn(torch.autograd.Function):
    """causal-conv1d 1.7.0 `CausalConv1dFn`."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, seq_idx=None, initial_states=None,
                return_final_states=False, final_states_out=None, activation=None):
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        if return_final_states or initial_states is not None or seq_idx is not None:
            raise NotImplementedError("the fake conv covers the reuse hook's call only")
        out = torch.empty_like(x)  # cpp_functions.py: keeps x's (channel-last) layout
        with torch.no_grad():
            out.copy_(mamba_cpu.causal_conv1d_fn(x, weight, bias, activation=activation))
        ctx.activation = activation
        save(ctx, CausalConv1dFn, (x, weight, bias, seq_idx, initial_states))
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = _leaves(*load(ctx)[:3])
        with _recompute():
            out = mamba_cpu.causal_conv1d_fn(x, weight, bias, activation=ctx.activation)
            dx, dw, db = _grads([out], [dout], [x, weight, bias])
        return dx, dw, db, None, None, None, None, None


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                     return_final_states=False, final_states_out=None, activation=None):
    return CausalConv1dFn.apply(x, weight, bias, seq_idx, initial_states, return_final_states,
                                final_states_out, activation)


def _dA_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit):
    """ssd_chunk_state.py `_chunk_cumsum_fwd`: fp32 [b, H, ceil(L/Q), Q], padded steps dt = 0."""
    batch, length, heads = dt.shape
    chunks = math.ceil(length / chunk_size)
    delta = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        delta = torch.where(delta <= 20.0, F.softplus(delta), delta)
    delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])
    delta = F.pad(delta, (0, 0, 0, chunks * chunk_size - length))
    dA = (delta * A.float()).reshape(batch, chunks, chunk_size, heads).permute(0, 3, 1, 2)
    return torch.cumsum(dA, dim=-1).contiguous()


class MambaChunkScanCombinedFn(torch.autograd.Function):
    """mamba-ssm v2.3.2.post1 `MambaChunkScanCombinedFn`."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), return_final_states=False,
                return_varlen_states=False):
        if return_varlen_states or seq_idx is not None:
            raise NotImplementedError("the fake scan covers the reuse hook's call only")
        with torch.no_grad():
            out_x, final = mamba_cpu.mamba_chunk_scan_combined(
                x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True)
            out = out_x if z is None else (out_x.float() * F.silu(z.float())).to(x.dtype)
            final = final.clone()  # its own fp32 [b, H, P, N] (the stand-in's is a view of all)
            dA_cumsum = _dA_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)
        save(ctx, MambaChunkScanCombinedFn, (out if z is None else out_x, x, dt, dA_cumsum, A, B,
                                             C, D, z, dt_bias, initial_states, seq_idx))
        ctx.args = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit)
        ctx.return_final_states = return_final_states
        return (out, final) if return_final_states else out

    @staticmethod
    def backward(ctx, dout, *rest):
        _, x, dt, _, A, B, C, D, z, dt_bias, initial_states, _ = load(ctx)[:12]
        inputs = _leaves(x, dt, A, B, C, D, z, dt_bias, initial_states)
        x, dt, A, B, C, D, z, dt_bias, initial_states = inputs
        with _recompute():
            out, final = mamba_cpu.mamba_chunk_scan_combined(
                x, dt, A, B, C, ctx.args["chunk_size"], D=D, z=z, dt_bias=dt_bias,
                initial_states=initial_states, dt_softplus=ctx.args["dt_softplus"],
                dt_limit=ctx.args["dt_limit"], return_final_states=True)
            dfinal = rest[0] if ctx.return_final_states else None
            dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = _grads([out, final], [dout, dfinal],
                                                                  inputs)
        return dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias, dinit, None, None, None, None, \
            None, None


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    return MambaChunkScanCombinedFn.apply(x, dt, A, B, C, chunk_size, D, z, dt_bias,
                                          initial_states, seq_idx, cu_seqlens, dt_softplus,
                                          dt_limit, return_final_states, return_varlen_states)


class MambaSplitConv1dScanCombinedFn(torch.autograd.Function):
    """mamba-ssm v2.3.2.post1 `MambaSplitConv1dScanCombinedFn` (Megatron's call: no rmsnorm_weight,
    no outproj_weight, no extra non-SSM channels)."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                return_final_states=False, activation="silu", rmsnorm_weight=None,
                rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                ngroups=1, norm_before_gate=True):
        if rmsnorm_weight is not None or outproj_weight is not None or return_final_states:
            raise NotImplementedError("the fake fused op covers Megatron's _ssm_training call")
        heads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
        dim = heads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        if zxbcdt.shape[-1] != 2 * dim + 2 * ngroups * dstate + heads:
            raise NotImplementedError("the fake fused op has no non-SSM (d_nonssm) channels")
        batch, length, _ = zxbcdt.shape
        z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, heads], dim=-1)
        with torch.no_grad():
            conv = mamba_cpu.causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias,
                                              seq_idx=seq_idx, activation=activation)
            x, B, C = torch.split(conv.transpose(1, 2), [dim, ngroups * dstate,
                                                         ngroups * dstate], dim=-1)
            out_x = mamba_cpu.mamba_chunk_scan_combined(
                x.reshape(batch, length, heads, headdim), dt, A,
                B.reshape(batch, length, ngroups, dstate), C.reshape(batch, length, ngroups,
                                                                     dstate),
                chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit)
            out = (out_x.float() * F.silu(z.float()).reshape(out_x.shape)).to(out_x.dtype)
        save(ctx, MambaSplitConv1dScanCombinedFn, (zxbcdt, conv1d_weight, conv1d_bias, out_x, A,
                                                   D, dt_bias, initial_states, seq_idx, None,
                                                   None, None, None))  # rmsnorm_weight, rstd, ...
        ctx.args = dict(chunk_size=chunk_size, dt_limit=dt_limit, activation=activation,
                        headdim=headdim, ngroups=ngroups, norm_before_gate=norm_before_gate)
        return out.reshape(batch, length, dim)

    @staticmethod
    def backward(ctx, dout):
        saved = load(ctx)
        zxbcdt, weight, bias, _, A, D, dt_bias, initial_states, seq_idx = saved[:9]
        inputs = _leaves(zxbcdt, weight, bias, dt_bias, A, D, initial_states)
        with _recompute():
            zxbcdt, weight, bias, dt_bias, A, D, initial_states = inputs
            out = mamba_cpu.mamba_split_conv1d_scan_combined(
                zxbcdt, weight, bias, dt_bias, A, D, initial_states=initial_states,
                seq_idx=seq_idx, **ctx.args)
            grads = _grads([out], [dout], inputs)
        dzxbcdt, dweight, dbias, ddt_bias, dA, dD, dinit = grads
        return (dzxbcdt, dweight, dbias, ddt_bias, dA, dD, None, dinit) + (None,) * 11


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
                                     chunk_size, initial_states=None, seq_idx=None,
                                     dt_limit=(0.0, float("inf")), return_final_states=False,
                                     activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6,
                                     outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    return MambaSplitConv1dScanCombinedFn.apply(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states, seq_idx,
        dt_limit, return_final_states, activation, rmsnorm_weight, rmsnorm_eps, outproj_weight,
        outproj_bias, headdim, ngroups, norm_before_gate)


class LayerNormFn(torch.autograd.Function):
    """mamba-ssm v2.3.2.post1 layernorm_gated `LayerNormFn` (RMS norm only: `rmsnorm_fn`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                is_rms_norm=False):
        if not is_rms_norm:
            raise NotImplementedError("the fake covers RMSNorm (Megatron's ExtendedRMSNorm)")
        shape = x.shape
        x = x.reshape(-1, x.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        if z is not None:
            z = z.reshape(-1, z.shape[-1])
            z = z if z.stride(-1) == 1 else z.contiguous()
        rows, width = x.shape
        size = width if group_size is None else group_size
        with torch.no_grad():
            y = mamba_cpu.rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size,
                                       norm_before_gate=norm_before_gate)
            gated = x.float() if z is None or norm_before_gate else x.float() * F.silu(z.float())
            rstd = torch.rsqrt(gated.reshape(rows, width // size, size).square().mean(-1) + eps)
            rstd = rstd.t().contiguous().reshape(-1)  # [groups x rows], fp32
        save(ctx, LayerNormFn, (x, weight, bias, None, rstd, z))  # mean: None (RMS norm)
        ctx.args = dict(eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
        ctx.shape = shape
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        saved = load(ctx)
        x, weight, bias, z = saved[0], saved[1], saved[2], saved[5]
        inputs = _leaves(x, weight, bias, z)
        with _recompute():
            y = mamba_cpu.rms_norm_ref(*inputs[:3], z=inputs[3], **ctx.args)
            dx, dw, db, dz = _grads([y], [dy.reshape(y.shape)], inputs)
        return (dx.reshape(ctx.shape), dw, db, dz.reshape(ctx.shape) if dz is not None else None,
                None, None, None, None)


def rms_norm_forward(self, x, z=None):
    """layernorm_gated `RMSNorm.forward` (rmsnorm_fn), for the CPU layer's RMSNormGated."""
    return LayerNormFn.apply(x, self.weight, self.bias, z, self.eps, self.group_size,
                             self.norm_before_gate, True)


def install(monkeypatch) -> None:
    """Megatron's MambaMixer calls these fakes for the rest of the test (pytest's monkeypatch
    undoes it). Refused with CUDA or the real mamba-ssm: there the real kernels run."""
    from megatron.core.ssm import mamba_mixer

    if torch.cuda.is_available():
        raise RuntimeError("mamba_saved_fake is for CPU tests: with CUDA the real kernels run")
    if mamba_mixer.mamba_chunk_scan_combined is not mamba_cpu.mamba_chunk_scan_combined:
        raise RuntimeError("mamba_saved_fake stands in for the CPU layer's torch functions "
                           "(megatron_patches.enable_cpu_support() first), not for mamba-ssm")
    monkeypatch.setattr(mamba_mixer, "causal_conv1d_fn", causal_conv1d_fn)
    monkeypatch.setattr(mamba_mixer, "mamba_chunk_scan_combined", mamba_chunk_scan_combined)
    monkeypatch.setattr(mamba_mixer, "mamba_split_conv1d_scan_combined",
                        mamba_split_conv1d_scan_combined)
    monkeypatch.setattr(mamba_cpu.RMSNormGated, "forward", rms_norm_forward)
