"""Forward matmul FLOPs of one layer's parts, per kind (planning/flops.py's docstring says what
is counted and why). A layer is a (mixer, MLP) pair of HybridModel symbols, either may be None:
a GPTModel layer is (`*` or `G`, `-` or `E`), a HybridModel layer one symbol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:  # flops.py imports this module
    from prefix_schedule.planning.flops import ModelDims

__all__ = ["ATTENTION", "GDN", "MAMBA", "MIXERS", "MLP", "MOE", "HYBRID_SYMBOLS", "layer_parts",
           "layer_window",
           "mixer_forward", "mixer_to_cache", "mlp_forward", "router"]

ATTENTION, GDN, MAMBA, MLP, MOE = "*", "G", "M", "-", "E"
MIXERS = (ATTENTION, GDN, MAMBA)
"""The symbols whose layer leaves something in the prefix cache (K/V or a recurrent state)."""
HYBRID_SYMBOLS = MIXERS + (MLP, MOE)
"""The HybridModel pattern symbols the FLOP model counts (and prefix reuse runs)."""


def layer_parts(dims: "ModelDims", layer: int) -> Tuple[Optional[str], Optional[str]]:
    """(mixer symbol or None, MLP symbol or None) of 0-based layer `layer`."""
    if dims.hybrid_pattern is not None:
        symbol = dims.hybrid_pattern[layer]
        return (symbol, None) if symbol in MIXERS else (None, symbol)
    freq = dims.linear_attention_freq
    mixer = GDN if freq is not None and (layer + 1) % freq != 0 else ATTENTION
    return mixer, (MOE if dims.num_experts else MLP)


def layer_window(dims: "ModelDims", layer: int) -> Optional[int]:
    """W when 0-based `layer` is a sliding-window attention layer (Megatron's
    is_layer_window_attention on layer_number = layer + 1), else None."""
    freq = dims.window_attn_skip_freq
    if dims.window_size is None or (freq is not None and (layer + 1) % freq == 0):
        return None
    return dims.window_size


def _qkv(dims: "ModelDims") -> int:
    """linear_qkv: q (plus its output gate with attention_output_gate), k, v."""
    heads = dims.num_attention_heads * (2 if dims.attention_output_gate else 1)
    return 2 * dims.hidden_size * (heads + 2 * dims.num_query_groups) * dims.kv_channels


def _pairs(length: int, cached: int, window: Optional[int] = None) -> int:
    """(query, key) pairs of `length` tokens at positions cached .. cached + length - 1, each
    seeing min(p + 1, W + 1) keys (all p + 1 without a window)."""
    full = length * cached + length * (length + 1) // 2
    if window is None:
        return full
    first = max(cached, window)  # positions >= W see W + 1 keys, earlier ones p + 1
    capped = max(0, cached + length - first)
    return full - (capped * (first + 1) + capped * (capped - 1) // 2) + capped * (window + 1)


def _dense_mlp(dims: "ModelDims", f: int) -> int:
    fc1 = 2 * dims.hidden_size * f * (2 if dims.gated_linear_unit else 1)
    return fc1 + 2 * f * dims.hidden_size


def router(dims: "ModelDims") -> int:
    """Per-token FLOPs of an MoE layer's router (0 without experts)."""
    return 2 * dims.hidden_size * dims.num_experts if dims.num_experts else 0


def mlp_forward(dims: "ModelDims", symbol: Optional[str], length: int) -> int:
    """`length` tokens through an MLP (`-`) or MoE (`E`: router, k experts, shared expert)."""
    if symbol is None:
        return 0
    if symbol == MLP:
        return length * _dense_mlp(dims, dims.ffn_hidden_size)
    shared = (_dense_mlp(dims, dims.moe_shared_ffn_hidden_size)
              if dims.moe_shared_ffn_hidden_size else 0)
    experts = dims.moe_router_topk * _dense_mlp(dims, dims.moe_ffn_hidden_size)
    return length * (router(dims) + experts + shared)


def _gdn(dims: "ModelDims") -> Tuple[int, int]:
    """Per-token (in_proj + conv + rule, out_proj) of a Gated DeltaNet layer."""
    qk = dims.linear_num_key_heads * dims.linear_key_head_dim
    v = dims.linear_num_value_heads * dims.linear_value_head_dim
    in_proj = 2 * dims.hidden_size * (2 * qk + 2 * v + 2 * dims.linear_num_value_heads)
    conv = 2 * dims.linear_conv_kernel_dim * (2 * qk + v)
    rule = 6 * dims.linear_num_value_heads * dims.linear_key_head_dim * dims.linear_value_head_dim
    return in_proj + conv + rule, 2 * v * dims.hidden_size


def _mamba_scan(dims: "ModelDims", length: int) -> int:
    """SSD over `length` tokens, chunked from the segment's first token (mamba_chunk_size Q):
    per chunk of c tokens, c(c+1)/2 causal pairs x (C.B per group 2*G*N + weights.x 2*H*P),
    plus the chunk state B^T x and the read C.h, 2*H*P*N each per token."""
    heads, hdim, state = dims.mamba_num_heads, dims.mamba_head_dim, dims.mamba_state_dim
    full, rest = divmod(length, dims.mamba_chunk_size)
    pairs = full * _pairs(dims.mamba_chunk_size, 0) + _pairs(rest, 0)
    return pairs * (2 * dims.mamba_num_groups * state + 2 * heads * hdim) + \
        length * 4 * heads * hdim * state


def _mamba(dims: "ModelDims", length: int) -> Tuple[int, int]:
    """(in_proj + conv + scan, out_proj) of `length` tokens through a Mamba-2 mixer."""
    inner = dims.mamba_num_heads * dims.mamba_head_dim
    bc = 2 * dims.mamba_num_groups * dims.mamba_state_dim
    in_proj = 2 * dims.hidden_size * (2 * inner + bc + dims.mamba_num_heads)  # z x B C dt
    conv = 2 * dims.mamba_conv_kernel_dim * (inner + bc)  # depthwise over x B C
    out_proj = length * 2 * inner * dims.hidden_size
    return length * (in_proj + conv) + _mamba_scan(dims, length), out_proj


def mixer_to_cache(dims: "ModelDims", symbol: str, length: int, cached: int) -> int:
    """`length` tokens through a mixer up to what the prefix cache keeps: an attention layer's
    linear_qkv (post-RoPE K/V), a GDN or Mamba layer's state (in_proj, conv, rule / scan)."""
    if symbol == ATTENTION:
        return length * _qkv(dims)
    if symbol == GDN:
        return length * _gdn(dims)[0]
    return _mamba(dims, length)[0]


def mixer_forward(dims: "ModelDims", symbol: Optional[str], length: int, cached: int,
                  window: Optional[int] = None) -> int:
    """`length` tokens through a whole mixer over `cached` cached keys (attention: unmasked
    pairs, within `window` when set; GDN / Mamba start from the cached state, so `cached`
    costs nothing)."""
    if symbol is None:
        return 0
    if symbol == ATTENTION:
        ad = dims.num_attention_heads * dims.kv_channels
        return (length * (_qkv(dims) + 2 * ad * dims.hidden_size)
                + 4 * ad * _pairs(length, cached, window))
    if symbol == GDN:
        return length * sum(_gdn(dims))
    return sum(_mamba(dims, length))
