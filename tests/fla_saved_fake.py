"""Fakes of fla-core 0.6.0's three autograd Functions that Megatron's Gated DeltaNet calls on a GPU,
saving for backward exactly the tensors (shapes, dtypes, which ones alias) the real Functions save,
so that the saved-tensor accounting (prefix_schedule.runtime.memory) of a CPU GDN layer counts
what the GPU kernels keep, not what the CPU stand-ins' autograd graphs keep.

Read in fla-core 0.6.0 (the PyPI wheel fla_core-0.6.0-py3-none-any.whl; paths inside it):
* `fla/ops/gated_delta_rule/chunk.py` `ChunkGatedDeltaRuleFunction.forward` (lines 253-335):
  with `use_qk_l2norm_in_kernel` q, k = l2norm_fwd(q), l2norm_fwd(k) (lines 282-284); g becomes
  `chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)` (chunk_gated_delta_rule_fwd, lines
  62-69), fp32 (`output_dtype=torch.float`, fla/ops/utils/cumsum.py line 459); `A` is
  `torch.zeros(B, T, HV, BT=64, dtype=k.dtype)` (chunk_fwd.py line 385, the fused kkt + solve
  path of chunk_gated_delta_rule_fwd_intra); `ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g,
  beta_raw, beta, A, initial_state, cu_seqlens, chunk_indices, g_input, A_log, dt_bias)`
  (lines 310-326) where beta_raw is beta without `use_beta_sigmoid_in_kernel`, g_input / A_log /
  dt_bias are None without `use_gate_in_kernel`, and chunk_indices =
  `prepare_chunk_indices(cu_seqlens, 64)`: [sum ceil(len / 64), 2] in cu_seqlens' dtype
  (fla/ops/utils/index.py lines 156-164) when cu_seqlens is given. `input_guard` only makes the
  inputs contiguous (fla/utils/decorators.py line 97); Megatron passes contiguous q, k, v, beta.
  The output is `o.to(q.dtype)`.
* `fla/modules/causal_conv1d/ops.py` `CausalConv1dFunction.forward` (lines 932-973), which
  `causal_conv1d(..., backend='triton')` (the default; Megatron passes none) applies (lines
  1072-1085): `ctx.save_for_backward(x, weight, bias, residual, initial_state)` with x NOT made
  contiguous (`input_guard(no_guard_contiguous=["x"])`): Megatron's x is a strided view of the
  in_proj output, so its whole storage stays saved. `fla.modules.convolution` is an alias of
  `fla.modules.causal_conv1d` (fla/modules/__init__.py, `_MODULE_ALIASES`).
* `fla/modules/norm/l2norm.py` `L2NormFunction.forward` (lines 171-179): saves (y, rstd), y in
  x's dtype, rstd fp32 of one element per normalised row (`l2norm_fwd`, lines 112-139);
  backward `dx = dy * rstd - sum(dy * y) * y * rstd` (l2norm_bwd_kernel, line 107), done here in
  torch. `fla.modules.l2norm` is an alias of `fla.modules.norm.l2norm`.

Forward values come from the CPU stand-ins (megatron_patches/support/gdn_cpu.py) under no_grad;
the conv's and the rule's backward re-run the stand-in under enable_grad from the saved inputs
(with no-op saved-tensor hooks: a re-run is a transient of the real backward, not saved), so a
step runs and its gradients are the stand-in's. The rule also keeps the raw g on ctx (NOT
saved: the real kernel keeps only its chunk cumsum) to re-run the stand-in exactly. `install()`
puts them where Megatron's GDN looks (common / gdn module names, and `gated_delta_rule` of
GatedDeltaNet modules already built); `uninstall()` puts the stand-ins back.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch

__all__ = ["CHUNK", "chunk_gated_delta_rule", "causal_conv1d", "l2norm", "install", "uninstall",
           "installed", "calls"]

CHUNK = 64
"""fla's default chunk size for the gated delta rule (chunk.py, `kwargs.pop('chunk_size', 64)`)."""
RCP_LN2 = 1.0 / math.log(2.0)
calls = {"rule": 0, "conv": 0, "l2norm": 0}
rows = []
varlen_conv = []
"""Per rule call (as `rows`): whether that layer's conv was the reuse hook's varlen call with
per-sequence initial states (suffix rows), not torch's conv (prefix rows) or the stock call."""
"""(tokens, packed sequence lengths) of every rule call: the row layout the bytes depend on."""
mutate = None
"""Tests only: a function of the rule's saved tuple that returns the tuple to save instead (a
fake that saves one tensor more or less must break the byte equality)."""


def _no_saved_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _chunk_local_cumsum(g: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """fp32 cumsum of g * RCP_LN2 within each 64-token chunk of each sequence."""
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    bounds = [0, g.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    for a, b in zip(bounds[:-1], bounds[1:]):
        for c in range(a, b, CHUNK):
            e = min(c + CHUNK, b)
            out[:, c:e] = (g[:, c:e].float() * RCP_LN2).cumsum(1)
    return out


def _chunk_indices(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """prepare_chunk_indices: (sequence, chunk) per 64-token chunk, in cu_seqlens' dtype."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    rows = [(n, c) for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
            for c in range((b - a + CHUNK - 1) // CHUNK)]
    return torch.tensor(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device).reshape(-1, 2)


def _l2norm_fwd(x: torch.Tensor, eps: float = 1e-6, output_dtype=None):
    x32 = x.float()
    rstd = torch.rsqrt((x32 * x32).sum(-1) + eps)  # fp32, one per row
    y = (x32 * rstd.unsqueeze(-1)).to(output_dtype or x.dtype)
    return y, rstd.reshape(-1)


def _l2norm_bwd(y, rstd, dy):
    y32, dy32 = y.float(), dy.float()
    rstd = rstd.reshape(y.shape[:-1]).unsqueeze(-1)
    return (dy32 * rstd - (dy32 * y32).sum(-1, keepdim=True) * y32 * rstd).to(y.dtype)


class L2NormFunction(torch.autograd.Function):
    """fla/modules/norm/l2norm.py L2NormFunction: saves (y, rstd)."""

    @staticmethod
    def forward(ctx, x, eps=1e-6, output_dtype=None):
        y, rstd = _l2norm_fwd(x.contiguous(), eps, output_dtype)
        ctx.eps = eps
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return _l2norm_bwd(y, rstd, dy), None, None


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    calls["l2norm"] += 1
    return L2NormFunction.apply(x, eps, output_dtype)


def _standin_conv(x, weight, bias, activation, cu_seqlens, initial_state=None):
    from megatron_patches.support import gdn_cpu

    return gdn_cpu.causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens,
                                 initial_state=initial_state)[0]


class CausalConv1dFunction(torch.autograd.Function):
    """fla/modules/causal_conv1d/ops.py CausalConv1dFunction: saves (x, weight, bias, residual,
    initial_state), x as given (a view keeps its whole storage); the backward returns the initial
    state's gradient (the prefix-reuse hook's per-sequence tails, [N, D, W])."""

    @staticmethod
    def forward(ctx, x, weight=None, bias=None, residual=None, initial_state=None,
                output_final_state=False, activation=None, cu_seqlens=None, cu_seqlens_cpu=None,
                chunk_indices=None, chunk_size=64):
        if residual is not None or output_final_state:
            raise ValueError("fake causal_conv1d: only what Megatron's GDN and the reuse hook "
                             "pass (no residual, no final state)")
        ctx.activation, ctx.cu_seqlens = activation, cu_seqlens
        ctx.save_for_backward(x, weight, bias, residual, initial_state)
        with torch.no_grad():
            y = _standin_conv(x, weight, bias, activation, cu_seqlens, initial_state)
        return y, None

    @staticmethod
    def backward(ctx, dy, dht=None):
        x, weight, bias, _, initial_state = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) if t is not None else None
                  for t in (x, weight, bias, initial_state)]
        with torch.enable_grad(), _no_saved_hooks():
            y = _standin_conv(*leaves[:3], ctx.activation, ctx.cu_seqlens, leaves[3])
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, dy, allow_unused=True))
        dx, dw, db, dh0 = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
        return dx, dw, db, None, dh0, None, None, None, None, None, None


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, backend="triton", cu_seqlens=None,
                  cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):
    """fla's causal_conv1d, backend 'triton' (the default) only."""
    if backend != "triton" or cp_context is not None:
        raise ValueError("fake causal_conv1d: the triton backend without CP only")
    calls["conv"] += 1
    calls["conv_varlen_state"] = initial_state is not None  # read by the next rule call's row
    weight = weight.contiguous() if weight is not None else None  # input_guard (not x)
    return CausalConv1dFunction.apply(x, weight, bias, residual, initial_state,
                                      output_final_state, activation, cu_seqlens,
                                      cu_seqlens_cpu, chunk_indices)


def _standin_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    from megatron_patches.support import gdn_cpu

    return gdn_cpu.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                          initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          cu_seqlens=cu_seqlens)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """fla/ops/gated_delta_rule/chunk.py ChunkGatedDeltaRuleFunction: saves q, q_rstd, k, k_rstd,
    v, g (fp32 chunk cumsum), beta_raw, beta (one tensor here), A [B, T, HV, 64] (k's dtype),
    initial_state, cu_seqlens, chunk_indices (None: g_input, A_log, dt_bias)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state,
                state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                use_qk_l2norm_in_kernel=False):
        q_raw, k_raw = q, k
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = _l2norm_fwd(q)
            k, k_rstd = _l2norm_fwd(k)
        if chunk_indices is None and cu_seqlens is not None:
            chunk_indices = _chunk_indices(cu_seqlens)
        g_cum = _chunk_local_cumsum(g, cu_seqlens)
        B, T, HV = beta.shape
        A = torch.zeros(B, T, HV, CHUNK, dtype=k.dtype, device=k.device)
        with torch.no_grad():
            o, final = _standin_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     cu_seqlens)
        saved = (q, q_rstd, k, k_rstd, v, g_cum, beta, beta, A, initial_state, cu_seqlens,
                 chunk_indices, None, None, None)
        ctx.save_for_backward(*(mutate(saved) if mutate is not None else saved))
        ctx.g_raw = g  # not saved (the kernel keeps g's cumsum): re-runs the stand-in exactly
        ctx.qk_raw = (q_raw, k_raw) if use_qk_l2norm_in_kernel else None
        ctx.scale, ctx.l2 = scale, use_qk_l2norm_in_kernel
        ctx.output_final_state = output_final_state
        return o.to(q.dtype), final

    @staticmethod
    def backward(ctx, do, dht=None):
        q, _, k, _, v, _, beta, _, _, h0, cu, _ = ctx.saved_tensors[:12]
        if ctx.l2:
            q, k = ctx.qk_raw
        inputs = [q, k, v, ctx.g_raw, beta, h0]
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in inputs]
        with torch.enable_grad(), _no_saved_hooks():
            qq, kk = leaves[0], leaves[1]
            if ctx.l2:
                qq, kk = L2NormFunction.apply(qq), L2NormFunction.apply(kk)
            o, final = _standin_rule(qq, kk, *leaves[2:5], ctx.scale, leaves[5],
                                     ctx.output_final_state, cu)
            outs, grads_out = [o], [do]
            if final is not None and dht is not None:
                outs.append(final)
                grads_out.append(dht)
            wanted = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(outs, wanted, grads_out, allow_unused=True))
        dq, dk, dv, dg, db, dh0 = [next(grads) if t is not None else None for t in leaves]
        return dq, dk, dv, dg, db, None, dh0, None, None, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, **kwargs):
    """fla's chunk_gated_delta_rule (chunk.py lines 397-593) for the arguments Megatron and the
    reuse hook pass: no in-kernel gate or beta sigmoid, no CP, chunk size 64."""
    if use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first or cp_context is not None \
            or kwargs.get("use_gate_in_kernel") or kwargs.get("chunk_size", CHUNK) != CHUNK:
        raise ValueError("fake chunk_gated_delta_rule: only what Megatron's GDN passes")
    if cu_seqlens is not None and initial_state is not None and \
            initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError("one initial state per packed sequence")
    calls["rule"] += 1
    varlen_conv.append(calls.pop("conv_varlen_state", False))
    bounds = [0, q.shape[1]] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    rows.append((q.shape[0] * q.shape[1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
                 * (q.shape[0] if cu_seqlens is None else 1)))
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # input_guard
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state,
                                             output_final_state, False, cu_seqlens,
                                             cu_seqlens_cpu, chunk_indices,
                                             use_qk_l2norm_in_kernel)


_SAVED = {}


def _modules():
    from megatron.core.ssm.gated_delta_net import common, gdn

    return common, gdn


def install(models=()) -> None:
    """Megatron's GDN calls these fakes (needs the CPU stand-ins installed: enable_cpu_support);
    `models`: already built models whose GatedDeltaNet modules re-point `gated_delta_rule`."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule

    common, gdn = _modules()
    me = sys.modules[__name__]
    for module in (common, gdn):
        for name in ("causal_conv1d", "l2norm", "chunk_gated_delta_rule"):
            if hasattr(module, name):
                _SAVED.setdefault((module.__name__, name), getattr(module, name))
                setattr(module, name, getattr(me, name))
    for model in models:
        for m in model.modules():
            if isinstance(m, GatedDeltaNet) and m.gated_delta_rule is not torch_chunk_gated_delta_rule:
                m.gated_delta_rule = chunk_gated_delta_rule


def uninstall(models=()) -> None:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    common, gdn = _modules()
    for module in (common, gdn):
        for name in ("causal_conv1d", "l2norm", "chunk_gated_delta_rule"):
            if (module.__name__, name) in _SAVED:
                setattr(module, name, _SAVED[(module.__name__, name)])
    for model in models:
        for m in model.modules():
            if isinstance(m, GatedDeltaNet) and m.gated_delta_rule is chunk_gated_delta_rule:
                m.gated_delta_rule = _SAVED[(gdn.__name__, "chunk_gated_delta_rule")]


@contextlib.contextmanager
def installed(models=()):
    install(models)
    try:
        yield
    finally:
        uninstall(models)
