"""Nemotron-H in model_configs (model_configs_nemotron.py): nemotron-h-8b and its tiny twin.

* Megatron-LM's own parser (core_r0.19.0 and, -m slow, main checkouts) turns each Nemotron-H's
  arguments into a HybridModel TransformerConfig (`is_hybrid_model`, the layer pattern) whose
  fields equal those of the `transformers` NemotronHConfig built from the same numbers: layers,
  widths, heads, head dim, norm epsilon, squared-ReLU MLP without gate or biases, no q/k norm,
  no positional embedding, the Mamba heads / head dim / state / groups, vocabulary, untied
  embeddings; `mismatches_with_args` finds none and names the flag when one argument differs.
* config.json -> ModelSpec -> config.json is the identity, also through transformers' own
  `to_dict` (layers_block_type) and for the older layer names ("mamba", "attention").
* The tiny twin keeps the architecture; the published numbers are the ones registered.
* Layouts Megatron's layers cannot build are refused with the reason; the entry point refuses a
  Nemotron-H checkpoint with a GPT model's arguments, and a GPT checkpoint with hybrid ones.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_patches.models.model_configs import (MODELS, NEMOTRON_MODELS, check_trainable,
                                                   from_hf_config)
from megatron_trees import REPO, stock_tree

transformers = pytest.importorskip("transformers")

NEMOTRONS = {n: s for n, s in MODELS.items() if s.is_nemotron_h}

_PARSE = textwrap.dedent("""
    import json, sys
    from megatron_patches.megatron_lm.compat import enable_python311_support, enable_megatron_lm_cpu_support
    enable_python311_support(); enable_megatron_lm_cpu_support()
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron_patches.megatron_lm.main import _cpu_arguments
    from megatron_patches.models.model_configs import MODELS, mismatches_with_args
    out = {}
    for name, argv in json.loads(sys.argv[1]).items():
        sys.argv = ["train"] + argv + ["--micro-batch-size", "1", "--seq-length", "64"]
        args = parse_args()
        _cpu_arguments(args)
        validate_args(args)
        c = core_transformer_config_from_args(args)
        out[name] = dict(num_layers=c.num_layers, hidden_size=c.hidden_size,
            ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups, kv_channels=c.kv_channels,
            layernorm_epsilon=c.layernorm_epsilon, normalization=c.normalization,
            qk_layernorm=c.qk_layernorm, gated_linear_unit=c.gated_linear_unit,
            activation=c.activation_func.__name__, add_bias_linear=c.add_bias_linear,
            mamba=[c.mamba_num_heads, c.mamba_head_dim, c.mamba_state_dim, c.mamba_num_groups],
            is_hybrid_model=c.is_hybrid_model, pattern=args.hybrid_layer_pattern,
            position_embedding_type=args.position_embedding_type, vocab_size=args.vocab_size,
            untie=args.untie_embeddings_and_output_weights,
            max_position_embeddings=args.max_position_embeddings,
            dropout=(c.hidden_dropout, c.attention_dropout),
            mismatches=mismatches_with_args(MODELS[name.split("+")[0]], args))
    print(json.dumps(out))
""")


def _hf_config(spec):
    return transformers.AutoConfig.for_model(
        spec.family, **{k: v for k, v in spec.hf_config().items() if k != "model_type"})


def _with(argv, flag, value):
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


@pytest.mark.megatron  # starts a fresh interpreter on a Megatron-LM checkout
@pytest.mark.parametrize("version", ["0.19.1", pytest.param("0.20.0", marks=pytest.mark.slow)])
def test_megatron_fields_match_transformers(version, tmp_path_factory):
    tree = stock_tree(version, tmp_path_factory)
    argv = {name: spec.megatron_args() for name, spec in NEMOTRONS.items()}
    tiny = argv["nemotron-h-8b-tiny"]
    argv["nemotron-h-8b-tiny+heads"] = _with(tiny, "--mamba-num-heads", "4")
    argv["nemotron-h-8b-tiny+pattern"] = _with(_with(tiny, "--hybrid-layer-pattern", "M-*MM-"),
                                               "--num-layers", "6")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE, json.dumps(argv)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    megatron = json.loads(run.stdout.strip().splitlines()[-1])
    for name, spec in NEMOTRONS.items():
        m, hf = megatron[name], _hf_config(spec)
        expected = dict(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            ffn_hidden_size=hf.intermediate_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
            layernorm_epsilon=hf.layer_norm_epsilon, normalization="RMSNorm", qk_layernorm=False,
            gated_linear_unit=False, activation={"relu2": "squared_relu"}[hf.mlp_hidden_act],
            add_bias_linear=hf.use_bias or hf.mlp_bias or hf.attention_bias,
            mamba=[hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size, hf.n_groups],
            is_hybrid_model=True, pattern=hf.hybrid_override_pattern,
            position_embedding_type="none", vocab_size=hf.vocab_size,
            untie=not hf.tie_word_embeddings, max_position_embeddings=hf.max_position_embeddings,
            dropout=[hf.hidden_dropout, hf.attention_dropout], mismatches=[])
        assert m == expected, (name, {k: (m[k], v) for k, v in expected.items() if m[k] != v})
    assert any("--mamba-num-heads 4" in p
               for p in megatron["nemotron-h-8b-tiny+heads"]["mismatches"])
    assert any("--hybrid-layer-pattern 'M-*MM-'" in p
               for p in megatron["nemotron-h-8b-tiny+pattern"]["mismatches"])


@pytest.mark.parametrize("name", list(NEMOTRONS))
def test_hf_config_round_trips(name):
    spec = MODELS[name]
    assert from_hf_config(spec.hf_config(), name=name) == spec
    saved = _hf_config(spec).to_dict()  # transformers 5 writes layers_block_type
    assert "layers_block_type" in saved and "hybrid_override_pattern" not in saved
    assert from_hf_config(saved, name=name) == spec
    legacy = {"M": "mamba", "*": "attention", "-": "mlp"}  # the published configs' older names
    older = {**saved, "layers_block_type": [legacy[c] for c in spec.hybrid_layer_pattern]}
    assert from_hf_config(older, name=name) == spec


def test_published_numbers_and_tiny_twin():
    big, tiny = NEMOTRON_MODELS["nemotron-h-8b"], MODELS["nemotron-h-8b-tiny"]
    assert (big.num_layers, big.hidden_size, big.ffn_hidden_size, big.num_attention_heads,
            big.num_query_groups, big.vocab_size) == (52, 4096, 21504, 32, 8, 131072)
    assert (big.mamba_num_heads, big.mamba_head_dim, big.mamba_state_dim,
            big.mamba_num_groups) == (128, 64, 128, 8)
    assert [big.hybrid_layer_pattern.count(c) for c in "M*-"] == [24, 4, 24]
    same = ("family", "rms_norm_eps", "tie_word_embeddings", "qk_norm", "rope_theta",
            "max_position_embeddings")
    assert all(getattr(big, f) == getattr(tiny, f) for f in same)
    assert set(tiny.hybrid_layer_pattern) == set(big.hybrid_layer_pattern)
    for spec in (big, tiny):  # Mamba inner width 2 x hidden (expand 2); GQA ratio 4
        assert spec.mamba_num_heads * spec.mamba_head_dim == 2 * spec.hidden_size
        assert spec.num_attention_heads // spec.num_query_groups == 4
        assert spec.num_attention_heads * spec.head_dim == spec.hidden_size
    assert tiny.hidden_size * tiny.num_layers < 1000
    check_trainable(tiny)


def test_bad_nemotron_configs_are_refused():
    config = MODELS["nemotron-h-8b-tiny"].hf_config()
    with pytest.raises(ValueError, match="MoE layers .E, Nemotron-3 Nano. are not"):
        from_hf_config({**config, "hybrid_override_pattern": "ME*-ME"})
    with pytest.raises(ValueError, match="conv_kernel.*d_conv=4"):
        from_hf_config({**config, "conv_kernel": 3})
    with pytest.raises(ValueError, match="mlp_hidden_act"):
        from_hf_config({**config, "mlp_hidden_act": "silu"})
    with pytest.raises(ValueError, match="layer_norm_epsilon=1e-06: Megatron's Mamba mixer"):
        from_hf_config({**config, "layer_norm_epsilon": 1e-6})
    import dataclasses

    with pytest.raises(ValueError, match="hybrid_layer_pattern 'M-M\\*' must have num_layers=6"):
        dataclasses.replace(MODELS["nemotron-h-8b-tiny"], hybrid_layer_pattern="M-M*")
    with pytest.raises(ValueError, match="Nemotron-H fields .* are set exactly"):
        dataclasses.replace(MODELS["qwen3-8b-tiny"], mamba_state_dim=16)
    with pytest.raises(ValueError, match="rope_theta is None exactly for Nemotron-H"):
        dataclasses.replace(MODELS["nemotron-h-8b-tiny"], rope_theta=10000.0)


def test_entry_point_refuses_arguments_of_the_other_model_kind(tmp_path):
    """`--hf-checkpoint` of a Nemotron-H checkpoint with a Qwen3's arguments, and of a Qwen3
    checkpoint with a hybrid pattern: refused before any compute, naming the flag."""
    from megatron_patches.megatron_lm.main import _check_hf_checkpoint
    from test_megatron_lm_units import _megatron_args_for

    (tmp_path / "config.json").write_text(json.dumps(MODELS["nemotron-h-8b-tiny"].hf_config()))
    args = _megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path),
                              hybrid_layer_pattern=None, squared_relu=False)
    with pytest.raises(ValueError, match="--hybrid-layer-pattern None but the checkpoint needs "
                                         "'M-M\\*M-'"):
        _check_hf_checkpoint(args)
    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen3-8b-tiny"].hf_config()))
    hybrid = _megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path),
                                hybrid_layer_pattern="*-*-")
    with pytest.raises(ValueError, match="--hybrid-layer-pattern \\*-\\*- but the checkpoint is "
                                         "a qwen3 GPTModel"):
        _check_hf_checkpoint(hybrid)
