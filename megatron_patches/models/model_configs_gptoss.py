"""gpt-oss as Megatron-LM arguments and config.json fields (openai/gpt-oss-20b), with a tiny twin.

The architecture, read from transformers 5.23 `models/gpt_oss` and megatron-core 0.19.2:
* attention: GQA with biases on q/k/v/o, one learnable sink logit per head (HF `sinks`;
  Megatron `--softmax-type learnable`, the core attention's `softmax_offset`), a sliding window
  on every other layer starting with the first (HF `layer_types`, `sliding_window` S: a query
  sees keys q - kv < S; Megatron `--window-size (S-1,0)` sees q - kv <= S - 1, and
  `--window-attn-skip-freq 2` leaves layer_number % 2 == 0 full);
* MoE in every layer: router with bias, top-k of softmax over the top-k logits, experts with
  biases and the clamped SwiGLU: gate.clamp(max=7) * sigmoid(1.702 gate) * (up.clamp(+-7) + 1)
  (Megatron `--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7`; HF
  interleaves gate/up columns, Megatron stacks them);
* YaRN RoPE (factor 32 over 4096 positions, beta 32/1, no rounding of the correction range).

Not in `model_configs.MODELS`: the generic tools over that registry (HF import/export, capacity,
bench) do not handle gpt-oss yet, and prefix reuse refuses YaRN position embeddings before
compute (runtime/executor.py) -- the twin's attention, sinks, windows and MoE are tested with
plain RoPE (tests/test_gptoss.py, tests/test_gptoss_hf.py). See docs/LIMITS.md.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

__all__ = ["GptOssSpec", "GPTOSS_MODELS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssSpec:
    """A gpt-oss shape in Hugging Face terms (config.json of openai/gpt-oss-*)."""

    name: str
    """Registry name."""
    num_layers: int
    """num_hidden_layers (even: window and full layers alternate)."""
    hidden_size: int
    """hidden_size."""
    num_attention_heads: int
    """num_attention_heads."""
    num_query_groups: int
    """num_key_value_heads."""
    head_dim: int
    """head_dim."""
    vocab_size: int
    """vocab_size."""
    num_experts: int
    """num_local_experts."""
    moe_ffn_hidden_size: int
    """intermediate_size (one expert's width)."""
    moe_router_topk: int
    """num_experts_per_tok."""
    sliding_window: int
    """sliding_window S (a query sees the S most recent keys, itself included)."""
    rope_theta: float = 150000.0
    """rope_theta."""
    yarn_factor: float = 32.0
    """rope_scaling factor (YaRN)."""
    yarn_original_max_position_embeddings: int = 4096
    """rope_scaling original_max_position_embeddings."""
    max_position_embeddings: int = 131072
    """max_position_embeddings."""
    rms_norm_eps: float = 1e-5
    """rms_norm_eps."""
    swiglu_limit: float = 7.0
    """swiglu_limit (the clamp)."""

    def __post_init__(self):
        if self.num_layers % 2 or self.num_layers < 2:
            raise ValueError(f"{self.name}: num_layers must be even (window / full alternate)")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.name}: num_attention_heads must be a multiple of "
                             "num_query_groups")
        if not 1 <= self.moe_router_topk <= self.num_experts or self.sliding_window < 1:
            raise ValueError(f"{self.name}: need 1 <= top-k <= experts and sliding_window >= 1")

    def megatron_args(self) -> List[str]:
        """Megatron-LM command-line arguments building this model."""
        args = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--ffn-hidden-size", self.moe_ffn_hidden_size,
                "--num-attention-heads", self.num_attention_heads,
                "--group-query-attention", "--num-query-groups", self.num_query_groups,
                "--kv-channels", self.head_dim,
                "--max-position-embeddings", self.max_position_embeddings,
                "--position-embedding-type", "yarn", "--rotary-base", int(self.rope_theta),
                "--rotary-scaling-factor", self.yarn_factor,
                "--yarn-original-max-position-embeddings",
                self.yarn_original_max_position_embeddings,
                "--yarn-beta-fast", "32", "--yarn-beta-slow", "1",
                "--no-yarn-correction-range-round-to-int",
                "--normalization", "RMSNorm", "--norm-epsilon", self.rms_norm_eps,
                "--quick-geglu", "--glu-linear-offset", "1.0",
                "--activation-func-clamp-value", self.swiglu_limit, "--add-qkv-bias",
                "--softmax-type", "learnable",
                "--window-size", f"({self.sliding_window - 1},0)", "--window-attn-skip-freq", "2",
                "--num-experts", self.num_experts, "--moe-ffn-hidden-size",
                self.moe_ffn_hidden_size, "--moe-router-topk", self.moe_router_topk,
                "--moe-router-score-function", "softmax",
                "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.001",
                "--untie-embeddings-and-output-weights",
                "--attention-dropout", "0", "--hidden-dropout", "0",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", self.vocab_size,
                "--make-vocab-size-divisible-by", "1"]
        return [str(a) for a in args]

    def hf_config(self) -> Dict[str, object]:
        """The config.json fields of the matching GptOssForCausalLM."""
        return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
                "intermediate_size": self.moe_ffn_hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.moe_router_topk,
                "sliding_window": self.sliding_window,
                "layer_types": ["sliding_attention", "full_attention"] * (self.num_layers // 2),
                "max_position_embeddings": self.max_position_embeddings,
                "rms_norm_eps": self.rms_norm_eps, "swiglu_limit": self.swiglu_limit,
                "attention_bias": True, "attention_dropout": 0.0, "tie_word_embeddings": False,
                "rope_parameters": {
                    "rope_type": "yarn", "rope_theta": self.rope_theta,
                    "factor": self.yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                    "truncate": False, "original_max_position_embeddings":
                        self.yarn_original_max_position_embeddings}}

    def tiny(self) -> "GptOssSpec":
        """The tiny twin: gpt-oss's layer layout (window / full alternating, sinks, MoE top-k,
        GQA ratio 8, head_dim 64 != hidden / heads) at CPU width."""
        return dataclasses.replace(
            self, name=f"{self.name}-tiny", num_layers=4, hidden_size=64, num_attention_heads=16,
            num_query_groups=2, head_dim=8, vocab_size=512, num_experts=8,
            moe_ffn_hidden_size=32, moe_router_topk=2, sliding_window=8)


_GPT_OSS_20B = GptOssSpec(  # openai/gpt-oss-20b config.json
    name="gpt-oss-20b", num_layers=24, hidden_size=2880, num_attention_heads=64,
    num_query_groups=8, head_dim=64, vocab_size=201088, num_experts=32, moe_ffn_hidden_size=2880,
    moe_router_topk=4, sliding_window=128)

GPTOSS_MODELS: Dict[str, GptOssSpec] = {s.name: s for s in (_GPT_OSS_20B, _GPT_OSS_20B.tiny())}
"""gpt-oss-20b and its tiny twin."""
