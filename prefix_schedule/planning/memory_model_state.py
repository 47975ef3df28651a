"""The prefix cache of a hybrid model, predicted: K/V per token for attention layers, a fixed-size
state per prefix unit for Gated DeltaNet and Mamba-2 layers.

[Note: recurrent prefix state] (runtime/state_cache.py): a GDN or Mamba layer caches, per group
and prefix chunk (a prefix unit), its recurrent state and its conv tail instead of K/V, and the
suffixes' backward accumulates their gradients in fp32 buffers of the same shapes:
- GDN (`G`, or a GPTModel layer under `linear_attention_freq`): the rule state [HV, dk, dv]
  (fp32) and the conv tail (W-1) x (2*HK*dk + HV*dv) raw in_proj channels (activation dtype);
- Mamba-2 (`M`): the SSD state [H, P, N] (fp32) and the conv tail (W-1) x (d_inner + 2*G*N)
  raw x, B, C channels (activation dtype);
- their gradients: fp32, as many elements, allocated by the first suffix backward that reads
  the unit.
Each term / TP (heads and conv channels are split over tensor-parallel ranks). Attention layers
keep their K/V per cached token (memory_model.ActivationModel.kv_storage / gkv), counted here
only as how many layers do. tests/test_memory_state.py holds `state_bytes` and
`state_grad_bytes` to the bytes PrefixKVCache holds in a real tiny hybrid step.

What GDN layers save for backward per token is memory_model_gdn.py's (as fla's GPU kernels
save it, not the CPU stand-ins); Mamba-2's is not modelled yet (docs/MEMORY.md "Hybrid models").
"""
from __future__ import annotations

import dataclasses

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.flops_layers import ATTENTION, GDN, MAMBA, layer_parts

__all__ = ["PrefixCacheShape", "prefix_cache_shape"]

FP32 = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixCacheShape:
    """What one pipeline stage's prefix cache holds, by kind of layer."""

    kv_layers: int
    """Layers whose cache is K/V per cached token (softmax attention)."""
    state_layers: int
    """Layers whose cache is a recurrent state and conv tail per prefix unit (GDN, Mamba-2)."""
    state_bytes: float
    """Per prefix unit (a group's chunk): the states and conv tails of the state layers."""
    state_grad_bytes: float
    """Per prefix unit: their fp32 gradient buffers (once a suffix backward has read it)."""


def _gdn_state(dims: ModelDims, act_bytes: int) -> tuple:
    channels = 2 * dims.linear_num_key_heads * dims.linear_key_head_dim + \
        dims.linear_num_value_heads * dims.linear_value_head_dim
    rule = dims.linear_num_value_heads * dims.linear_key_head_dim * dims.linear_value_head_dim
    conv = (dims.linear_conv_kernel_dim - 1) * channels
    return rule * FP32 + conv * act_bytes, (rule + conv) * FP32


def _mamba_state(dims: ModelDims, act_bytes: int) -> tuple:
    inner = dims.mamba_num_heads * dims.mamba_head_dim
    ssm = inner * dims.mamba_state_dim
    channels = inner + 2 * dims.mamba_num_groups * dims.mamba_state_dim  # x, B, C
    conv = (dims.mamba_conv_kernel_dim - 1) * channels
    return ssm * FP32 + conv * act_bytes, (ssm + conv) * FP32


def prefix_cache_shape(dims: ModelDims, *, act_bytes: int = 2, tp: int = 1,
                       layers: range | None = None) -> PrefixCacheShape:
    """The cache of the stage holding (0-based) `layers` (None: all), module docstring."""
    for name, value in (("act_bytes", act_bytes), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"prefix_cache_shape {name}={value!r}; give an int >= 1")
    layers = range(dims.num_layers) if layers is None else layers
    if not all(0 <= i < dims.num_layers for i in layers):
        raise ValueError(f"layers {layers} outside the model's {dims.num_layers}")
    mixers = [layer_parts(dims, i)[0] for i in layers]
    per_kind = {GDN: _gdn_state(dims, act_bytes), MAMBA: _mamba_state(dims, act_bytes)}
    states = [per_kind[m] for m in mixers if m in per_kind]
    return PrefixCacheShape(kv_layers=mixers.count(ATTENTION), state_layers=len(states),
                            state_bytes=sum(s for s, _ in states) / tp,
                            state_grad_bytes=sum(g for _, g in states) / tp)
