"""DeepSeek-V3 and its tiny twin (megatron_patches/models/model_configs_mla.py):

* Megatron-LM's own argument parser (core_r0.19.0 checkout) turns each spec's arguments into an
  MLATransformerConfig whose MLA, yarn, layout and MoE-routing fields equal those of
  transformers' DeepseekV3Config built from the same numbers, and equal the fields the tests'
  models are built with (`megatron_config_fields`).
* The tiny twin keeps the architecture's kinds (dense first layers then MoE, Q/K wider than V,
  q LoRA, grouped sigmoid routing, yarn).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_patches.models.model_configs_mla import MLA_MODELS
from megatron_trees import REPO, stock_tree

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.megatron  # Megatron-LM's parser in a subprocess

_FIELDS = ("num_layers hidden_size ffn_hidden_size num_attention_heads kv_channels "
           "layernorm_epsilon normalization qk_layernorm gated_linear_unit add_bias_linear "
           "multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim "
           "v_head_dim rope_type rotary_base rotary_scaling_factor mscale mscale_all_dim "
           "original_max_position_embeddings beta_fast beta_slow num_moe_experts moe_layer_freq "
           "moe_ffn_hidden_size moe_router_topk moe_shared_expert_intermediate_size "
           "moe_router_score_function moe_router_enable_expert_bias moe_router_num_groups "
           "moe_router_group_topk moe_router_topk_scaling_factor hidden_dropout "
           "attention_dropout").split()

_PARSE = textwrap.dedent("""
    import json, sys
    from megatron_patches.megatron_lm.compat import enable_python311_support, enable_megatron_lm_cpu_support
    enable_python311_support(); enable_megatron_lm_cpu_support()
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron_patches.megatron_lm.main import _cpu_arguments
    fields, argvs = json.loads(sys.argv[1])
    out = {}
    for name, argv in argvs.items():
        sys.argv = ["train"] + argv + ["--micro-batch-size", "1", "--seq-length", "64"]
        args = parse_args()
        _cpu_arguments(args)
        validate_args(args)
        c = core_transformer_config_from_args(args)
        out[name] = {f: getattr(c, f) for f in fields}
        out[name].update(config_class=type(c).__name__, vocab_size=args.vocab_size,
                         untie=args.untie_embeddings_and_output_weights,
                         max_position_embeddings=args.max_position_embeddings)
    print(json.dumps(out, default=str))
""")


def test_megatron_lm_parses_the_deepseek_v3_arguments_into_the_hf_model(tmp_path_factory):
    tree = stock_tree("0.19.1", tmp_path_factory)
    argv = {name: spec.megatron_args() for name, spec in MLA_MODELS.items()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE,
                          json.dumps([_FIELDS, argv])],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    for name, spec in MLA_MODELS.items():
        m = parsed[name]
        fields = {k: v for k, v in spec.hf_config().items() if k != "model_type"}
        hf = transformers.DeepseekV3Config(**fields)
        rope = hf.rope_parameters
        dense = hf.first_k_dense_replace
        expected = dict(
            config_class="MLATransformerConfig", num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads, kv_channels=hf.v_head_dim,
            layernorm_epsilon=hf.rms_norm_eps, normalization="RMSNorm", qk_layernorm=True,
            gated_linear_unit=hf.hidden_act == "silu", add_bias_linear=hf.attention_bias,
            multi_latent_attention=True, q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
            qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
            rope_type=rope["rope_type"], rotary_base=rope["rope_theta"],
            rotary_scaling_factor=rope["factor"], mscale=rope["mscale"],
            mscale_all_dim=rope["mscale_all_dim"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
            beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"],
            num_moe_experts=hf.n_routed_experts,
            moe_layer_freq=[0] * dense + [1] * (hf.num_hidden_layers - dense),
            moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_topk=hf.num_experts_per_tok,
            moe_shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=hf.n_group, moe_router_group_topk=hf.topk_group,
            moe_router_topk_scaling_factor=hf.routed_scaling_factor,
            hidden_dropout=hf.attention_dropout, attention_dropout=hf.attention_dropout,
            vocab_size=hf.vocab_size, untie=not hf.tie_word_embeddings,
            max_position_embeddings=hf.max_position_embeddings)
        assert m == expected, (name, {k: (m[k], v) for k, v in expected.items() if m[k] != v})
        built = spec.megatron_config_fields(moe=True)
        assert {k: m[k] for k in built if k in m} == {k: v for k, v in built.items() if k in m}


def test_tiny_twin_keeps_the_architecture():
    big, tiny = MLA_MODELS["deepseek-v3"], MLA_MODELS["deepseek-v3-tiny"]
    for spec in (big, tiny):
        assert 0 < spec.first_k_dense_replace < spec.num_layers
        assert spec.qk_nope_head_dim + spec.qk_rope_head_dim > spec.v_head_dim
        assert spec.q_lora_rank > spec.kv_lora_rank
        assert spec.num_experts // spec.n_group * spec.topk_group >= spec.moe_router_topk
        assert spec.moe_router_topk // spec.topk_group == 2  # HF scores a group by its top 2
    same = ("yarn_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
            "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "rope_theta",
            "routed_scaling_factor", "n_shared_experts", "rms_norm_eps", "max_position_embeddings")
    assert all(getattr(big, f) == getattr(tiny, f) for f in same)
