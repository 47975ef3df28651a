"""`mismatches_with_args`: where Megatron-LM's parsed arguments build another model than a
ModelSpec (model_configs.py re-exports it; the entry point refuses an `--hf-checkpoint` whose
config the arguments do not build)."""

from __future__ import annotations

from typing import List

from megatron_patches.models.model_configs_hybrid import gdn_mismatches
from megatron_patches.models.model_configs_nemotron import nemotron_mismatches

__all__ = ["mismatches_with_args"]


_ARG_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size",
               "ffn_hidden_size": "ffn_hidden_size", "num_attention_heads": "num_attention_heads",
               "num_query_groups": "num_query_groups", "head_dim": "kv_channels",
               "rope_theta": "rotary_base", "rms_norm_eps": "norm_epsilon",
               "qk_norm": "qk_layernorm"}


def mismatches_with_args(spec, args) -> List[str]:
    """Where Megatron's parsed arguments build a different model than `spec` (empty: none)."""
    problems = [f"--{arg.replace('_', '-')} {getattr(args, arg, None)} but the checkpoint has "
                f"{field}={getattr(spec, field)}"
                for field, arg in _ARG_FIELDS.items()
                if getattr(args, "layernorm_epsilon" if arg == "norm_epsilon" else arg, None)
                != getattr(spec, field) and not (field == "rope_theta" and spec.is_nemotron_h)]
    gpt = not spec.is_nemotron_h  # Nemotron-H: relu^2 MLPs, no positions (nemotron_mismatches)
    checks = {"untied embeddings": (args.untie_embeddings_and_output_weights,
                                    not spec.tie_word_embeddings),
              "RoPE scaling": (args.use_rope_scaling, spec.rope_scaling_factor is not None),
              "RMSNorm": (args.normalization, "RMSNorm"), "SwiGLU": (args.swiglu, gpt),
              **({"rope positions": (args.position_embedding_type, "rope")} if gpt else {}),
              "no linear biases": (args.add_bias_linear, False),
              # the converters give Megatron plain-w norms (GDN hybrids: HF (1 + w) -> w + 1)
              "--apply-layernorm-1p": (getattr(args, "layernorm_zero_centered_gamma", False),
                                       False)}
    problems += [f"{what}: arguments give {got!r}, the checkpoint needs {want!r}"
                 for what, (got, want) in checks.items() if got != want]
    if spec.is_moe or getattr(args, "num_experts", None):
        problems += _moe_mismatches(spec, args)
    problems += gdn_mismatches(spec, args) + nemotron_mismatches(spec, args)
    factor = spec.rope_scaling_factor
    if factor is not None and args.rope_scaling_factor != factor:
        problems.append(f"--rope-scaling-factor {args.rope_scaling_factor} but the checkpoint "
                        f"has {spec.rope_scaling_factor}")
    return problems


def _moe_mismatches(spec, args) -> List[str]:
    """Where the MoE arguments route differently from the checkpoint (HF: softmax over all
    experts, top-k, renormalised when norm_topk_prob; every layer MoE; Qwen3-MoE no shared
    expert, Qwen3-Next / Qwen3.5-MoE one sigmoid-gated shared expert)."""
    want = {"--num-experts": (args.num_experts, spec.num_experts),
            "--moe-ffn-hidden-size": (args.moe_ffn_hidden_size, spec.moe_ffn_hidden_size),
            "--moe-router-topk": (args.moe_router_topk, spec.moe_router_topk),
            "--moe-router-score-function": (args.moe_router_score_function, "softmax"),
            "--moe-router-pre-softmax": (args.moe_router_pre_softmax, not spec.moe_norm_topk_prob),
            "--moe-shared-expert-intermediate-size": (args.moe_shared_expert_intermediate_size,
                                                      spec.moe_shared_expert_intermediate_size),
            "--moe-shared-expert-gate": (bool(getattr(args, "moe_shared_expert_gate", False)),
                                         spec.moe_shared_expert_intermediate_size is not None),
            "--moe-router-topk-scaling-factor": (args.moe_router_topk_scaling_factor, None),
            "--moe-router-num-groups": (args.moe_router_num_groups, None),
            "--moe-layer-freq": (args.moe_layer_freq in (1, [1] * spec.num_layers), True)}
    return [f"{flag} {got!r} but the checkpoint needs {need!r}"
            for flag, (got, need) in want.items() if got != need]
