"""A Gated DeltaNet hybrid through the Megatron-LM entry point (examples/megatron_lm/
train_grpo.py) on the offline core_r0.19.0 tree (CPU, gloo): the Qwen3.5-27B tiny twin
(`qwen3.5-27b-tiny`: GDN, GDN, GDN, gated attention with quarter RoPE), its arguments from
`model_configs`, Megatron-LM's gpt_builder with the local GDN block spec (no Transformer
Engine on CPU: megatron_patches/megatron_lm/model.py).

TP=2 (2 processes), both runs from a Hugging Face Qwen3.5 checkpoint written by transformers:
iteration 0 holds its weights split over TP (checked tensor by tensor), prefix reuse == the same
entry point's stock dense run over two Adam steps (policy loss within 1e-5 relative, every
rank's gradients and weights within 1e-5 per tensor, none missing, zero or non-finite:
megatron_lm_runs.assert_dumps_equal), and the reuse run's `--export-hf` loads in transformers.

The Qwen3-Next-80B-A3B tiny twin (MoE: 8 experts, top-2, a sigmoid-gated shared expert) at EP=2
(2 processes, same-shaped groups), both runs from an HF Qwen3-Next checkpoint: reuse == dense
over the dense packing reuse equals (docs/DESIGN.md "MoE"), two Adam steps, the same checks
(an expert that got no token may have a zero gradient, on both sides alike).
"""

import pytest
import torch

from megatron_lm_runs import (COMPARE_ARGS, assert_dumps_equal, entry_tree, model_args,
                              rank_params, small_args, torchrun)
from test_megatron_lm_entry import _ok

pytestmark = pytest.mark.megatron
MODEL = "qwen3.5-27b-tiny"
MOE_MODEL = "qwen3-next-80b-a3b-tiny"
TOL = 1e-5


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


def _checkpoint(name, tmp_path_factory):
    pytest.importorskip("transformers")
    from megatron_patches.models.model_configs import MODELS
    from test_hf_checkpoints_gdn import hf_model

    path = tmp_path_factory.mktemp("hf") / name
    hf_model(MODELS[name], seed=3).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return _checkpoint(MODEL, tmp_path_factory)


def test_tp2_from_hf_reuse_equals_dense(tree, hf_checkpoint, tmp_path):
    from megatron_patches.models.checkpoints import RankLayout, to_megatron
    from megatron_patches.models.hf_checkpoints import (hf_tensor_names, read_hf_config,
                                                        read_hf_tensors)

    common = [*model_args(MODEL), *small_args(2), *COMPARE_ARGS,
              "--tensor-model-parallel-size", "2", "--hf-checkpoint", str(hf_checkpoint)]
    dense = _ok(torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")]))
    reuse = _ok(torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                                   str(tmp_path / "r"), "--export-hf", str(tmp_path / "export")]))
    assert sorted(dense) == sorted(reuse) == [1, 2]
    for i in dense:
        assert abs(dense[i][0] - reuse[i][0]) <= TOL * abs(dense[i][0]), (i, dense, reuse)
    spec, _ = read_hf_config(hf_checkpoint)
    hf = read_hf_tensors(hf_checkpoint, hf_tensor_names(hf_checkpoint))
    start = rank_params(tmp_path / "r", 0)
    for rank in (0, 1):  # iteration 0 holds the HF weights, split over TP
        expected = to_megatron(spec, hf, RankLayout(tp_rank=rank, tp_size=2,
                                                    padded_vocab_size=spec.vocab_size))
        got = start[f"rank_{rank}.safetensors"]
        assert {f"0.module.{n}" for n in expected} == {n for n in got if not n.startswith("grad.")}
        for name, tensor in expected.items():
            assert torch.equal(got[f"0.module.{name}"], tensor), name
    assert any("in_proj" in n for n in start["rank_0.safetensors"])  # GDN layers were built
    # A GDN layer's decay parameters (A_log, dt_bias) have gradients summed from many small
    # terms of both signs; at TP=2 their per-tensor relative difference is fp32 summation-order
    # noise near 1e-5 already at iteration 1 (9.4e-6 measured), and after one Adam step with the
    # TP-summed out_norm gradient (tp-grad-sum-hook) 2.4e-5 at iteration 2. Every other tensor
    # stays at TOL.
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2, TOL,
                       loose=lambda n: 5e-5 if n.endswith(("A_log", "dt_bias")) else 0.0)
    transformers = pytest.importorskip("transformers")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert not torch.equal(exported.model.layers[0].linear_attn.in_proj_qkv.weight,
                           hf["model.layers.0.linear_attn.in_proj_qkv.weight"])  # trained


def test_moe_hybrid_ep2_from_hf_reuse_equals_dense(tree, tmp_path_factory, tmp_path):
    path = _checkpoint(MOE_MODEL, tmp_path_factory)
    common = [*model_args(MOE_MODEL), *small_args(2), *COMPARE_ARGS,
              "--expert-model-parallel-size", "2", "--rl-synthetic-uniform-groups",
              "--hf-checkpoint", str(path)]
    dense = _ok(torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")]))
    reuse = _ok(torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                                   str(tmp_path / "r")]))
    assert sorted(dense) == sorted(reuse) == [1, 2]
    for i in dense:
        assert abs(dense[i][0] - reuse[i][0]) <= TOL * abs(dense[i][0]), (i, dense, reuse)
    names = set(rank_params(tmp_path / "r", 1)["rank_0.safetensors"])
    assert any("shared_experts.gate_weight" in n for n in names)
    assert any("local_experts" in n for n in names) and any("in_proj" in n for n in names)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2, TOL,
                       may_be_zero=lambda name: "local_experts" in name)
