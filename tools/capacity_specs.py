"""tools/capacity.py's view of a ModelSpec: its accounting-model shape (`dims_of`), the RoPE
fraction its attention saves (`rotary_percent_of`) and its static bytes per GPU (`static_bytes`:
parameters by layer kind, tools/layouts.py).

Llama 3 / Qwen3 / Qwen3-MoE are GPTModels of attention + SwiGLU layers; GDN hybrids (Qwen3-Next /
Qwen3.5) add `linear_attention_freq`, their GDN dims and the attention output gate; Nemotron-H is a
HybridModel pattern (one symbol per layer: `M` Mamba-2, `*` attention without RoPE, `-` a
squared-ReLU MLP without gate), its Mamba dims (Megatron's MambaMixer defaults: conv 4 wide,
128-token scan chunks, as Nemotron-H's config.json has them).
"""
from __future__ import annotations

import dataclasses
from typing import Dict

from layouts import gdn_layer_params, hybrid_layer_params, layer_params
from megatron_patches.models.model_configs import ModelSpec
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.flops_layers import GDN, layer_parts

__all__ = ["Layout", "check_modelled", "dims_of", "rotary_percent_of", "static_bytes"]


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 8
    cp: int = 1
    ep: int = 1


_GDN_DIMS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim")
_MAMBA_DIMS = ("hybrid_layer_pattern", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim",
               "mamba_num_groups")


def check_modelled(spec: ModelSpec) -> None:
    """ValueError for a spec the accounting model cannot count (GDN or a pattern without dims)."""
    freq = getattr(spec, "linear_attention_freq", None)
    if freq and not all(getattr(spec, name, None) for name in _GDN_DIMS):
        raise ValueError(f"{spec.name}: linear_attention_freq={freq} without the GDN dims "
                         f"({', '.join(_GDN_DIMS)})")
    if getattr(spec, "hybrid_layer_pattern", None) and not all(
            getattr(spec, name, None) for name in _MAMBA_DIMS):
        raise ValueError(f"{spec.name}: a hybrid pattern without the Mamba dims "
                         f"({', '.join(_MAMBA_DIMS)})")


def _hybrid(spec: ModelSpec) -> dict:
    if not getattr(spec, "hybrid_layer_pattern", None):
        return {}
    return dict(hybrid_pattern=spec.hybrid_layer_pattern, mamba_num_heads=spec.mamba_num_heads,
                mamba_head_dim=spec.mamba_head_dim, mamba_state_dim=spec.mamba_state_dim,
                mamba_num_groups=spec.mamba_num_groups)


def dims_of(spec: ModelSpec) -> ModelDims:
    """The accounting model's ModelDims of a spec (GDN hybrids: their GDN dims and the attention
    output gate; MoE: the shared expert; Nemotron-H: its pattern, Mamba dims, no MLP gate)."""
    check_modelled(spec)
    gdn = {}
    if getattr(spec, "linear_attention_freq", None):
        gdn = {name: getattr(spec, name) for name in _GDN_DIMS}
        gdn.update(linear_attention_freq=spec.linear_attention_freq,
                   attention_output_gate=spec.attention_output_gate)
    shared = getattr(spec, "moe_shared_expert_intermediate_size", None) or 0
    return ModelDims(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                     ffn_hidden_size=spec.ffn_hidden_size,
                     num_attention_heads=spec.num_attention_heads,
                     num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                     gated_linear_unit=not getattr(spec, "is_nemotron_h", False),
                     kv_channels=spec.head_dim,
                     num_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk or 0,
                     moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                     moe_shared_ffn_hidden_size=shared, **gdn, **_hybrid(spec))


def rotary_percent_of(spec: ModelSpec) -> float:
    """The fraction of a head RoPE rotates: 0 for attention without positions (Nemotron-H)."""
    if getattr(spec, "rope_theta", 1.0) is None:
        return 0.0
    return getattr(spec, "rotary_percent", 1.0)


def _layers_params(spec: ModelSpec, dims: ModelDims, layers: int) -> int:
    """The first `layers` layers' parameters (a stage's), each by its kind."""
    if dims.hybrid_pattern is not None:
        return sum(hybrid_layer_params(spec, s) for s in dims.hybrid_pattern[:layers])
    kinds = [layer_parts(dims, i)[0] for i in range(layers)]
    return sum(gdn_layer_params(spec) if k == GDN else layer_params(spec) for k in kinds)


def static_bytes(spec: ModelSpec, layout: Layout) -> Dict[str, float]:
    """Weights, main gradients and distributed-optimizer state on one rank of the heaviest
    stage (the first: embedding; with PP=1 also the output layer and the final norm)."""
    h, layers = spec.hidden_size, spec.num_layers // layout.pp
    dense_layers = _layers_params(spec, dims_of(spec), layers)
    experts = 0
    if spec.is_moe:
        dense_layers -= layers * 3 * h * spec.ffn_hidden_size
        dense_layers += layers * h * spec.num_experts  # the router
        shared = getattr(spec, "moe_shared_expert_intermediate_size", None)
        if shared:  # one shared expert and its sigmoid gate
            dense_layers += layers * (3 * h * shared + h)
        experts = layers * spec.num_experts * 3 * h * spec.moe_ffn_hidden_size
    embedding = spec.vocab_size * h
    if layout.pp == 1:
        embedding += h + (0 if spec.tie_word_embeddings else spec.vocab_size * h)
    dense = (dense_layers + embedding) / layout.tp
    expert = experts / (layout.tp * layout.ep)
    params = dense + expert
    return {"weights": 2 * params, "grads": 4 * params,
            # the distributed optimizer shards over DP x CP (experts: expert DP = DP x CP / EP)
            "optimizer": 12 * dense / (layout.dp * layout.cp)
            + 12 * expert / max(1, layout.dp * layout.cp // layout.ep)}
