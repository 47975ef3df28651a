"""DeepSeek-V3 (multi-latent attention, MoE with a dense first block) and its tiny twin, in
Hugging Face terms, as Megatron-LM arguments and as MLATransformerConfig fields.

    python -c "from megatron_patches.models.model_configs_mla import MLA_MODELS; \\
               print(' '.join(MLA_MODELS['deepseek-v3-tiny'].megatron_args()))"

The values are those of deepseek-ai/DeepSeek-V3's config.json. The tiny twin keeps the layout:
the first `first_k_dense_replace` layers dense, MoE after (sigmoid router with expert bias,
group-limited top-k, scaled by routed_scaling_factor, one shared expert), MLA with a q LoRA,
a KV latent, Q/K head dim (nope + rope) wider than V's, yarn RoPE with its mscale. MTP layers
(num_nextn_predict_layers) are not built: training MTP with prefix reuse is refused
(megatron_patches/config/config_support.py, _MTP_WHY).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

__all__ = ["MLASpec", "MLA_MODELS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLASpec:
    """A DeepSeek-V3-style model (HF model_type "deepseek_v3")."""

    name: str
    """Registry name."""
    num_layers: int
    """num_hidden_layers."""
    hidden_size: int
    """hidden_size."""
    ffn_hidden_size: int
    """intermediate_size (dense layers' SwiGLU width)."""
    num_attention_heads: int
    """num_attention_heads (MLA: one K/V head per query head)."""
    q_lora_rank: int
    """q_lora_rank (query down-projection width)."""
    kv_lora_rank: int
    """kv_lora_rank (the KV latent's width)."""
    qk_nope_head_dim: int
    """qk_nope_head_dim (Megatron qk_head_dim)."""
    qk_rope_head_dim: int
    """qk_rope_head_dim (Megatron qk_pos_emb_head_dim; one RoPE'd key head shared by all heads)."""
    v_head_dim: int
    """v_head_dim."""
    vocab_size: int
    """vocab_size."""
    max_position_embeddings: int
    """max_position_embeddings."""
    rope_theta: float
    """rope_theta."""
    yarn_factor: float
    """rope_scaling.factor (yarn)."""
    yarn_original_max_position_embeddings: int
    """rope_scaling.original_max_position_embeddings."""
    yarn_beta_fast: float
    """rope_scaling.beta_fast."""
    yarn_beta_slow: float
    """rope_scaling.beta_slow."""
    yarn_mscale: float
    """rope_scaling.mscale."""
    yarn_mscale_all_dim: float
    """rope_scaling.mscale_all_dim."""
    rms_norm_eps: float
    """rms_norm_eps."""
    first_k_dense_replace: int
    """Dense layers before the MoE layers."""
    num_experts: int
    """n_routed_experts."""
    moe_ffn_hidden_size: int
    """moe_intermediate_size."""
    moe_router_topk: int
    """num_experts_per_tok."""
    n_shared_experts: int
    """n_shared_experts (Megatron: one shared expert of n x moe_intermediate_size)."""
    n_group: int
    """n_group (Megatron moe_router_num_groups)."""
    topk_group: int
    """topk_group (Megatron moe_router_group_topk)."""
    routed_scaling_factor: float
    """routed_scaling_factor (Megatron moe_router_topk_scaling_factor)."""

    def __post_init__(self):
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"{self.name}: first_k_dense_replace={self.first_k_dense_replace} "
                             f"must be within 0..num_layers={self.num_layers}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"{self.name}: n_group={self.n_group} must divide n_routed_experts="
                             f"{self.num_experts} and be >= topk_group={self.topk_group}")

    def with_layers(self, num_layers: int) -> "MLASpec":
        """The same model with another depth (the dense prefix kept, clipped to the depth)."""
        return dataclasses.replace(self, num_layers=num_layers, first_k_dense_replace=min(
            self.first_k_dense_replace, num_layers))

    def moe_layer_freq(self) -> List[int]:
        return [0] * self.first_k_dense_replace + [1] * (self.num_layers - self.first_k_dense_replace)

    def megatron_config_fields(self, *, moe: bool = True) -> Dict[str, object]:
        """MLATransformerConfig fields (besides the GPT ones of tiny.make_transformer_config:
        kv_channels = v_head_dim there, the local core attention's output width). Without
        `moe`, every layer dense."""
        fields = dict(
            multi_latent_attention=True, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            kv_channels=self.v_head_dim, qk_layernorm=True, rope_type="yarn",
            rotary_base=self.rope_theta, rotary_scaling_factor=self.yarn_factor,
            original_max_position_embeddings=self.yarn_original_max_position_embeddings,
            beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow,
            mscale=self.yarn_mscale, mscale_all_dim=self.yarn_mscale_all_dim,
            layernorm_epsilon=self.rms_norm_eps)
        if moe:
            fields.update(
                num_moe_experts=self.num_experts, moe_layer_freq=self.moe_layer_freq(),
                moe_ffn_hidden_size=self.moe_ffn_hidden_size, moe_router_topk=self.moe_router_topk,
                moe_shared_expert_intermediate_size=self.n_shared_experts * self.moe_ffn_hidden_size,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=1e-3, moe_router_num_groups=self.n_group,
                moe_router_group_topk=self.topk_group,
                moe_router_topk_scaling_factor=self.routed_scaling_factor,
                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                moe_token_dispatcher_type="alltoall")
        return fields

    def megatron_args(self) -> List[str]:
        """Megatron-LM command-line arguments building this model (slime's deepseek-v3 model
        arguments at this size; vocabulary unpadded)."""
        args = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--ffn-hidden-size", self.ffn_hidden_size,
                "--num-attention-heads", self.num_attention_heads,
                "--kv-channels", self.v_head_dim,
                "--multi-latent-attention", "--q-lora-rank", self.q_lora_rank,
                "--kv-lora-rank", self.kv_lora_rank, "--qk-head-dim", self.qk_nope_head_dim,
                "--qk-pos-emb-head-dim", self.qk_rope_head_dim, "--v-head-dim", self.v_head_dim,
                "--qk-layernorm", "--rope-type", "yarn",
                "--rotary-scaling-factor", self.yarn_factor, "--mscale", self.yarn_mscale,
                "--mscale-all-dim", self.yarn_mscale_all_dim,
                "--max-position-embeddings", self.max_position_embeddings,
                "--position-embedding-type", "rope", "--rotary-base", int(self.rope_theta),
                "--normalization", "RMSNorm", "--norm-epsilon", self.rms_norm_eps, "--swiglu",
                "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", self.vocab_size,
                "--make-vocab-size-divisible-by", 1,
                "--attention-dropout", 0, "--hidden-dropout", 0,
                "--num-experts", self.num_experts,
                "--moe-layer-freq", f"([0]*{self.first_k_dense_replace}+[1]*"
                                    f"{self.num_layers - self.first_k_dense_replace})",
                "--moe-ffn-hidden-size", self.moe_ffn_hidden_size,
                "--moe-router-topk", self.moe_router_topk,
                "--moe-shared-expert-intermediate-size",
                self.n_shared_experts * self.moe_ffn_hidden_size,
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", 1e-3,
                "--moe-router-num-groups", self.n_group, "--moe-router-group-topk", self.topk_group,
                "--moe-router-topk-scaling-factor", self.routed_scaling_factor,
                "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", 1e-4,
                "--moe-token-dispatcher-type", "alltoall"]
        return [str(a) for a in args]

    def hf_config(self) -> Dict[str, object]:
        """config.json fields of transformers' DeepseekV3Config for this model."""
        return dict(
            model_type="deepseek_v3", num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size, intermediate_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=False, attention_bias=False,
            hidden_act="silu", first_k_dense_replace=self.first_k_dense_replace,
            n_routed_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
            num_experts_per_tok=self.moe_router_topk, n_shared_experts=self.n_shared_experts,
            n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=self.rope_theta, factor=self.yarn_factor,
                original_max_position_embeddings=self.yarn_original_max_position_embeddings,
                beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow,
                mscale=self.yarn_mscale, mscale_all_dim=self.yarn_mscale_all_dim))


_DEEPSEEK_V3 = dict(
    num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, rope_theta=10000.0,
    yarn_factor=40.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
    yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0, rms_norm_eps=1e-6,
    first_k_dense_replace=3, num_experts=256, moe_ffn_hidden_size=2048, moe_router_topk=8,
    n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5)

# the tiny twin: the same layout and ratios' kinds (Q/K wider than V, q LoRA > KV latent,
# grouped routing) at CPU size; one dense layer, then MoE
_TINY = dict(_DEEPSEEK_V3, num_layers=3, hidden_size=64, ffn_hidden_size=96,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=12, vocab_size=256,
             first_k_dense_replace=1, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=4,
             n_group=4, topk_group=2)

MLA_MODELS: Dict[str, MLASpec] = {
    "deepseek-v3": MLASpec(name="deepseek-v3", **_DEEPSEEK_V3),
    "deepseek-v3-tiny": MLASpec(name="deepseek-v3-tiny", **_TINY),
}
