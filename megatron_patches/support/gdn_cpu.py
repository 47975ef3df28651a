"""Torch equivalents of the fla functions Megatron's Gated DeltaNet imports (CPU layer only).

megatron-core 0.19's `ssm/gated_delta_net/common.py` takes its short causal conv, its l2norm and
its (non-deterministic) chunked delta rule from flash-linear-attention (fla), which needs Triton
and CUDA; without fla the layer refuses to build. `install()` (called by
`cpu_support.enable_cpu_support`, never with CUDA) gives those module names torch functions with
the semantics Megatron relies on, written against fla-core 0.6.0's source:

* `l2norm(x, eps=1e-6)`: `x * rsqrt(sum(x*x, -1) + eps)`, in fp32 inside, output in x's dtype
  (fla/modules/l2norm.py, `l2norm_fwd_kernel*`).
* `causal_conv1d(x [B, T, D], weight [D, W], bias, activation, cu_seqlens)`: a depthwise causal
  conv over each sequence (zeros before its start), then the activation
  (fla/modules/convolution.py). Only what Megatron's GDN passes: no initial or final state
  (prefix reuse feeds states through its own hook, megatron_patches/models/gdn.py).
* `chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)`:
  Megatron's own `torch_chunk_gated_delta_rule` (gdn.py's name: 0.20 moved it there from
  common.py) per packed sequence (fla's varlen contract:
  B == 1, one initial state per sequence, [N, HV, K, V] final states).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["install", "l2norm", "causal_conv1d", "chunk_gated_delta_rule"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6,
           output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fla's l2norm over the last dim (fp32 inside unless x is float64)."""
    if dim not in (-1, x.dim() - 1):
        raise ValueError(f"l2norm: fla normalises the last dim only, got dim={dim}")
    inner = x.float() if x.dtype != torch.float64 else x
    y = inner * torch.rsqrt((inner * inner).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def _segments(cu_seqlens: Optional[torch.Tensor], length: int):
    if cu_seqlens is None:
        return [(0, length)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def conv_segment(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 activation: Optional[str], tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal conv of one sequence x [B, T, D] with weight [D, W]; `tail` [B, W-1, D]
    are the inputs before its first step (None: zeros), then the activation."""
    width = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros((x.shape[0], width - 1, x.shape[-1]))
    window = torch.cat([tail.to(x.dtype), x], dim=1).transpose(1, 2)  # [B, D, W-1+T]
    y = F.conv1d(window, weight.unsqueeze(1), bias, groups=x.shape[-1]).transpose(1, 2)
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"causal_conv1d: activation {activation!r}; fla supports silu/swish/None")


def causal_conv1d(x: torch.Tensor, weight: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                  initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                  activation: Optional[str] = None, cu_seqlens: Optional[torch.Tensor] = None,
                  **_backend):
    """fla's causal_conv1d for the arguments Megatron's GDN passes (returns (y, None)), and the
    prefix-reuse hook's per-sequence `initial_state` [N, D, W] (fla-core 0.5.2
    fla/modules/conv/triton/kernels.py: sequence n's input at t = -(W-1) .. -1 is
    initial_state[n, :, t + W]; index 0 is never read)."""
    if output_final_state or residual is not None or weight is None:
        raise ValueError("the CPU causal_conv1d implements what Megatron's GatedDeltaNet and the "
                         "reuse hook pass (a weight, no residual, no final state)")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError("causal_conv1d: packed sequences (cu_seqlens) need batch size 1")
    segments = _segments(cu_seqlens, x.shape[1])
    rows = len(segments) if cu_seqlens is not None else x.shape[0]
    if initial_state is not None and tuple(initial_state.shape) != (rows, x.shape[-1], weight.shape[-1]):
        raise ValueError(f"causal_conv1d: initial_state must be [N, D, W], got "
                         f"{tuple(initial_state.shape)}")
    parts = [conv_segment(x[:, a:b], weight, bias, activation,
                          None if initial_state is None else
                          initial_state[n:n + 1, :, 1:].transpose(1, 2).to(x.dtype))
             for n, (a, b) in enumerate(segments)]
    return torch.cat(parts, dim=1), None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **_kernel):
    """fla's chunk_gated_delta_rule contract over Megatron's torch rule, one call per sequence."""
    from megatron.core.ssm.gated_delta_net.gdn import torch_chunk_gated_delta_rule

    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise ValueError("the CPU chunk_gated_delta_rule uses the default scale K**-0.5 only")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("chunk_gated_delta_rule: packed sequences need batch size 1")
    outs, finals = [], []
    for n, (a, b) in enumerate(_segments(cu_seqlens, q.shape[1])):
        state = None
        if initial_state is not None:
            state = initial_state[n:n + 1] if cu_seqlens is not None else initial_state
        out, final = torch_chunk_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(out)
        finals.append(final)
    final = torch.cat(finals) if output_final_state else None
    return torch.cat(outs, dim=1), final


def install() -> None:
    """Give Megatron's GDN modules these functions where fla is missing (CPU layer only)."""
    from megatron.core.ssm.gated_delta_net import common

    _unwrap_compiled()
    if common.HAVE_FLA:  # the real kernels: nothing to replace
        return
    common.causal_conv1d, common.l2norm = causal_conv1d, l2norm
    common.chunk_gated_delta_rule = chunk_gated_delta_rule
    common.HAVE_FLA = True  # the constructor's check; the functions above stand in for fla
    gdn = sys.modules.get("megatron.core.ssm.gated_delta_net.gdn")
    if gdn is None:
        from megatron.core.ssm.gated_delta_net import gdn
    for name in ("causal_conv1d", "chunk_gated_delta_rule", "l2norm"):
        if hasattr(gdn, name):
            setattr(gdn, name, getattr(sys.modules[__name__], name))


def _unwrap_compiled() -> None:
    """Megatron's `jit_fuser` is torch.compile: the CPU layer runs the GDN helpers it decorated
    eagerly (same ops; no inductor build on a CPU test machine)."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    for name in ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule",
                 "_compute_g_and_beta"):
        method = _GDNBase.__dict__.get(name)
        original = getattr(method, "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(_GDNBase, name, original)
