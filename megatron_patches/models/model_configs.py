"""The paper's models as Megatron-LM arguments that match their Hugging Face configs field by field.

    python -m megatron_patches.models.model_configs list
    python -m megatron_patches.models.model_configs megatron-args qwen3-8b     # for the entry point
    python -m megatron_patches.models.model_configs hf-config qwen3-8b-tiny    # config.json fields

Each model has a scaled-down twin (`<name>-tiny`): the same architecture (GQA ratio, head_dim vs
hidden/heads, qk-norm, RoPE theta and scaling, norm epsilon, tied or untied embeddings, MoE
routing) at tiny sizes, runnable on a CPU. The values are those of the public config.json files
(meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B).
Qwen3-30B-A3B is a mixture of experts: prefix reuse trains it with logical prefix-token accounting
(megatron_patches/runtime/moe.py; its tiny twin: tests/test_moe.py). The Gated DeltaNet hybrids
(Qwen/Qwen3-Next-80B-A3B-Instruct, Qwen/Qwen3.5-27B, Qwen/Qwen3.5-35B-A3B) are
model_configs_hybrid.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from megatron_patches.models.model_configs_hybrid import (GDN_FAMILIES, HYBRID_ARCH,
                                                          HYBRID_MODEL_FIELDS, HYBRID_MOE_FAMILIES,
                                                          gdn_fields_from_hf, gdn_hf_config,
                                                          gdn_megatron_args,
                                                          unwrap_text_config)
from megatron_patches.models.model_configs_args import mismatches_with_args
from megatron_patches.models.model_configs_cli import main
from megatron_patches.models.model_configs_nemotron import (NEMOTRON_ARCH, NEMOTRON_FAMILY,
                                                            NEMOTRON_MODEL_FIELDS,
                                                            nemotron_hf_config,
                                                            nemotron_megatron_args,
                                                            nemotron_problems,
                                                            nemotron_spec_fields,
                                                            nemotron_tiny_fields)

__all__ = ["ModelSpec", "PAPER_MODELS", "HYBRID_MODELS", "NEMOTRON_MODELS", "MODELS",
           "get_model_spec", "from_hf_config", "check_trainable", "mismatches_with_args"]

_MOE_FAMILIES = ("qwen3_moe", *HYBRID_MOE_FAMILIES)
_DENSE_ALLOWED = ("qwen3_next",)  # HF Qwen3-Next with num_experts=0 has dense MLPs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only Llama 3 / Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 / Nemotron-H shape, in
    Hugging Face terms."""

    name: str
    """Registry name (e.g. "qwen3-8b")."""
    family: str
    """The HF model_type: "llama" (LlamaForCausalLM), "qwen3" (Qwen3ForCausalLM), "qwen3_moe",
    a GDN hybrid: "qwen3_next", "qwen3_5_text" (Qwen3_5ForCausalLM), "qwen3_5_moe_text", or
    "nemotron_h" (NemotronHForCausalLM: a Megatron HybridModel, model_configs_nemotron.py)."""
    num_layers: int
    """num_hidden_layers."""
    hidden_size: int
    """hidden_size."""
    ffn_hidden_size: int
    """intermediate_size (each of SwiGLU's gate and up projections)."""
    num_attention_heads: int
    """num_attention_heads (query heads)."""
    num_query_groups: int
    """num_key_value_heads (GQA groups)."""
    head_dim: int
    """head_dim (Qwen3: 128 whatever hidden/heads is)."""
    vocab_size: int
    """vocab_size."""
    max_position_embeddings: int
    """max_position_embeddings."""
    rope_theta: Optional[float]
    """rope_theta (None: attention without positional embedding, Nemotron-H)."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1 "llama3" RoPE scaling factor (low/high freq factor 1/4, original context 8192:
    the values Megatron's `--use-rope-scaling` fixes); None: no scaling."""
    rms_norm_eps: float
    """rms_norm_eps."""
    tie_word_embeddings: bool
    """tie_word_embeddings."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    num_experts: Optional[int] = None
    """MoE: num_experts (None: dense)."""
    moe_ffn_hidden_size: Optional[int] = None
    """MoE: moe_intermediate_size."""
    moe_router_topk: Optional[int] = None
    """MoE: num_experts_per_tok."""
    moe_norm_topk_prob: bool = True
    """MoE: norm_topk_prob (top-k probabilities renormalised: Megatron's softmax over the top-k
    logits; False: softmax over all experts, then top-k: `--moe-router-pre-softmax`)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """MoE: shared_expert_intermediate_size of the one sigmoid-gated shared expert (Qwen3-Next,
    Qwen3.5-MoE); None: none."""
    linear_attention_freq: Optional[int] = None
    """GDN hybrids: every linear_attention_freq-th layer softmax attention, the others Gated
    DeltaNet (HF full_attention_interval; Megatron --linear-attention-freq); None: no GDN."""
    linear_num_key_heads: Optional[int] = None
    """GDN: linear_num_key_heads (q/k heads)."""
    linear_num_value_heads: Optional[int] = None
    """GDN: linear_num_value_heads (v heads, a multiple of the key heads)."""
    linear_key_head_dim: Optional[int] = None
    """GDN: linear_key_head_dim."""
    linear_value_head_dim: Optional[int] = None
    """GDN: linear_value_head_dim."""
    linear_conv_kernel_dim: Optional[int] = None
    """GDN: linear_conv_kernel_dim (the short causal conv's width)."""
    attention_output_gate: bool = False
    """Softmax attention's sigmoid output gate (HF q_proj rows [query; gate] per head)."""
    rotary_percent: float = 1.0
    """Fraction of the head RoPE rotates (HF partial_rotary_factor)."""
    hybrid_layer_pattern: Optional[str] = None
    """Nemotron-H: one symbol per layer, `M` Mamba-2, `*` attention, `-` MLP (Megatron
    --hybrid-layer-pattern, HF hybrid_override_pattern); None: a GPTModel."""
    mamba_num_heads: Optional[int] = None
    """Nemotron-H: mamba_num_heads (inner width = heads x mamba_head_dim)."""
    mamba_head_dim: Optional[int] = None
    """Nemotron-H: mamba_head_dim."""
    mamba_state_dim: Optional[int] = None
    """Nemotron-H: ssm_state_size (Megatron --mamba-state-dim)."""
    mamba_num_groups: Optional[int] = None
    """Nemotron-H: n_groups, the B/C groups (Megatron --mamba-num-groups)."""

    def __post_init__(self):
        if self.family not in _ARCH:
            raise ValueError(f"family={self.family!r}; choose one of {sorted(_ARCH)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"{self.name}: num_attention_heads must be a multiple of "
                             "num_query_groups")
        if (self.family in _MOE_FAMILIES) != (self.num_experts is not None) and not (
                self.family in _DENSE_ALLOWED and self.num_experts is None):
            raise ValueError(f"{self.name}: {self.family} and num_experts go together "
                             f"(MoE families: {_MOE_FAMILIES})")
        gdn_set = {getattr(self, f) is not None for f in _GDN_FIELDS}
        if gdn_set != {self.family in GDN_FAMILIES}:
            raise ValueError(f"{self.name}: the GDN fields {_GDN_FIELDS} are set exactly for "
                             f"the GDN families {GDN_FAMILIES}")
        if not self.is_gdn and (self.attention_output_gate or self.rotary_percent != 1.0):
            raise ValueError(f"{self.name}: attention_output_gate / rotary_percent belong to the "
                             f"GDN families {GDN_FAMILIES}")
        if self.moe_shared_expert_intermediate_size and not self.is_moe:
            raise ValueError(f"{self.name}: a shared expert needs num_experts")
        if self.is_gdn and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"{self.name}: linear_num_value_heads must be a multiple of "
                             "linear_num_key_heads")
        problems = nemotron_problems(self)
        if problems:
            raise ValueError(f"{self.name}: " + "; ".join(problems))

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def is_gdn(self) -> bool:
        """A Gated DeltaNet hybrid (HF norms (1 + w), gated attention, GDN layers)."""
        return self.linear_attention_freq is not None

    @property
    def is_nemotron_h(self) -> bool:
        """A Nemotron-H HybridModel (Mamba-2, attention without positions, relu^2 MLPs)."""
        return self.hybrid_layer_pattern is not None

    def megatron_args(self) -> List[str]:
        """Megatron-LM command-line arguments building this model (vocabulary unpadded:
        `--make-vocab-size-divisible-by 1`, so logits cover exactly the HF vocabulary)."""
        if self.is_nemotron_h:
            return nemotron_megatron_args(self)
        args = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
                "--ffn-hidden-size", self.ffn_hidden_size,
                "--num-attention-heads", self.num_attention_heads,
                "--group-query-attention", "--num-query-groups", self.num_query_groups,
                "--kv-channels", self.head_dim,
                "--max-position-embeddings", self.max_position_embeddings,
                "--position-embedding-type", "rope", "--rotary-base", _num(self.rope_theta),
                "--normalization", "RMSNorm", "--norm-epsilon", _num(self.rms_norm_eps),
                "--swiglu", "--disable-bias-linear",
                "--attention-dropout", "0", "--hidden-dropout", "0",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", self.vocab_size,
                "--make-vocab-size-divisible-by", "1"]
        if self.rope_scaling_factor is not None:
            args += ["--use-rope-scaling", "--rope-scaling-factor", _num(self.rope_scaling_factor)]
        if not self.tie_word_embeddings:
            args.append("--untie-embeddings-and-output-weights")
        if self.qk_norm:
            args.append("--qk-layernorm")
        if self.is_moe:
            args += ["--num-experts", self.num_experts, "--moe-ffn-hidden-size",
                     self.moe_ffn_hidden_size, "--moe-router-topk", self.moe_router_topk,
                     # softmax over the top-k logits == Qwen3-MoE's norm_topk_prob=True
                     "--moe-router-score-function", "softmax",
                     *([] if self.moe_norm_topk_prob else ["--moe-router-pre-softmax"]),
                     "--moe-router-load-balancing-type", "aux_loss",
                     "--moe-aux-loss-coeff", "0.001"]
        if self.is_gdn:
            args += gdn_megatron_args(self)
        return [str(a) for a in args]

    def hf_config(self) -> Dict[str, object]:
        """The config.json fields of the matching Hugging Face model."""
        if self.is_nemotron_h:
            return nemotron_hf_config(self)
        config = {"architectures": [_ARCH[self.family]], "model_type": self.family,
                  "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
                  "intermediate_size": self.ffn_hidden_size,
                  "num_attention_heads": self.num_attention_heads,
                  "num_key_value_heads": self.num_query_groups, "head_dim": self.head_dim,
                  "vocab_size": self.vocab_size,
                  "max_position_embeddings": self.max_position_embeddings,
                  "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
                  "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
                  "attention_bias": False, "attention_dropout": 0.0,
                  "rope_scaling": None if self.rope_scaling_factor is None else {
                      "rope_type": "llama3", "factor": self.rope_scaling_factor,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}}
        if self.family == "llama":
            config["mlp_bias"] = False
        if self.is_moe:
            config.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                          moe_intermediate_size=self.moe_ffn_hidden_size,
                          norm_topk_prob=self.moe_norm_topk_prob,
                          decoder_sparse_step=1, mlp_only_layers=[])
        if self.is_gdn:
            config.update(gdn_hf_config(self))
        return config

    def tiny(self) -> "ModelSpec":
        """The scaled-down twin: same architecture at tiny sizes (CPU-runnable): the GQA ratio,
        head_dim = hidden / heads (Llama) or an explicit head_dim != hidden / heads (Qwen3),
        qk-norm, RoPE theta and scaling, norm epsilon, embedding tying, MoE top-k routing."""
        if self.is_nemotron_h:
            return dataclasses.replace(self, name=f"{self.name}-tiny", **nemotron_tiny_fields(self))
        ratio = self.num_attention_heads // self.num_query_groups
        heads = 2 * ratio
        gdn = {} if not self.is_gdn else dict(
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_value_heads=2 * self.linear_num_value_heads // self.linear_num_key_heads)
        shared = 32 if self.moe_shared_expert_intermediate_size else None
        return dataclasses.replace(
            self, name=f"{self.name}-tiny", num_layers=4, hidden_size=64, ffn_hidden_size=160,
            num_attention_heads=heads, num_query_groups=2,
            head_dim=64 // heads if self.family == "llama" else 16, vocab_size=512,
            num_experts=8 if self.is_moe else None,
            moe_ffn_hidden_size=32 if self.is_moe else None,
            moe_router_topk=2 if self.is_moe else None,
            moe_shared_expert_intermediate_size=shared, **gdn)


_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", **HYBRID_ARCH, **NEMOTRON_ARCH}
_GDN_FIELDS = ("linear_attention_freq", "linear_num_key_heads", "linear_num_value_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")


def _num(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() and abs(value) >= 1 else repr(value)


PAPER_MODELS: Dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec(name="llama3-8b", family="llama", num_layers=32, hidden_size=4096,
              ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, head_dim=128,
              vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
              rms_norm_eps=1e-5, tie_word_embeddings=False),
    ModelSpec(name="llama3.1-8b", family="llama", num_layers=32, hidden_size=4096,
              ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, head_dim=128,
              vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
              rope_scaling_factor=8.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    ModelSpec(name="qwen3-8b", family="qwen3", num_layers=36, hidden_size=4096,
              ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8, head_dim=128,
              vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True),
    ModelSpec(name="qwen3-30b-a3b", family="qwen3_moe", num_layers=48, hidden_size=2048,
              ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4, head_dim=128,
              vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True, num_experts=128,
              moe_ffn_hidden_size=768, moe_router_topk=8),
)}
"""The paper's models (Llama3-8B; its 3.1 revision with RoPE scaling; Qwen3-8B; Qwen3-30B-A3B)."""

HYBRID_MODELS: Dict[str, ModelSpec] = {
    name: ModelSpec(name=name, **fields) for name, fields in HYBRID_MODEL_FIELDS.items()}
"""The GDN hybrids (Qwen3-Next-80B-A3B, Qwen3.5-27B, Qwen3.5-35B-A3B: model_configs_hybrid.py)."""

NEMOTRON_MODELS: Dict[str, ModelSpec] = {
    name: ModelSpec(name=name, **fields) for name, fields in NEMOTRON_MODEL_FIELDS.items()}
"""Nemotron-H (Mamba-2 / attention / MLP HybridModels: model_configs_nemotron.py)."""

MODELS: Dict[str, ModelSpec] = {
    name: spec for group in (PAPER_MODELS, HYBRID_MODELS, NEMOTRON_MODELS)
    for name, spec in [*group.items(), *((f"{n}-tiny", s.tiny()) for n, s in group.items())]}
"""Every registered model: the paper's, the GDN hybrids, Nemotron-H and their tiny twins."""


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name]


def check_trainable(spec: ModelSpec) -> None:
    """Refuse, with the reason, a model prefix reuse cannot train yet (before any compute).

    Every paper model trains: Qwen3-30B-A3B (MoE) with logical prefix-token accounting
    (megatron_patches/runtime/moe.py), within the MoE limits the reuse executor checks
    (moe.check_moe_supported, config_support_moe.py: dropless, token-local routing, TP=1).
    The GDN hybrids train too (tests/test_megatron_lm_gdn.py: Qwen3.5 dense, Qwen3-Next MoE
    with its gated shared expert), and Nemotron-H (tests/test_megatron_lm_nemotron.py)."""
    if spec.family not in _ARCH:
        raise ValueError(f"{spec.name}: family {spec.family!r} is not supported")


def from_hf_config(config: Dict[str, object], name: str = "hf") -> ModelSpec:
    """A ModelSpec from a Llama 3 / Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 (text) / Nemotron-H
    config.json (dict; a Qwen3.5 VLM's: its text_config); ValueError otherwise."""
    config = unwrap_text_config(config)
    family = config.get("model_type")
    if family not in _ARCH:
        raise ValueError(f"model_type {family!r} is not supported; supported: {sorted(_ARCH)}")
    if family == NEMOTRON_FAMILY:
        return ModelSpec(name=name, **nemotron_spec_fields(config))
    rope = _rope_parameters(config)
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                             else None)
    moe = family in _MOE_FAMILIES and (family not in _DENSE_ALLOWED
                                       or bool(config.get("num_experts")))
    gdn = gdn_fields_from_hf(config, moe) if family in GDN_FAMILIES else {}
    if scaling is not None:
        _check_llama3_scaling(scaling)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("attention_bias / mlp_bias checkpoints are not supported (Llama 3 and "
                         "Qwen3 have none)")
    heads = int(config["num_attention_heads"])
    if moe:
        _check_qwen3_moe(config)
    return ModelSpec(
        name=name, family=family, num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]), ffn_hidden_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config["max_position_embeddings"]),
        rope_theta=float(config.get("rope_theta") or rope["rope_theta"]),
        rope_scaling_factor=None if scaling is None else float(scaling["factor"]),
        rms_norm_eps=float(config["rms_norm_eps"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=family != "llama",
        # transformers >= 5 writes num_local_experts
        num_experts=(config.get("num_experts") or config.get("num_local_experts")
                     if moe else None),
        moe_ffn_hidden_size=config.get("moe_intermediate_size") if moe else None,
        moe_router_topk=config.get("num_experts_per_tok") if moe else None,
        # HF's default: False for Qwen3-MoE, True for Qwen3-Next / Qwen3.5-MoE (which has none)
        moe_norm_topk_prob=(bool(config.get("norm_topk_prob", family != "qwen3_moe"))
                            if moe else True), **gdn)


def _check_qwen3_moe(config) -> None:
    """Qwen3-MoE layouts Megatron's arguments cannot build: refused with the reason."""
    step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={dense}: only checkpoints "
                         "whose every layer is MoE are converted (Qwen3-30B-A3B's are); HF's "
                         "(i+1) % step rule differs from Megatron's --moe-layer-freq")
    if config.get("shared_expert_intermediate_size") and config["model_type"] == "qwen3_moe":
        raise ValueError("shared experts are not part of Qwen3-MoE (Qwen2-MoE has them)")


def _rope_parameters(config) -> Dict[str, object]:
    """transformers >= 5 writes RoPE settings as `rope_parameters` (theta and scaling)."""
    return dict(config.get("rope_parameters") or {})


def _check_llama3_scaling(scaling: Dict[str, object]) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in fixed.items()):
        raise ValueError(f"rope_scaling {scaling} is not supported: Megatron's --use-rope-scaling "
                         f"is Llama 3.1's llama3 scaling with {fixed}")


if __name__ == "__main__":
    raise SystemExit(main(MODELS, __doc__.splitlines()[0]))
