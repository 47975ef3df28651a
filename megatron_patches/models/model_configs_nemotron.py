"""Nemotron-H in `model_configs`: NVIDIA's Mamba-2 / attention / MLP hybrid as a Megatron
HybridModel (`--hybrid-layer-pattern`, one symbol per layer: `M` Mamba-2, `*` attention, `-` MLP).

Its values, Megatron-LM arguments, config.json fields and config.json reading; the ModelSpec and
the registry are model_configs.py's (which re-exports these). The architecture, read from
transformers 5.23 `models/nemotron_h` (configuration_nemotron_h.py, modeling_nemotron_h.py) and
Megatron-LM core_r0.19.0 `examples/rl/model_configs/nemotron5_8b.sh` (Nemotron-H 8B):

* attention without positional embedding (HF `NemotronHAttention` applies no RoPE; Megatron
  `--position-embedding-type none`), no q/k norm, GQA;
* MLP layers `up_proj` -> relu^2 -> `down_proj` (HF `mlp_hidden_act="relu2"`; Megatron
  `--squared-relu`, no `--swiglu`);
* Mamba-2 layers: `mamba_num_heads` x `mamba_head_dim` inner width, `n_groups` B/C groups of
  `ssm_state_size`, a 4-wide causal conv with bias, no projection biases, the grouped gated RMS
  norm (Megatron's `MambaMixer`: d_conv=4, conv bias, no bias, norm eps 1e-5 are fixed there, so
  config.json values other than those are refused);
* plain-w RMSNorms (no 1 + w), untied embeddings.
"""

from __future__ import annotations

from typing import Dict, List

__all__ = ["NEMOTRON_FAMILY", "NEMOTRON_ARCH", "NEMOTRON_MODEL_FIELDS", "NEMOTRON_FIELDS",
           "nemotron_problems", "nemotron_megatron_args", "nemotron_hf_config",
           "nemotron_spec_fields", "nemotron_mismatches", "nemotron_tiny_fields"]

NEMOTRON_FAMILY = "nemotron_h"
NEMOTRON_ARCH = {NEMOTRON_FAMILY: "NemotronHForCausalLM"}
NEMOTRON_FIELDS = ("hybrid_layer_pattern", "mamba_num_heads", "mamba_head_dim",
                   "mamba_state_dim", "mamba_num_groups")
"""The ModelSpec fields set exactly for Nemotron-H."""

_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp"}
_HF_LAYER_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*",
                   "full_attention": "*", "mlp": "-", "moe": "E"}
"""config.json layer names (transformers 5 and the published configs' older ones) -> symbol."""
_MAMBA_NORM_EPS = 1e-5  # megatron/core/ssm/mamba_mixer.py builds its gated norm with eps=1e-5

NEMOTRON_MODEL_FIELDS: Dict[str, dict] = {
    # nvidia/Nemotron-H-8B-Base-8K: transformers' NemotronHConfig defaults (hidden 4096, MLP
    # 21504, 32 / 8 heads of 128, Mamba 128 heads of 64, 8 groups, state 128, vocab 131072) and
    # Megatron-LM's nemotron5_8b.sh (this pattern, --max-position-embeddings 8192, eps 1e-5).
    "nemotron-h-8b": dict(
        family=NEMOTRON_FAMILY, num_layers=52, hidden_size=4096, ffn_hidden_size=21504,
        num_attention_heads=32, num_query_groups=8, head_dim=128, vocab_size=131072,
        max_position_embeddings=8192, rope_theta=None, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        hybrid_layer_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_num_heads=128, mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8),
}
"""ModelSpec keyword arguments of the Nemotron-H models (model_configs builds the specs)."""


def nemotron_problems(spec) -> List[str]:
    """Why `spec` is not a valid ModelSpec as far as the Nemotron-H fields go (empty: it is)."""
    nemotron = spec.family == NEMOTRON_FAMILY
    if {getattr(spec, f) is not None for f in NEMOTRON_FIELDS} != {nemotron}:
        return [f"the Nemotron-H fields {NEMOTRON_FIELDS} are set exactly for {NEMOTRON_FAMILY}"]
    if (spec.rope_theta is None) != nemotron:
        return ["rope_theta is None exactly for Nemotron-H (attention without positions)"]
    if not nemotron:
        return []
    pattern = spec.hybrid_layer_pattern
    problems = []
    if set(pattern) - set(_SYMBOLS) or len(pattern) != spec.num_layers:
        problems.append(f"hybrid_layer_pattern {pattern!r} must have num_layers={spec.num_layers} "
                        f"symbols of {sorted(_SYMBOLS)}")
    if spec.mamba_num_heads % spec.mamba_num_groups:
        problems.append("mamba_num_heads must be a multiple of mamba_num_groups")
    if spec.qk_norm or spec.is_moe or spec.rope_scaling_factor is not None:
        problems.append("Nemotron-H has no q/k norm, MoE layers or RoPE scaling here")
    return problems


def _num(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() and abs(value) >= 1 else repr(value)


def nemotron_megatron_args(spec) -> List[str]:
    """Megatron-LM arguments building `spec` as a HybridModel (Megatron derives the layer count
    from the pattern; --num-layers is given equal to it)."""
    args = ["--hybrid-layer-pattern", spec.hybrid_layer_pattern, "--num-layers", spec.num_layers,
            "--hidden-size", spec.hidden_size, "--ffn-hidden-size", spec.ffn_hidden_size,
            "--num-attention-heads", spec.num_attention_heads,
            "--group-query-attention", "--num-query-groups", spec.num_query_groups,
            "--kv-channels", spec.head_dim,
            "--max-position-embeddings", spec.max_position_embeddings,
            "--position-embedding-type", "none",
            "--normalization", "RMSNorm", "--norm-epsilon", _num(spec.rms_norm_eps),
            "--squared-relu", "--disable-bias-linear",
            "--attention-dropout", "0", "--hidden-dropout", "0",
            "--mamba-num-heads", spec.mamba_num_heads, "--mamba-head-dim", spec.mamba_head_dim,
            "--mamba-state-dim", spec.mamba_state_dim,
            "--mamba-num-groups", spec.mamba_num_groups,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", spec.vocab_size,
            "--make-vocab-size-divisible-by", "1"]
    if not spec.tie_word_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    return [str(a) for a in args]


def nemotron_hf_config(spec) -> Dict[str, object]:
    """The config.json fields of `spec` (the published Nemotron-H 8B names: the pattern as
    `hybrid_override_pattern`, which transformers 5 reads into `layers_block_type`)."""
    return {"architectures": [NEMOTRON_ARCH[spec.family]], "model_type": spec.family,
            "num_hidden_layers": spec.num_layers,
            "hybrid_override_pattern": spec.hybrid_layer_pattern,
            "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_query_groups, "head_dim": spec.head_dim,
            "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_position_embeddings,
            "layer_norm_epsilon": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings,
            "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
            "mamba_num_heads": spec.mamba_num_heads, "mamba_head_dim": spec.mamba_head_dim,
            "ssm_state_size": spec.mamba_state_dim, "n_groups": spec.mamba_num_groups,
            "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False,
            "mamba_proj_bias": False, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "hidden_dropout": 0.0, "num_nextn_predict_layers": 0}


def _pattern(config: Dict[str, object]) -> str:
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if kinds is None:
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            raise ValueError("a nemotron_h config.json needs hybrid_override_pattern or "
                             "layers_block_type")
    else:
        unknown = sorted(set(kinds) - set(_HF_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layers_block_type has unknown kinds {unknown}")
        pattern = "".join(_HF_LAYER_TYPES[k] for k in kinds)
    if set(pattern) - set(_SYMBOLS):
        raise ValueError(f"hybrid pattern {pattern!r}: only Mamba-2 (M), attention (*) and MLP (-) "
                         "layers are converted (Nemotron-H); MoE layers (E, Nemotron-3 Nano) "
                         "are not")
    return pattern


def nemotron_spec_fields(config: Dict[str, object]) -> Dict[str, object]:
    """The ModelSpec fields of a Nemotron-H config.json; ValueError for what Megatron's layers
    cannot build."""
    fixed = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "conv_kernel": 4,
             "use_conv_bias": True, "use_bias": False, "mamba_proj_bias": False,
             "attention_bias": False, "mlp_bias": False}
    wrong = {k: config[k] for k, v in fixed.items() if k in config and config[k] != v}
    if wrong:
        raise ValueError(f"{wrong}: Megatron's HybridModel layers build only {fixed} "
                         "(megatron/core/ssm/mamba_mixer.py: d_conv=4, conv bias, no bias)")
    eps = float(config.get("layer_norm_epsilon", config.get("norm_eps", 1e-5)))
    pattern = _pattern(config)
    if "M" in pattern and eps != _MAMBA_NORM_EPS:
        raise ValueError(f"layer_norm_epsilon={eps}: Megatron's Mamba mixer norms with eps "
                         f"{_MAMBA_NORM_EPS} whatever --norm-epsilon says")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("mamba_head_dim", 64))
    mamba_heads = config.get("mamba_num_heads") or hidden * int(config.get("expand", 2)) // head_dim
    return dict(family=NEMOTRON_FAMILY, num_layers=len(pattern), hidden_size=hidden,
                ffn_hidden_size=int(config["intermediate_size"]), num_attention_heads=heads,
                num_query_groups=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or config.get("attention_head_dim")
                             or hidden // heads),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                rope_theta=None, rms_norm_eps=eps,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                hybrid_layer_pattern=pattern, mamba_num_heads=int(mamba_heads),
                mamba_head_dim=head_dim, mamba_state_dim=int(config.get("ssm_state_size", 128)),
                mamba_num_groups=int(config.get("n_groups", 8)))


def nemotron_mismatches(spec, args) -> List[str]:
    """Where Megatron's parsed arguments build other layers than Nemotron-H `spec` (or a
    HybridModel where `spec` is a GPTModel)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if spec.family != NEMOTRON_FAMILY:
        return [] if pattern is None else [
            f"--hybrid-layer-pattern {pattern} but the checkpoint is a {spec.family} GPTModel"]
    want = {"--hybrid-layer-pattern": (pattern, spec.hybrid_layer_pattern),
            "--squared-relu": (getattr(args, "squared_relu", False), True),
            "--position-embedding-type": (args.position_embedding_type, "none"),
            "--mamba-num-heads": (getattr(args, "mamba_num_heads", None), spec.mamba_num_heads),
            "--mamba-head-dim": (getattr(args, "mamba_head_dim", None), spec.mamba_head_dim),
            "--mamba-state-dim": (getattr(args, "mamba_state_dim", None), spec.mamba_state_dim),
            "--mamba-num-groups": (getattr(args, "mamba_num_groups", None),
                                   spec.mamba_num_groups)}
    problems = [f"{flag} {got!r} but the checkpoint needs {need!r}"
                for flag, (got, need) in want.items() if got != need]
    if pattern is not None and "|" in pattern:
        problems.append("stage marks '|' in --hybrid-layer-pattern: the converter splits the "
                        "layers evenly over PP (give the pattern without them)")
    return problems


def nemotron_tiny_fields(spec) -> Dict[str, object]:
    """The tiny twin's sizes: pattern M-M*M- (Mamba, MLP, attention after Mamba, MLP last; two
    even PP stages "M-M" | "*M-"), inner width 2 x hidden as in the published models (expand 2),
    2 B/C groups, the GQA ratio and head_dim = hidden / heads (8B: 4096 / 32 = 128) kept."""
    ratio = spec.num_attention_heads // spec.num_query_groups
    heads = 2 * ratio
    return dict(num_layers=6, hybrid_layer_pattern="M-M*M-", hidden_size=64, ffn_hidden_size=160,
                num_attention_heads=heads, num_query_groups=2, head_dim=64 // heads,
                vocab_size=512,
                mamba_num_heads=8, mamba_head_dim=16, mamba_state_dim=16, mamba_num_groups=2)
