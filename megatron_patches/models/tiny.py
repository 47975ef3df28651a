"""Tiny Llama-style Megatron GPT models (RoPE, SwiGLU, RMSNorm, GQA) for tests, demo and bench.

Two layer specs over the same parameters: Megatron's local spec (stock, unfused attention: the
reference for equivalence) and the same spec with a fused-SDPA core attention (the fair dense
baseline for speed: the reuse path's attention is fused too).

The shapes of the paper's models are expressible: Llama 3 (`rotary_base=500000`), Llama 3.1
(also `rope_scaling_factor=8.0`), Qwen3 (`qk_layernorm=True`, `kv_channels` != hidden / heads,
`rotary_base=1000000`, `layernorm_epsilon=1e-6`). Every option is honoured or refused.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_patches.support.cpu_support import stub_missing_triton
from megatron_patches.support.failures import COLLECTIVE_TIMEOUT_ENV, collective_timeout_s

stub_missing_triton()  # `import megatron.core` needs it where triton is missing; CPU runs also
# call megatron_patches.enable_cpu_support() themselves (tests, demo, bench, examples' --cpu)

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

__all__ = [
    "TinyLlamaConfig",
    "FusedSDPACoreAttention",
    "ContextParallelReuseCoreAttention",
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
    kv_channels: Optional[int] = None
    """Head dim; None: hidden_size // num_attention_heads (Qwen3 uses 128 at any width)."""
    qk_layernorm: bool = False
    """RMSNorm over head_dim on every query and key head, before RoPE (Qwen3)."""
    rotary_base: float = 10000
    """RoPE theta (Llama 2: 10000, Llama 3: 500000, Qwen3: 1000000)."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1 RoPE frequency scaling with this factor (8.0 for Llama 3.1); None: off.
    megatron-core 0.19.2 fixes the other three parameters at Llama 3.1's values:
    low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192."""
    layernorm_epsilon: float = 1e-5
    """RMSNorm epsilon (Llama: 1e-5, Qwen3: 1e-6)."""

    def __post_init__(self):
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads (or give "
                             "kv_channels, the head dim)")
        if self.kv_channels is not None and (self.kv_channels < 2 or self.kv_channels % 2):
            raise ValueError(f"kv_channels={self.kv_channels}; RoPE needs an even head dim >= 2")
        if not self.rotary_base > 0:
            raise ValueError(f"rotary_base={self.rotary_base}; give RoPE's theta, > 0")
        if self.rope_scaling_factor is not None and not self.rope_scaling_factor >= 1:
            raise ValueError(f"rope_scaling_factor={self.rope_scaling_factor}; give a factor >= 1 "
                             "(Llama 3.1: 8.0) or None")


def initialize_single_process(seed: int = 1234, tp: int = 1, pp: int = 1) -> None:
    """Create a one-process gloo group (if needed) and Megatron's parallel state."""
    if not torch.distributed.is_initialized():
        # A one-process group needs no rendezvous port: a private file store cannot collide with
        # other jobs on the machine (a pid-derived port did, under concurrent test runs).
        store = torch.distributed.FileStore(tempfile.mkstemp(prefix="prefix-reuse-store-")[1], 1)
        torch.distributed.init_process_group("gloo", rank=0, world_size=1, store=store)
    initialize_distributed(seed=seed, tp=tp, pp=pp)


def initialize_distributed(seed: int = 1234, tp: int = 1, pp: int = 1,
                           vpp: Optional[int] = None, timeout_s: Optional[float] = None,
                           ep: int = 1, cp: int = 1) -> None:
    """Megatron parallel state + RNG tracker on an already initialised process group.

    `vpp`: virtual pipeline stages per rank (Megatron's interleaved layout); `ep`: expert
    parallel size (carved out of the data-parallel ranks, as Megatron does); `cp`: context
    parallel size. `timeout_s`: how
    long a collective or p2p in Megatron's groups waits for its peers before it fails (None:
    `$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S`, which the launchers set, else Megatron's default of
    30 minutes)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if timeout_s is None and os.environ.get(COLLECTIVE_TIMEOUT_ENV):
        timeout_s = collective_timeout_s(0)
    extra = {} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        context_parallel_size=cp, **extra
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def make_transformer_config(cfg: TinyLlamaConfig, *, config_cls=TransformerConfig,
                            **overrides) -> TransformerConfig:
    """A Llama-style TransformerConfig (dropout 0, RMSNorm, SwiGLU, no biases); `config_cls`:
    a TransformerConfig subclass (MLATransformerConfig for multi-latent attention, whose own
    fields go in `overrides`)."""
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        qk_layernorm=cfg.qk_layernorm,
        layernorm_epsilon=cfg.layernorm_epsilon,
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
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


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

    @staticmethod
    def check_config(config: TransformerConfig) -> None:
        """ValueError for attention options this plain causal SDPA call would ignore."""
        ignored = {"attention_dropout": config.attention_dropout > 0,
                   "window_size": config.window_size is not None,
                   "softmax_type": config.softmax_type != "vanilla",
                   "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling}
        bad = [name for name, set_ in ignored.items() if set_]
        if bad:
            raise ValueError(f"fused_attention=True runs plain causal SDPA, which ignores {bad}; "
                             "use the local spec (fused_attention=False) for these options")

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


class ContextParallelReuseCoreAttention(MegatronModule):
    """Core attention of a CP > 1 model on the local spec (whose DotProductAttention refuses CP:
    stock dense CP needs Transformer Engine). Reuse steps never reach it -- the reuse hook runs
    every attention of a reuse step, CP included (runtime/cp.py) -- so it only refuses dense
    forwards. No parameters: the model's weights are the local spec's."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, *args, **kwargs):
        raise ValueError("this CPU model was built with context_parallel_size > 1, which stock "
                         "Megatron runs only on Transformer Engine's attention; run dense steps "
                         "at CP=1 (prefix-reuse steps run CP themselves)")


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


def _sequence_parallel_block_spec(spec, config: TransformerConfig,
                                  vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """A layer spec (or an MoE model's block spec, its layers in place) with sequence-parallel
    norms."""
    for layer_spec in getattr(spec, "layer_specs", [spec]):
        layer_spec.submodules.input_layernorm = SequenceParallelTorchNorm
        layer_spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
        if config.qk_layernorm:  # per-head norms: their TP grad sum is finalize_model_grads' job
            attention = layer_spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
    if hasattr(spec, "layer_specs"):
        spec.layer_norm = SequenceParallelTorchNorm
        return spec
    layer_spec = spec
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=SequenceParallelTorchNorm)


def _check_buildable(config: TransformerConfig, fused_attention: bool) -> None:
    """Options this builder's layer spec would not honour: refused, never dropped."""
    if config.multi_latent_attention and (fused_attention or config.qk_l2_norm):
        raise ValueError("build_model builds MLA (multi_latent_attention=True, an "
                         "MLATransformerConfig) with Megatron's local core attention only: "
                         "fused_attention and qk_l2_norm are not supported with it")
    if config.qk_layernorm and config.qk_l2_norm:
        raise ValueError("qk_layernorm and qk_l2_norm are exclusive; choose one")
    if fused_attention:
        FusedSDPACoreAttention.check_config(config)


def build_model(cfg: TinyLlamaConfig, *, fused_attention: bool = False, seed: Optional[int] = 1234,
                transformer_config: Optional[TransformerConfig] = None,
                vp_stage: Optional[int] = None, **config_overrides) -> GPTModel:
    """Build this pipeline stage's part of a tiny Llama GPTModel with Megatron's local layer spec.

    `fused_attention=True` swaps the core attention for `FusedSDPACoreAttention` (same
    parameters: core attention has none), the fair dense baseline for timing. With
    `sequence_parallel=True` (TP > 1) the norms are `SequenceParallelTorchNorm`. With pipeline
    parallelism the config allows variable row lengths, so that stock dense 1F1B (the reference)
    can run rows of any length. `config_overrides` are TransformerConfig fields; the layer spec
    follows the config (normalization, qk_layernorm / qk_l2_norm), and what the spec cannot
    build is refused with a ValueError. `transformer_config` (e.g. built by Megatron-LM's
    argument parser) replaces the config made from `cfg` and the overrides; `cfg` still gives
    the vocabulary, the longest sequence and the RoPE base/scaling. With virtual pipeline
    stages, `vp_stage` = v builds this rank's model chunk v (Megatron's interleaved layout).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        config_overrides = {"variable_seq_lengths": True,
                            "moe_token_dispatcher_type": "alltoall",  # required by the former
                            **config_overrides}
    if seed is not None:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = transformer_config or make_transformer_config(cfg, **config_overrides)
    _check_buildable(config, fused_attention)
    if config.num_moe_experts:  # MoE layers where config.moe_layer_freq says (Megatron's spec)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=config.normalization,
                                          qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=config.normalization,
                                        qk_layernorm=config.qk_layernorm,
                                        qk_l2_norm=config.qk_l2_norm,
                                        multi_latent_attention=config.multi_latent_attention)
    if config.multi_latent_attention:  # the local core attention, sized for MLA (models/mla.py)
        from megatron_patches.models.mla import use_local_mla_core_attention

        use_local_mla_core_attention(spec)
    if fused_attention:
        for layer_spec in getattr(spec, "layer_specs", [spec]):  # an MoE model's block spec
            layer_spec.submodules.self_attention.submodules.core_attention = FusedSDPACoreAttention
    if config.context_parallel_size > 1:  # the local DotProductAttention refuses CP
        for layer_spec in getattr(spec, "layer_specs", [spec]):
            layer_spec.submodules.self_attention.submodules.core_attention = (
                ContextParallelReuseCoreAttention)
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
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling_factor is not None,
        rope_scaling_factor=cfg.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
    )
    model = model.to(cfg.params_dtype)
    return model.cuda() if torch.cuda.is_available() else model
