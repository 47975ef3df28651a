"""The paper's models (megatron_patches/models/model_configs.py) and tools/layouts.py.

* Megatron-LM's own argument parser (core_r0.19.0 checkout) turns each GPTModel's arguments into
  a TransformerConfig whose fields equal, one by one, those of a `transformers` config object
  built from the same Hugging Face numbers (Nemotron-H's HybridModel fields:
  tests/test_model_configs_nemotron.py); HF config -> ModelSpec -> HF config is the identity.
* The tiny twins keep the architecture (the MoE twin trains: tests/test_moe.py).
* The layout tool's parameter counts are the published ones and its suggestions fit.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_patches.models.model_configs import (MODELS, PAPER_MODELS, check_trainable,
                                            from_hf_config)
from megatron_trees import REPO, stock_tree

transformers = pytest.importorskip("transformers")

GPT_MODELS = {n: s for n, s in MODELS.items() if not s.is_nemotron_h}

_PARSE = textwrap.dedent("""
    import json, sys
    from megatron_patches.megatron_lm.compat import enable_python311_support, enable_megatron_lm_cpu_support
    enable_python311_support(); enable_megatron_lm_cpu_support()
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron_patches.megatron_lm.main import _cpu_arguments
    out = {}
    for name, argv in json.loads(sys.argv[1]).items():
        sys.argv = ["train"] + argv + ["--micro-batch-size", "1", "--seq-length", "64"]
        args = parse_args()
        _cpu_arguments(args)  # what the entry point does without CUDA (local spec, no fusions)
        validate_args(args)
        c = core_transformer_config_from_args(args)
        out[name] = dict(num_layers=c.num_layers, hidden_size=c.hidden_size,
            ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups, kv_channels=c.kv_channels,
            layernorm_epsilon=c.layernorm_epsilon, normalization=c.normalization,
            qk_layernorm=c.qk_layernorm, gated_linear_unit=c.gated_linear_unit,
            activation=c.activation_func.__name__, add_bias_linear=c.add_bias_linear,
            add_qkv_bias=c.add_qkv_bias, num_moe_experts=c.num_moe_experts,
            moe_router_topk=c.moe_router_topk, moe_ffn_hidden_size=c.moe_ffn_hidden_size,
            rotary_base=args.rotary_base, use_rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor, vocab_size=args.vocab_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            untie=args.untie_embeddings_and_output_weights,
            max_position_embeddings=args.max_position_embeddings,
            position_embedding_type=args.position_embedding_type,
            dropout=(c.hidden_dropout, c.attention_dropout))
    print(json.dumps(out))
""")


def _hf_config(spec):
    return transformers.AutoConfig.for_model(
        spec.family, **{k: v for k, v in spec.hf_config().items() if k != "model_type"})


def test_megatron_configs_match_transformers_configs_field_by_field(tmp_path_factory):
    tree = stock_tree("0.19.1", tmp_path_factory)
    argv = {name: spec.megatron_args() for name, spec in GPT_MODELS.items()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE, json.dumps(argv)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    megatron = json.loads(run.stdout.strip().splitlines()[-1])
    for name, spec in GPT_MODELS.items():
        m, hf = megatron[name], _hf_config(spec)
        rope = hf.rope_parameters
        expected = dict(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
            layernorm_epsilon=hf.rms_norm_eps, normalization="RMSNorm",
            qk_layernorm=spec.family != "llama", gated_linear_unit=hf.hidden_act == "silu",
            activation="silu", add_bias_linear=hf.attention_bias, add_qkv_bias=hf.attention_bias,
            num_moe_experts=getattr(hf, "num_experts", None),
            moe_router_topk=getattr(hf, "num_experts_per_tok", 2),
            moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None),
            rotary_base=rope["rope_theta"], use_rope_scaling=rope["rope_type"] == "llama3",
            rope_scaling_factor=rope.get("factor", 8.0), vocab_size=hf.vocab_size,
            make_vocab_size_divisible_by=1, untie=not hf.tie_word_embeddings,
            max_position_embeddings=hf.max_position_embeddings, position_embedding_type="rope",
            dropout=[hf.attention_dropout, hf.attention_dropout])
        if not spec.is_moe:
            expected["moe_ffn_hidden_size"] = m["moe_ffn_hidden_size"]  # Megatron's derived default
        assert m == expected, (name, {k: (m[k], v) for k, v in expected.items() if m[k] != v})
        if rope["rope_type"] == "llama3":  # the three values Megatron's --use-rope-scaling fixes
            assert (rope["low_freq_factor"], rope["high_freq_factor"],
                    rope["original_max_position_embeddings"]) == (1.0, 4.0, 8192)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_config_round_trips(name):
    spec = MODELS[name]
    assert from_hf_config(spec.hf_config(), name=name) == spec
    saved = _hf_config(spec).to_dict()  # transformers 5 writes rope_parameters
    assert from_hf_config(saved, name=name) == spec


@pytest.mark.parametrize("name", list(PAPER_MODELS))
def test_tiny_twins_keep_the_architecture(name):
    big, tiny = PAPER_MODELS[name], MODELS[f"{name}-tiny"]
    same = ("family", "rope_theta", "rope_scaling_factor", "rms_norm_eps", "tie_word_embeddings",
            "qk_norm", "max_position_embeddings")
    assert all(getattr(big, f) == getattr(tiny, f) for f in same)
    assert (big.num_attention_heads // big.num_query_groups
            == tiny.num_attention_heads // tiny.num_query_groups)
    assert (big.head_dim * big.num_attention_heads == big.hidden_size) == (
        tiny.head_dim * tiny.num_attention_heads == tiny.hidden_size) or big.family != "llama"
    assert tiny.hidden_size * tiny.num_layers < 1000 and tiny.is_moe == big.is_moe


def test_every_paper_model_is_trainable_and_bad_configs_are_refused():
    check_trainable(MODELS["qwen3-8b"])
    check_trainable(MODELS["qwen3-30b-a3b"])  # MoE: tests/test_moe.py trains its tiny twin
    with pytest.raises(ValueError, match="rope_scaling .* is not supported"):
        from_hf_config({**MODELS["llama3.1-8b"].hf_config(),
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_layouts_tool_counts_and_fits():
    sys.path.insert(0, str(REPO / "tools"))
    import layouts

    assert round(layouts.total_params(PAPER_MODELS["llama3-8b"]) / 1e9, 2) == 8.03
    assert round(layouts.total_params(PAPER_MODELS["qwen3-8b"]) / 1e9, 2) == 8.19
    assert round(layouts.total_params(PAPER_MODELS["qwen3-30b-a3b"]) / 1e9, 1) == 30.5
    kw = dict(seq_len=12288, prefix_len=10240, microbatches=16)
    for gpus in (8, 16, 64):
        best = layouts.suggest(PAPER_MODELS["qwen3-8b"], gpus, 80.0, **kw)
        assert best and all(lay.total <= 0.85 * 80 and lay.tp * lay.pp * lay.dp == gpus
                            for lay in best)
    one = layouts.estimate(PAPER_MODELS["llama3-8b"], 1, 1, 8, **kw)
    assert abs(one.weights - 8.03e9 * 2 / 2**30) < 0.05  # bf16 weights of the whole model
