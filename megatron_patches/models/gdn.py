"""Gated DeltaNet (GDN) layers in tiny Megatron GPT models, from local (non-TE) modules.

megatron-core 0.19 builds a GDN model (`experimental_attention_variant="gated_delta_net"`,
`linear_attention_freq`) through `get_transformer_block_with_experimental_attention_variant_spec`,
which asserts Transformer Engine; its local backend builds no fused `in_proj` norm. This builds
the same per-layer pattern (`get_linear_attention_pattern`: 1 = GDN, 0 = softmax attention) from
the local GPT layer spec: a GDN layer is the local layer with its `self_attention` replaced by
Megatron's `GatedDeltaNet` (in_proj a ColumnParallelLinear, out_norm the local RMSNorm, out_proj a
RowParallelLinear) behind the layer's own input norm, which is what TE's fused
`column_parallel_layer_norm_linear` computes. On CPU it needs `enable_cpu_support()` (torch
stand-ins for fla: megatron_patches/support/gdn_cpu.py).
"""

from __future__ import annotations

import copy
from typing import List, Optional

import torch

from megatron_patches.config.config_support import is_gdn_variant
from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

__all__ = ["GDN_TINY_SHAPE", "build_gdn_model", "gdn_block_spec", "gdn_layer_numbers"]

GDN_TINY_SHAPE = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4)
"""GDN head shape of the tiny test models (GQA-style: 2 key heads, 4 value heads)."""


def _local_layer_specs(config) -> List[ModuleSpec]:
    if config.num_moe_experts:  # MoE layers where config.moe_layer_freq says (Megatron's spec)
        plain = copy.copy(config)  # Megatron's MoE block spec asserts no attention variant
        plain.experimental_attention_variant = None
        block = get_gpt_decoder_block_spec(plain, use_transformer_engine=False,
                                           normalization=config.normalization)
        return [copy.deepcopy(s) for s in block.layer_specs]
    layer = get_gpt_layer_local_spec(normalization=config.normalization,
                                     qk_layernorm=config.qk_layernorm)
    return [copy.deepcopy(layer) for _ in range(config.num_layers)]


def gdn_block_spec(config, *, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """This pipeline stage's layer specs: GDN where `get_linear_attention_pattern` says 1."""
    pattern = get_linear_attention_pattern(config)
    specs = _local_layer_specs(config)
    gpt = get_gpt_layer_local_spec(normalization=config.normalization).submodules
    for spec, linear in zip(specs, pattern):
        if linear:
            spec.submodules.self_attention = ModuleSpec(
                module=GatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                                   out_norm=gpt.input_layernorm,
                                                   out_proj=RowParallelLinear))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count],
                                      layer_norm=gpt.input_layernorm)


def gdn_layer_numbers(config) -> tuple:
    """Global (1-based) numbers of the GDN layers of a GPTModel config (empty without GDN)."""
    if not is_gdn_variant(config.experimental_attention_variant):
        return ()
    return tuple(i for i, linear in enumerate(get_linear_attention_pattern(config), start=1)
                 if linear)


def build_gdn_model(cfg: TinyLlamaConfig, *, linear_attention_freq=4, seed: Optional[int] = 1234,
                    rotary_percent: float = 1.0, **config_overrides) -> GPTModel:
    """This stage's part of a tiny Qwen3-Next-style GPTModel: GDN layers, and softmax attention
    every `linear_attention_freq`-th layer (an int, or a 0/1 list per layer)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        config_overrides = {"variable_seq_lengths": True,
                            "moe_token_dispatcher_type": "alltoall", **config_overrides}
    if seed is not None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = make_transformer_config(
        cfg, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_freq, **{**GDN_TINY_SHAPE, **config_overrides})
    model = GPTModel(
        config=config, transformer_layer_spec=gdn_block_spec(config),
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_percent=rotary_percent, rotary_base=cfg.rotary_base)
    model = model.to(cfg.params_dtype)
    return model.cuda() if torch.cuda.is_available() else model
