"""Tiny Llama-style Megatron GPT models (RoPE, SwiGLU, RMSNorm, GQA) for tests, demo and bench.

Two layer specs over the same parameters: Megatron's local spec (stock, unfused attention: the
reference for equivalence) and the same spec with a fused-SDPA core attention (the fair dense
baseline for speed: the reuse path's attention is fused too).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_patches.cpu_support import stub_missing_triton

stub_missing_triton()  # `import megatron.core` needs it where triton is missing; CPU runs also
# call megatron_patches.enable_cpu_support() themselves (tests, demo, bench, examples' --cpu)

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

__all__ = [
    "TinyLlamaConfig",
    "FusedSDPACoreAttention",
    "SequenceParallelTorchNorm",
    "initialize_single_process",
    "initialize_distributed",
    "build_model",
    "make_transformer_config",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyLlamaConfig:
    """Shape of a tiny Llama-style model."""

    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 256
    """Model width."""
    ffn_hidden_size: int = 688
    """SwiGLU inner width (each of the two gated projections)."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int = 2
    """K/V heads (GQA when fewer than the query heads)."""
    vocab_size: int = 2048
    """Vocabulary size (divisible by 128 for Megatron's padding-free path)."""
    max_seq_len: int = 4096
    """Longest [prefix; suffix] sequence the model accepts."""
    params_dtype: torch.dtype = torch.float32
    """Parameter dtype (float32 or bfloat16)."""

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")


def initialize_single_process(seed: int = 1234, tp: int = 1, pp: int = 1) -> None:
    """Create a one-process gloo group (if needed) and Megatron's parallel state."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    initialize_distributed(seed=seed, tp=tp, pp=pp)


def initialize_distributed(seed: int = 1234, tp: int = 1, pp: int = 1,
                           vpp: Optional[int] = None) -> None:
    """Megatron parallel state + RNG tracker on an already initialised process group (`vpp`:
    virtual pipeline stages per rank, Megatron's interleaved layout)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def make_transformer_config(cfg: TinyLlamaConfig, **overrides) -> TransformerConfig:
    """A Llama-style TransformerConfig (dropout 0, RMSNorm, SwiGLU, no biases)."""
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=cfg.params_dtype,
        bf16=cfg.params_dtype == torch.bfloat16,
        pipeline_dtype=cfg.params_dtype,
        use_cpu_initialization=True,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class FusedSDPACoreAttention(MegatronModule):
    """Causal core attention through torch's fused SDPA (drop-in for the local spec's).

    The dense speed baseline: on CPU SDPA runs the fused flash kernel, the same family the
    prefix-reuse path uses, so dense and reuse are compared kernel for kernel.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else kv_channels**-0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_mask is not None or packed_seq_params is not None or attention_bias is not None:
            raise ValueError("FusedSDPACoreAttention supports plain causal attention only")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class SequenceParallelTorchNorm:
    """torch RMSNorm / LayerNorm for a layer spec that allows `sequence_parallel=True` on CPU.

    Megatron's local `WrappedTorchNorm` refuses sequence parallelism although a norm works per
    token; the only extra need is summing its weight gradient over the TP ranks, which
    `finalize_model_grads` does for parameters marked `sequence_parallel` (so use Megatron's DDP
    wrapper and finalize_model_grads with it).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[config.normalization]
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _sequence_parallel_block_spec(layer_spec, config: TransformerConfig,
                                  vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=SequenceParallelTorchNorm)


def build_model(cfg: TinyLlamaConfig, *, fused_attention: bool = False, seed: Optional[int] = 1234,
                transformer_config: Optional[TransformerConfig] = None,
                vp_stage: Optional[int] = None, **config_overrides) -> GPTModel:
    """Build this pipeline stage's part of a tiny Llama GPTModel with Megatron's local layer spec.

    `fused_attention=True` swaps the core attention for `FusedSDPACoreAttention` (same
    parameters: core attention has none), the fair dense baseline for timing. With
    `sequence_parallel=True` (TP > 1) the norms are `SequenceParallelTorchNorm`. With pipeline
    parallelism the config allows variable row lengths, so that stock dense 1F1B (the reference)
    can run rows of any length. `transformer_config` (e.g. built by Megatron-LM's argument
    parser) replaces the config made from `cfg` and the overrides; `cfg` still gives the
    vocabulary and the longest sequence. With virtual pipeline stages, `vp_stage` = v builds
    this rank's model chunk v (Megatron's interleaved layout).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        config_overrides = {"variable_seq_lengths": True,
                            "moe_token_dispatcher_type": "alltoall",  # required by the former
                            **config_overrides}
    if seed is not None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = transformer_config or make_transformer_config(cfg, **config_overrides)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if fused_attention:
        spec.submodules.self_attention.submodules.core_attention = FusedSDPACoreAttention
    if config.sequence_parallel:  # the local spec's norms refuse it
        spec = _sequence_parallel_block_spec(spec, config, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None,
                                                           vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None,
                                                           vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
        vp_stage=vp_stage,
    )
    model = model.to(cfg.params_dtype)
    return model.cuda() if torch.cuda.is_available() else model
