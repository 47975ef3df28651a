"""Gated DeltaNet (GDN) hybrids in `model_configs`: Qwen3-Next and the Qwen3.5 text models.

Their values, Megatron-LM arguments, config.json fields and config.json reading; the ModelSpec
itself and the registry are model_configs.py's (which re-exports these). Every fourth layer
(HF `full_attention_interval`, Megatron `--linear-attention-freq`) is gated softmax attention
(HF q_proj rows [query; gate] per head: Megatron `--attention-output-gate`) with RoPE on a
quarter of the head (HF `partial_rotary_factor`, Megatron `--rotary-percent`) and q/k norms;
the others are Gated DeltaNet layers. HF norms compute (1 + w) (the GDN output norm plain w):
the checkpoint code (checkpoints_gdn.py) converts, the arguments build Megatron's plain-w norms.
Qwen3.5's rotary embedding is multimodal (mrope, interleaved sections [11, 11, 10]); with text
positions (the same on its three axes) it is ordinary 1-D RoPE.
"""

from __future__ import annotations

from typing import Dict, List

from megatron_patches.config.config_support import is_gdn_variant

__all__ = ["GDN_FAMILIES", "HYBRID_MOE_FAMILIES", "HYBRID_MODEL_FIELDS", "HYBRID_ARCH",
           "gdn_megatron_args", "gdn_hf_config", "gdn_fields_from_hf", "gdn_mismatches",
           "unwrap_text_config"]

GDN_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
"""HF model_types of the GDN hybrids (text models; a Qwen3.5 VLM config.json's text_config)."""
HYBRID_MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text")
"""The GDN hybrids whose MLPs are MoE with one gated shared expert."""
HYBRID_ARCH = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}

_GDN_COMMON = dict(linear_attention_freq=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_num_key_heads=16, attention_output_gate=True,
                   rotary_percent=0.25, qk_norm=True, rms_norm_eps=1e-6, head_dim=256,
                   max_position_embeddings=262144, rope_theta=10000000.0,
                   tie_word_embeddings=False)

HYBRID_MODEL_FIELDS: Dict[str, dict] = {
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, 512 experts (top-10) + one
    # shared expert of 512, attention 16 heads / 2 KV heads of 256.
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next", num_layers=48, hidden_size=2048, ffn_hidden_size=5120,
        num_attention_heads=16, num_query_groups=2, vocab_size=151936,
        linear_num_value_heads=32, num_experts=512, moe_ffn_hidden_size=512, moe_router_topk=10,
        moe_shared_expert_intermediate_size=512, **_GDN_COMMON),
    # Qwen/Qwen3.5-27B config.json text_config (dense): 64 layers, 24 heads / 4 KV heads.
    "qwen3.5-27b": dict(
        family="qwen3_5_text", num_layers=64, hidden_size=5120, ffn_hidden_size=17408,
        num_attention_heads=24, num_query_groups=4, vocab_size=248320,
        linear_num_value_heads=48, **_GDN_COMMON),
    # Qwen/Qwen3.5-35B-A3B config.json text_config: 40 layers, 256 experts (top-8) + one
    # shared expert of 512.
    "qwen3.5-35b-a3b": dict(
        family="qwen3_5_moe_text", num_layers=40, hidden_size=2048, ffn_hidden_size=512,
        num_attention_heads=16, num_query_groups=2, vocab_size=248320,
        linear_num_value_heads=32, num_experts=256, moe_ffn_hidden_size=512, moe_router_topk=8,
        moe_shared_expert_intermediate_size=512, **_GDN_COMMON),
}
"""ModelSpec keyword arguments of the GDN hybrids (model_configs builds the specs)."""


def _num(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() and abs(value) >= 1 else repr(value)


def gdn_megatron_args(spec) -> List[str]:
    """The GDN and gated-attention arguments of a hybrid (Megatron-LM's TransformerConfig
    flags, core_r0.19.0 and main alike); shared experts for the MoE hybrids."""
    args = ["--experimental-attention-variant", "gated_delta_net",
            "--linear-attention-freq", spec.linear_attention_freq,
            "--linear-conv-kernel-dim", spec.linear_conv_kernel_dim,
            "--linear-key-head-dim", spec.linear_key_head_dim,
            "--linear-value-head-dim", spec.linear_value_head_dim,
            "--linear-num-key-heads", spec.linear_num_key_heads,
            "--linear-num-value-heads", spec.linear_num_value_heads,
            "--rotary-percent", _num(spec.rotary_percent)]
    if spec.attention_output_gate:
        args.append("--attention-output-gate")
    if spec.moe_shared_expert_intermediate_size:
        args += ["--moe-shared-expert-intermediate-size",
                 spec.moe_shared_expert_intermediate_size, "--moe-shared-expert-gate"]
    return [str(a) for a in args]


def _layer_types(spec) -> List[str]:
    return ["full_attention" if (i + 1) % spec.linear_attention_freq == 0 else "linear_attention"
            for i in range(spec.num_layers)]


def gdn_hf_config(spec) -> Dict[str, object]:
    """The config.json fields a GDN hybrid adds to (or changes in) the common ones."""
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.rotary_percent}
    if spec.family != "qwen3_next":
        rope.update(mrope_interleaved=True, mrope_section=[11, 11, 10])
    config = {"layer_types": _layer_types(spec),
              "full_attention_interval": spec.linear_attention_freq,
              "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
              "linear_key_head_dim": spec.linear_key_head_dim,
              "linear_value_head_dim": spec.linear_value_head_dim,
              "linear_num_key_heads": spec.linear_num_key_heads,
              "linear_num_value_heads": spec.linear_num_value_heads,
              "partial_rotary_factor": spec.rotary_percent, "rope_parameters": rope,
              "rope_scaling": None}
    if spec.family != "qwen3_next":
        config["attn_output_gate"] = True
    if spec.num_experts is not None:
        config.update(shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                      router_aux_loss_coef=0.001)
    elif spec.family == "qwen3_next":
        config["num_experts"] = 0  # dense MLPs (HF's default is 512 experts)
    return config


def unwrap_text_config(config: Dict[str, object]) -> Dict[str, object]:
    """A Qwen3.5 checkpoint's config.json is the VLM's (model_type qwen3_5 / qwen3_5_moe) with
    the language model under text_config: that one, with its text model_type."""
    kind = config.get("model_type")
    if kind in ("qwen3_5", "qwen3_5_moe") and isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.setdefault("model_type", f"{kind}_text")
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return text
    return config


def gdn_fields_from_hf(config: Dict[str, object], moe: bool) -> Dict[str, object]:
    """The GDN ModelSpec fields of a hybrid's (text) config.json; ValueError for a layout
    Megatron's arguments cannot build."""
    layers = int(config["num_hidden_layers"])
    freq = int(config.get("full_attention_interval") or 4)
    want = ["full_attention" if (i + 1) % freq == 0 else "linear_attention"
            for i in range(layers)]
    if config.get("layer_types") not in (None, want):
        raise ValueError(f"layer_types {config['layer_types']} is not every "
                         f"{freq}-th layer full attention: Megatron's --linear-attention-freq "
                         "builds only that pattern from an int")
    if config.get("attn_output_gate", True) is not True:
        raise ValueError("attn_output_gate=false: the Qwen3-Next / Qwen3.5 attention always "
                         "gates its output (q_proj holds [query; gate])")
    rope = dict(config.get("rope_parameters") or {})
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    fields = dict(linear_attention_freq=freq, attention_output_gate=True,
                  rotary_percent=float(partial))
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):
        fields[name] = int(config[name])
    if moe:
        shared = config.get("shared_expert_intermediate_size")
        fields["moe_shared_expert_intermediate_size"] = int(shared) if shared else None
    return fields


def gdn_mismatches(spec, args) -> List[str]:
    """Where Megatron's parsed arguments build other GDN layers than `spec` (or GDN layers
    where `spec` has none)."""
    variant = getattr(args, "experimental_attention_variant", None)
    if spec.linear_attention_freq is None:
        return ([] if variant is None else
                [f"--experimental-attention-variant {variant} but the checkpoint has no GDN"])
    freq = getattr(args, "linear_attention_freq", None)
    pattern = [0 if (i + 1) % spec.linear_attention_freq == 0 else 1
               for i in range(spec.num_layers)]
    if is_gdn_variant(variant):  # main's 'gdn' and its deprecated alias build the same layer
        variant = "gated_delta_net"
    want = {"--experimental-attention-variant": (variant, "gated_delta_net"),
            "--linear-attention-freq": (freq, pattern if isinstance(freq, list)
                                        else spec.linear_attention_freq),
            "--attention-output-gate": (getattr(args, "attention_output_gate", False),
                                        spec.attention_output_gate),
            "--rotary-percent": (getattr(args, "rotary_percent", 1.0), spec.rotary_percent)}
    for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads"):
        want["--" + name.replace("_", "-")] = (getattr(args, name, None), getattr(spec, name))
    return [f"{flag} {got!r} but the checkpoint needs {need!r}"
            for flag, (got, need) in want.items() if got != need]
