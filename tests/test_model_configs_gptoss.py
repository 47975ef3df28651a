"""gpt-oss configs (megatron_patches/models/model_configs_gptoss.py): Megatron-LM's own parser
(core_r0.19.0 checkout, as tests/test_model_configs.py) turns each model's arguments into a
TransformerConfig whose attention (sinks, window per layer), MoE and activation fields equal
those of transformers' GptOssConfig built from the config.json fields."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_patches.models.model_configs_gptoss import GPTOSS_MODELS
from megatron_trees import REPO, stock_tree

transformers = pytest.importorskip("transformers")

_PARSE = textwrap.dedent("""
    import json, sys
    from megatron_patches.megatron_lm.compat import enable_python311_support, enable_megatron_lm_cpu_support
    enable_python311_support(); enable_megatron_lm_cpu_support()
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.core.transformer.utils import is_layer_window_attention
    from megatron_patches.megatron_lm.main import _cpu_arguments
    out = {}
    for name, argv in json.loads(sys.argv[1]).items():
        sys.argv = ["train"] + argv + ["--micro-batch-size", "1", "--seq-length", "64"]
        args = parse_args()
        _cpu_arguments(args)
        validate_args(args)
        c = core_transformer_config_from_args(args)
        out[name] = dict(num_layers=c.num_layers, hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_query_groups,
            kv_channels=c.kv_channels, layernorm_epsilon=c.layernorm_epsilon,
            normalization=c.normalization, gated_linear_unit=c.gated_linear_unit,
            activation=c.activation_func.__name__, glu_linear_offset=c.glu_linear_offset,
            clamp=c.activation_func_clamp_value, add_qkv_bias=c.add_qkv_bias,
            softmax_type=c.softmax_type, window_size=list(c.window_size),
            windowed=[is_layer_window_attention(c.window_size, c.window_attn_skip_freq, l)
                      for l in range(1, c.num_layers + 1)],
            num_moe_experts=c.num_moe_experts, moe_router_topk=c.moe_router_topk,
            moe_ffn_hidden_size=c.moe_ffn_hidden_size,
            score=c.moe_router_score_function, pre_softmax=c.moe_router_pre_softmax,
            rotary_base=args.rotary_base, position_embedding_type=args.position_embedding_type,
            yarn=[c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings,
                  c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_correction_range_round_to_int],
            vocab_size=args.vocab_size, untie=args.untie_embeddings_and_output_weights,
            max_position_embeddings=args.max_position_embeddings)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_megatron_args_match_transformers_gpt_oss_configs(tmp_path_factory):
    tree = stock_tree("0.19.1", tmp_path_factory)
    argv = {name: spec.megatron_args() for name, spec in GPTOSS_MODELS.items()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE, json.dumps(argv)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    megatron = json.loads(run.stdout.strip().splitlines()[-1])
    for name, spec in GPTOSS_MODELS.items():
        fields = {k: v for k, v in spec.hf_config().items() if k != "model_type"}
        hf = transformers.GptOssConfig(**fields)
        rope = hf.rope_parameters
        expected = dict(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
            kv_channels=hf.head_dim, layernorm_epsilon=hf.rms_norm_eps, normalization="RMSNorm",
            gated_linear_unit=True, activation="quick_gelu", glu_linear_offset=1.0,
            clamp=hf.swiglu_limit, add_qkv_bias=hf.attention_bias, softmax_type="learnable",
            window_size=[hf.sliding_window - 1, 0],
            windowed=[t == "sliding_attention" for t in hf.layer_types],
            num_moe_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.intermediate_size, score="softmax", pre_softmax=False,
            rotary_base=rope["rope_theta"], position_embedding_type="yarn",
            yarn=[rope["factor"], rope["original_max_position_embeddings"], rope["beta_fast"],
                  rope["beta_slow"], rope["truncate"]],  # HF truncate = round to int
            vocab_size=hf.vocab_size, untie=not hf.tie_word_embeddings,
            max_position_embeddings=hf.max_position_embeddings)
        m = megatron[name]
        assert m == expected, (name, {k: (m[k], v) for k, v in expected.items() if m[k] != v})
        assert hf.swiglu_alpha == 1.702  # quick_gelu's constant


def test_tiny_twin_keeps_the_layout():
    big, tiny = GPTOSS_MODELS["gpt-oss-20b"], GPTOSS_MODELS["gpt-oss-20b-tiny"]
    assert tiny.hf_config()["layer_types"][:2] == big.hf_config()["layer_types"][:2]
    assert (tiny.num_attention_heads // tiny.num_query_groups
            == big.num_attention_heads // big.num_query_groups)
    assert tiny.head_dim * tiny.num_attention_heads != tiny.hidden_size  # as gpt-oss: 64x64 != 2880
    with pytest.raises(ValueError, match="even"):
        type(big)(**{**big.__dict__, "num_layers": 3})
