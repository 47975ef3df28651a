"""Tiny Megatron `HybridModel`s from Megatron's own local (non-TE) modules, for tests and demos.

megatron-core 0.19 deprecates `GPTModel` in favour of `HybridModel`, whose layer pattern is a
string with one symbol per layer: `*` attention, `-` MLP, `E` MoE, `M` Mamba, ... Megatron's
`hybrid_stack_spec` builds every layer from Transformer Engine modules; `local_hybrid_stack_spec`
builds the same layers from the modules of Megatron's local GPT layer spec (the spec
`models.build_model` uses), so a HybridModel runs on CPU. Prefix reuse runs on any spec: the hooks
sit in `Attention` and `HybridModel.forward`, not in the modules chosen here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

# before megatron.core, as models.py itself is (it sets up Megatron on CPU where needed)
from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_block import (
    HybridStack,
    HybridStackSubmodules,
)
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

__all__ = ["LocalNormHybridStack", "build_hybrid_model", "local_hybrid_stack_spec",
           "pattern_num_layers"]


class LocalNormHybridStack(HybridStack):
    """`HybridStack` whose final norm is the local spec's torch norm.

    `HybridStack.__init__` builds its final norm as `TENorm` whatever the spec says (Transformer
    Engine only); this builds the stack without it and adds the local one under the same name, so
    `HybridStack.forward` runs unchanged.
    """

    def __init__(self, config, submodules, *, post_layer_norm: bool = True,
                 post_process: bool = True, final_norm=None, **kwargs):
        super().__init__(config, submodules, post_layer_norm=False, post_process=post_process,
                         **kwargs)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = final_norm(config=config, hidden_size=config.hidden_size,
                                         eps=config.layernorm_epsilon)


def _local_mamba_layer() -> ModuleSpec:
    """Megatron's MambaLayer with the local norm and plain TP linears (imported here: Megatron-LM
    main's mamba_mixer imports Triton kernels at import time, so only Mamba models need it)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    norm = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.input_layernorm
    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))


def local_hybrid_stack_spec(*, num_moe_experts: Optional[int] = None,
                            mamba: bool = False) -> ModuleSpec:
    """A HybridStack spec with attention (`*`), gated delta net (`G`), MLP (`-`), with `mamba`
    Mamba-2 (`M`) and, with experts, MoE (`E`) layers.

    Each layer kind takes its modules from `get_gpt_layer_local_spec(normalization="RMSNorm")`:
    the attention layer is that layer without its MLP half, the MLP layer the MLP half, so the
    pattern `*-*-` is the GPT local spec's 2-layer model. A `G` layer is the attention layer with
    Megatron's GatedDeltaNet (local in/out projections, the local RMSNorm as its output norm;
    TE's spec fuses the input norm into in_proj) -- its config needs the `linear_*` fields. An
    `M` layer is Megatron's `MambaLayer` / `MambaMixer` with the local norm in front of a plain
    `ColumnParallelLinear` in-projection (TE's spec fuses that norm too; its config needs the
    `mamba_*` fields); on CPU the Mamba and GDN kernels are the CPU layer's torch stand-ins
    (megatron_patches/support/mamba_cpu.py, gdn_cpu.py). Other symbols build Megatron's placeholder
    (`IdentityOp`), enough to reach prefix reuse's refusal of them.
    """
    gpt = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    attention = TransformerLayerSubmodules(input_layernorm=gpt.input_layernorm,
                                           self_attention=gpt.self_attention,
                                           self_attn_bda=gpt.self_attn_bda)
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp,
                                     mlp_bda=gpt.mlp_bda)
    gdn = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attn_bda=gpt.self_attn_bda,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=gpt.input_layernorm,
            out_proj=RowParallelLinear)))
    layers = dict(attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
                  gdn_layer=ModuleSpec(module=TransformerLayer, submodules=gdn),
                  mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp))
    if mamba:
        layers["mamba_layer"] = _local_mamba_layer()
    if num_moe_experts:
        moe = get_gpt_layer_local_spec(num_experts=num_moe_experts, moe_grouped_gemm=False,
                                       normalization="RMSNorm").submodules
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer,
                                         submodules=dataclasses.replace(mlp, mlp=moe.mlp))
    return ModuleSpec(module=LocalNormHybridStack, submodules=HybridStackSubmodules(**layers),
                      params={"final_norm": gpt.input_layernorm})


def pattern_num_layers(pattern: str) -> int:
    """Layers of the main decoder in a hybrid layer pattern (`|` stage marks, no MTP part)."""
    return len(pattern.split("/")[0].replace("|", ""))


def build_hybrid_model(cfg: TinyLlamaConfig, pattern: str, *, seed: Optional[int] = 1234,
                       num_moe_experts: Optional[int] = None, config=None,
                       position_embedding_type: str = "rope", **config_overrides) -> HybridModel:
    """This pipeline stage's part of a tiny Llama-style HybridModel (RoPE, SwiGLU, RMSNorm, GQA).

    `cfg.num_layers` is ignored: the pattern says how many layers there are. With pipeline
    parallelism the config allows variable row lengths (stock dense 1F1B is the reference).
    `config`: a ready TransformerConfig to build with instead (e.g. Megatron-LM's
    `core_transformer_config_from_args`, which sets `is_hybrid_model=True` for a
    `--hybrid-layer-pattern`); `cfg` then gives the vocabulary and maximum length only.
    `position_embedding_type="none"`: attention without positions (Nemotron-H).
    """
    overrides = {"num_layers": pattern_num_layers(pattern)}
    if num_moe_experts:
        overrides.update(num_moe_experts=num_moe_experts, moe_ffn_hidden_size=cfg.ffn_hidden_size,
                         moe_router_topk=min(2, num_moe_experts))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if seed is not None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    if config is None:
        config = make_transformer_config(cfg, **{**overrides, **config_overrides})
    elif config_overrides or num_moe_experts:
        raise ValueError("build_hybrid_model(config=...) builds with that config as given; "
                         "put num_moe_experts and other settings in it")
    else:
        num_moe_experts = config.num_moe_experts
    model = HybridModel(
        config=config,
        hybrid_stack_spec=local_hybrid_stack_spec(num_moe_experts=num_moe_experts,
                                                  mamba="M" in pattern),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        hybrid_layer_pattern=pattern,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type=position_embedding_type,
        rotary_base=10000,
    )
    model = model.to(cfg.params_dtype)
    return model.cuda() if torch.cuda.is_available() else model
