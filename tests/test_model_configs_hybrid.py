"""The Gated DeltaNet hybrids in model_configs (model_configs_hybrid.py): Qwen3-Next-80B-A3B,
Qwen3.5-27B, Qwen3.5-35B-A3B and their tiny twins.

* Megatron-LM's own parser (core_r0.19.0 and, -m slow, main checkouts) turns each hybrid's arguments into
  a TransformerConfig whose GDN fields (variant, per-layer GDN/attention pattern, heads, dims,
  conv width, output gate, rotary percent, shared expert and its gate) equal those of the
  `transformers` config built from the same numbers; `mismatches_with_args` finds none for
  them and names the flag when one GDN argument differs. (The fields every model shares:
  tests/test_model_configs.py, which covers the hybrids too.)
* The tiny twins keep the architecture; the published numbers are the ones registered.
* Bad config.json layouts are refused with the reason; every hybrid is trainable.
* The entry point refuses an HF hybrid checkpoint with arguments that build no GDN layers, or
  zero-centred norms (`--apply-layernorm-1p`: the converter already adds the 1).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_patches.models.model_configs import (HYBRID_MODELS, MODELS, check_trainable,
                                                   from_hf_config)
from megatron_trees import REPO, stock_tree

transformers = pytest.importorskip("transformers")

HYBRIDS = {n: s for n, s in MODELS.items() if s.is_gdn}

_PARSE = textwrap.dedent("""
    import json, sys
    from megatron_patches.megatron_lm.compat import enable_python311_support, enable_megatron_lm_cpu_support
    enable_python311_support(); enable_megatron_lm_cpu_support()
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
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
        out[name] = dict(variant=c.experimental_attention_variant,
            pattern=get_linear_attention_pattern(c), heads=[c.linear_num_key_heads,
            c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim],
            conv=c.linear_conv_kernel_dim, gate=c.attention_output_gate,
            rotary_percent=args.rotary_percent, shared=c.moe_shared_expert_intermediate_size,
            shared_gate=c.moe_shared_expert_gate,
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
def test_megatron_gdn_fields_match_transformers(version, tmp_path_factory):
    tree = stock_tree(version, tmp_path_factory)
    argv = {name: spec.megatron_args() for name, spec in HYBRIDS.items()}
    tiny = argv["qwen3.5-27b-tiny"]
    argv["qwen3.5-27b-tiny+heads"] = _with(tiny, "--linear-num-value-heads", "4")
    argv["qwen3.5-27b-tiny+freq"] = _with(tiny, "--linear-attention-freq", "2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", _PARSE, json.dumps(argv)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr[-4000:]
    megatron = json.loads(run.stdout.strip().splitlines()[-1])
    for name, spec in HYBRIDS.items():
        m, hf = megatron[name], _hf_config(spec)
        shared = getattr(hf, "shared_expert_intermediate_size", None) if spec.is_moe else None
        expected = dict(  # main normalises the deprecated alias gated_delta_net to gdn
            variant="gdn" if version == "0.20.0" else "gated_delta_net",
            pattern=[int(t == "linear_attention") for t in hf.layer_types],
            heads=[hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                   hf.linear_value_head_dim], conv=hf.linear_conv_kernel_dim, gate=True,
            rotary_percent=hf.rope_parameters["partial_rotary_factor"], shared=shared,
            shared_gate=shared is not None, mismatches=[])
        assert m == expected, (name, {k: (m[k], v) for k, v in expected.items() if m[k] != v})
    assert any("--linear-num-value-heads 4" in p
               for p in megatron["qwen3.5-27b-tiny+heads"]["mismatches"])
    assert any("--linear-attention-freq 2" in p
               for p in megatron["qwen3.5-27b-tiny+freq"]["mismatches"])


def test_published_numbers_and_tiny_twins():
    next80, dense, moe = (HYBRID_MODELS[n] for n in ("qwen3-next-80b-a3b", "qwen3.5-27b",
                                                     "qwen3.5-35b-a3b"))
    assert (next80.num_layers, next80.num_experts, next80.moe_router_topk,
            next80.vocab_size) == (48, 512, 10, 151936)
    assert (dense.hidden_size, dense.ffn_hidden_size, dense.num_attention_heads,
            dense.linear_num_value_heads, dense.vocab_size) == (5120, 17408, 24, 48, 248320)
    assert (moe.num_layers, moe.num_experts, moe.moe_router_topk) == (40, 256, 8)
    for name, big in HYBRID_MODELS.items():
        tiny = MODELS[f"{name}-tiny"]
        same = ("family", "linear_attention_freq", "linear_conv_kernel_dim", "rotary_percent",
                "attention_output_gate", "rope_theta", "rms_norm_eps", "qk_norm")
        assert all(getattr(big, f) == getattr(tiny, f) for f in same), name
        assert (big.linear_num_value_heads // big.linear_num_key_heads
                == tiny.linear_num_value_heads // tiny.linear_num_key_heads)
        assert tiny.is_moe == big.is_moe and tiny.hidden_size * tiny.num_layers < 1000


def test_bad_hybrid_configs_are_refused():
    config = MODELS["qwen3.5-27b-tiny"].hf_config()
    check_trainable(from_hf_config(config))
    with pytest.raises(ValueError, match="layer_types .* not every 4-th layer"):
        from_hf_config({**config, "layer_types": ["linear_attention"] * 4})
    with pytest.raises(ValueError, match="attn_output_gate=false"):
        from_hf_config({**config, "attn_output_gate": False})
    check_trainable(MODELS["qwen3.5-35b-a3b-tiny"])
    import dataclasses

    with pytest.raises(ValueError, match="belong to the GDN families"):
        dataclasses.replace(MODELS["qwen3-8b-tiny"], rotary_percent=0.25)
    with pytest.raises(ValueError, match="a shared expert needs num_experts"):
        dataclasses.replace(MODELS["qwen3.5-27b-tiny"], moe_shared_expert_intermediate_size=32)
    with pytest.raises(ValueError, match="GDN fields .* are set exactly"):
        dataclasses.replace(MODELS["qwen3.5-27b-tiny"], linear_conv_kernel_dim=None)


def test_entry_point_refuses_arguments_without_the_checkpoints_gdn_layers(tmp_path):
    """`--hf-checkpoint` of a Qwen3.5 checkpoint with a plain Qwen3's arguments (no GDN flags):
    refused before any compute, naming the GDN flag (megatron_lm/main._check_hf_checkpoint)."""
    from megatron_patches.megatron_lm.main import _check_hf_checkpoint
    from test_megatron_lm_units import _megatron_args_for

    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen3.5-27b-tiny"].hf_config()))
    args = _megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path),
                              experimental_attention_variant=None)
    with pytest.raises(ValueError, match="--experimental-attention-variant None but the "
                                         "checkpoint needs 'gated_delta_net'"):
        _check_hf_checkpoint(args)
    zero_centred = _megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path),
                                      layernorm_zero_centered_gamma=True)
    with pytest.raises(ValueError, match="--apply-layernorm-1p: arguments give True"):
        _check_hf_checkpoint(zero_centred)  # the converter already turned (1 + w) into w + 1
