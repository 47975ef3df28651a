"""Tiny MLA models for the tests (tests/test_mla.py, test_reference_hf_mla.py): the DeepSeek-V3
tiny twin's Megatron config (megatron_patches/models/model_configs_mla.py) built on the local
spec, and a GQA-free plain-RoPE variant."""

from __future__ import annotations

import torch


def mla_model(*, moe: bool = False, rope_type: str = "yarn", num_layers: int = None,
              params_dtype=torch.float32, **overrides):
    """This rank's stage of the DeepSeek-V3 tiny twin (dense first layer, MoE after when
    `moe`; without `moe` every layer dense), fp32 unless `params_dtype`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron_patches.models.model_configs_mla import MLA_MODELS
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, make_transformer_config

    spec = MLA_MODELS["deepseek-v3-tiny"]
    if num_layers is not None:
        spec = spec.with_layers(num_layers)
    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_attention_heads,
                          kv_channels=spec.v_head_dim, vocab_size=spec.vocab_size,
                          max_seq_len=512, params_dtype=params_dtype,
                          layernorm_epsilon=spec.rms_norm_eps)
    fields = spec.megatron_config_fields(moe=moe)
    if rope_type == "rope":
        fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # as build_model does
        fields.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    fields.update(overrides)
    config = make_transformer_config(cfg, config_cls=MLATransformerConfig, **fields)
    return build_model(cfg, transformer_config=config)
