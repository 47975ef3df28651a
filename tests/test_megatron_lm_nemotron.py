"""Nemotron-H through the Megatron-LM entry point (examples/megatron_lm/train_grpo.py) on the
offline core_r0.19.0 tree (CPU, gloo): the `nemotron-h-8b-tiny` twin (pattern M-M*M-: Mamba-2,
relu^2 MLP, attention without positions), its arguments from `model_configs`, built as a
HybridModel by the entry point's `hybrid_builder` (megatron_patches/megatron_lm/model.py) with
the local layer spec (no Transformer Engine on CPU).

TP=2 (2 processes: Mamba heads, B/C groups and conv channels split) and, -m slow, PP=2 (stages
"M-M" | "*M-", Megatron's even split of a pattern without stage marks), both runs from a Hugging
Face Nemotron-H checkpoint written by transformers: iteration 0 holds its weights split over TP
or PP (checked tensor by tensor), prefix reuse == the same entry point's stock dense run over two Adam
steps (policy loss within 1e-5 relative, every rank's gradients and weights within 1e-5 per
tensor, none missing, zero or non-finite: megatron_lm_runs.assert_dumps_equal), and the reuse
run's `--export-hf` loads in transformers with trained Mamba weights.
"""

import pytest
import torch

from megatron_lm_runs import (COMPARE_ARGS, assert_dumps_equal, entry_tree, model_args,
                              rank_params, small_args, torchrun)
from test_megatron_lm_entry import _ok

pytestmark = pytest.mark.megatron
MODEL = "nemotron-h-8b-tiny"
TOL = 1e-5


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from megatron_patches.models.model_configs import MODELS
    from test_hf_checkpoints_nemotron import hf_model

    path = tmp_path_factory.mktemp("hf") / MODEL
    hf_model(MODELS[MODEL], seed=3).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2"])
def test_from_hf_reuse_equals_dense(tree, hf_checkpoint, tmp_path, tp, pp):
    from megatron_patches.models.checkpoints import RankLayout, to_megatron
    from megatron_patches.models.hf_checkpoints import (hf_tensor_names, read_hf_config,
                                                        read_hf_tensors)

    common = [*model_args(MODEL), *small_args(2), *COMPARE_ARGS,
              "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
              "--hf-checkpoint", str(hf_checkpoint)]
    dense = _ok(torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")]))
    reuse = _ok(torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                                   str(tmp_path / "r"), "--export-hf", str(tmp_path / "export")]))
    assert sorted(dense) == sorted(reuse) == [1, 2]
    for i in dense:
        assert abs(dense[i][0] - reuse[i][0]) <= TOL * abs(dense[i][0]), (i, dense, reuse)
    spec, _ = read_hf_config(hf_checkpoint)
    hf = read_hf_tensors(hf_checkpoint, hf_tensor_names(hf_checkpoint))
    start = rank_params(tmp_path / "r", 0)
    for rank in (0, 1):  # iteration 0 holds the HF weights, split over TP or PP
        expected = to_megatron(spec, hf, RankLayout(
            tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp,
            padded_vocab_size=spec.vocab_size))
        got = start[f"rank_{rank}.safetensors"]
        assert {f"0.module.{n}" for n in expected} == {n for n in got if not n.startswith("grad.")}
        for name, tensor in expected.items():
            assert torch.equal(got[f"0.module.{name}"], tensor), name
    names = set(start["rank_0.safetensors"]) | set(start["rank_1.safetensors"])
    assert any("mixer.conv1d_weight" in n for n in names)  # Mamba layers were built
    assert any("self_attention.linear_qkv" in n for n in names)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2, TOL)
    transformers = pytest.importorskip("transformers")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert not torch.equal(exported.model.layers[0].mixer.in_proj.weight,
                           hf["backbone.layers.0.mixer.in_proj.weight"])  # trained
