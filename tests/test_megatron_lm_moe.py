"""MoE through the Megatron-LM entry point (examples/megatron_lm/train_grpo.py) on the offline
core_r0.19.0 tree (CPU, gloo): the Qwen3-30B-A3B tiny twin (8 experts, top-2, softmax over the
top-k logits, aux loss) selected like the dense models, Megatron's own MoE arguments.

* EP=2 (2 processes), both runs from a Hugging Face Qwen3-MoE checkpoint (checked split over
  the EP ranks at iteration 0, exported after training, read back by transformers): prefix
  reuse == stock dense over the dense packing reuse equals (docs/
  DESIGN.md "MoE"), step by step over three Adam steps: policy loss and Megatron's logged
  `load_balancing_loss` within 1e-5, every gradient (router, experts, attention: DDP's reduced
  main_grad) and every weight within 1e-5 relative, on every rank; a
  checkpoint saved at iteration 2 resumes (--load --ckpt-step 2) to bitwise the same weights at 3.
* TP=2 x expert TP=2 with --sequence-parallel (2 processes), both runs from the HF checkpoint
  (split over the TP ranks at iteration 0), rows of one length (a multiple of TP: what the
  trainer requires of MoE at TP > 1): the same equality over two Adam steps. It fails if a TP
  rank's aux-loss token normalisation is off by 1% (checked by hand: policy loss at step 2).
* (slow) EP=2 x PP=2 and EP=2 x TP=2 (expert TP=2, sequence parallel) on 4 processes: the
  same equality.
"""

import pytest
import torch

from megatron_lm_runs import (assert_dumps_equal, entry_tree, model_args, rank_params, small_args,
                              torchrun)
from test_megatron_lm_entry import _assert_same_params, _ok

pytestmark = pytest.mark.megatron
QWEN_MOE = "qwen3-30b-a3b-tiny"
TOL = 1e-5


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


@pytest.fixture(scope="module")
def hf_moe_checkpoint(tmp_path_factory):
    """A random tiny Qwen3-MoE (the twin) saved by transformers."""
    pytest.importorskip("transformers")
    from megatron_patches.models.model_configs import MODELS
    from test_hf_checkpoints_moe import moe_hf_model

    path = tmp_path_factory.mktemp("hf") / "qwen3-moe-tiny"
    moe_hf_model(MODELS[QWEN_MOE], seed=2).save_pretrained(path, safe_serialization=True)
    return path


def moe_args(iters: int, ep: int = 2):
    """The tiny twin, EP=ep, same-shaped groups; Adam with eps=1, far above |g|, so each update
    is near-linear in the gradient (a gradient entry at float-noise level cannot get an O(lr)
    update of noise sign: tests/megatron_lm_args.py). Megatron-LM's SGD cannot --load a
    torch_dist checkpoint (its optimizer has no init_state_fn)."""
    return [*model_args(QWEN_MOE), *small_args(iters), "--expert-model-parallel-size", str(ep),
            "--adam-eps", "1", "--lr", "0.1", "--min-lr", "0.1", "--rl-synthetic-uniform-groups"]


def _load_balancing(output: str):
    import re

    return {int(i): float(v) for i, v in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \|.*?load_balancing_loss: (\S+) \|", output)}


def _assert_reuse_equals_dense(dense_run, reuse_run, dense_dir, reuse_dir, iters):
    dense, reuse = _ok(dense_run), _ok(reuse_run)
    assert sorted(dense) == sorted(reuse) == list(range(1, iters + 1))
    dense_lb = _load_balancing(dense_run.stdout + dense_run.stderr)
    reuse_lb = _load_balancing(reuse_run.stdout + reuse_run.stderr)
    assert sorted(dense_lb) == sorted(reuse_lb) == sorted(dense)  # Megatron's MoE log line
    for i in dense:
        (dl, dn), (rl, rn) = dense[i], reuse[i]
        assert abs(dl - rl) <= TOL * abs(dl), (i, dl, rl)
        assert abs(dn - rn) <= 1e-3 * dn, (i, dn, rn)  # printed with 4 digits
        assert abs(dense_lb[i] - reuse_lb[i]) <= TOL * dense_lb[i], (i, dense_lb, reuse_lb)
    for i in range(1, iters + 1):
        for rank, tensors in rank_params(dense_dir, i).items():
            grads = [n for n in tensors if n.startswith("grad.")]
            assert any("local_experts" in n for n in grads) and any("router" in n for n in grads)
    # an expert may get no token: its gradient may be zero (on both sides alike)
    assert_dumps_equal(dense_dir, reuse_dir, iters, TOL,
                       may_be_zero=lambda name: "local_experts" in name)


def test_ep2_from_hf_reuse_equals_dense_and_resumes(tree, hf_moe_checkpoint, tmp_path):
    """Both runs start from the HF Qwen3-MoE checkpoint (split over EP=2); the reuse run saves
    at 2 and exports HF weights; a --load run resumes bitwise."""
    from megatron_patches.models.checkpoints import RankLayout, to_megatron
    from megatron_patches.models.hf_checkpoints import hf_tensor_names, read_hf_config, read_hf_tensors

    common = [*moe_args(3), "--hf-checkpoint", str(hf_moe_checkpoint)]
    dense = torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")])
    reuse = torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                               str(tmp_path / "a"), "--save", str(tmp_path / "ckpt"),
                               "--save-interval", "2", "--export-hf", str(tmp_path / "export")])
    _assert_reuse_equals_dense(dense, reuse, tmp_path / "d", tmp_path / "a", 3)
    spec, _ = read_hf_config(hf_moe_checkpoint)
    hf = read_hf_tensors(hf_moe_checkpoint, hf_tensor_names(hf_moe_checkpoint))
    start = rank_params(tmp_path / "a", 0)
    for rank in (0, 1):  # iteration 0 holds the HF weights; rank r is EP rank r
        expected = to_megatron(spec, hf, RankLayout(ep_rank=rank, ep_size=2, padded_vocab_size=512))
        assert {f"0.module.{n}" for n in expected} == set(start[f"rank_{rank}.safetensors"])
        for name, tensor in expected.items():
            assert torch.equal(start[f"rank_{rank}.safetensors"][f"0.module.{name}"], tensor), name
    resumed = _ok(torchrun(tree, 2, [*common, "--prefix-reuse", "--load",
                                     str(tmp_path / "ckpt"), "--ckpt-step", "2",
                                     "--prefix-reuse-dump-params", str(tmp_path / "b")]))
    assert sorted(resumed) == [3] and resumed[3] == _ok(reuse)[3]
    _assert_same_params(rank_params(tmp_path / "a", 3), rank_params(tmp_path / "b", 3))
    transformers = pytest.importorskip("transformers")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    trained = exported.model.layers[0].mlp.gate.weight  # trained, readable by HF
    assert not torch.equal(trained, hf["model.layers.0.mlp.gate.weight"])


def tp2_args(iters: int):
    """TP=2 with sequence parallelism (expert TP = TP, Megatron's default): rows of one length,
    a multiple of TP (48 + 15 - 1 = 62 tokens; the trainer refuses others)."""
    return [*moe_args(iters, ep=1), "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--rl-synthetic-prefix-len", "48", "--rl-synthetic-max-response-len", "15",
            "--rl-synthetic-fixed-response-len"]


def test_tp2_sequence_parallel_from_hf_reuse_equals_dense(tree, hf_moe_checkpoint, tmp_path):
    """TP=2 x expert TP=2 with sequence parallelism, both runs from the HF checkpoint (split over
    the TP ranks at iteration 0): reuse == dense step by step, as at EP=2."""
    from megatron_patches.models.checkpoints import RankLayout, to_megatron
    from megatron_patches.models.hf_checkpoints import hf_tensor_names, read_hf_config, read_hf_tensors

    common = [*tp2_args(2), "--hf-checkpoint", str(hf_moe_checkpoint)]
    dense = torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")])
    reuse = torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                               str(tmp_path / "a")])
    _assert_reuse_equals_dense(dense, reuse, tmp_path / "d", tmp_path / "a", 2)
    spec, _ = read_hf_config(hf_moe_checkpoint)
    hf = read_hf_tensors(hf_moe_checkpoint, hf_tensor_names(hf_moe_checkpoint))
    start = rank_params(tmp_path / "a", 0)
    for rank in (0, 1):  # iteration 0 holds the HF weights; rank r is TP (and expert TP) rank r
        expected = to_megatron(spec, hf, RankLayout(tp_rank=rank, tp_size=2, expert_tp_rank=rank,
                                                    expert_tp_size=2, padded_vocab_size=512))
        assert {f"0.module.{n}" for n in expected} == set(start[f"rank_{rank}.safetensors"])
        for name, tensor in expected.items():
            assert torch.equal(start[f"rank_{rank}.safetensors"][f"0.module.{name}"], tensor), name


@pytest.mark.slow
def test_ep2_pp2_reuse_equals_dense(tree, tmp_path):
    common = [*moe_args(2), "--pipeline-model-parallel-size", "2"]
    dense = torchrun(tree, 4, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")])
    reuse = torchrun(tree, 4, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                               str(tmp_path / "a")])
    _assert_reuse_equals_dense(dense, reuse, tmp_path / "d", tmp_path / "a", 2)


@pytest.mark.slow
def test_ep2_tp2_sequence_parallel_reuse_equals_dense(tree, tmp_path):
    """The paper's MoE layout kind: experts over EP=2, each split over expert TP = TP = 2."""
    common = [*tp2_args(2), "--expert-model-parallel-size", "2"]
    dense = torchrun(tree, 4, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")])
    reuse = torchrun(tree, 4, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                               str(tmp_path / "a")])
    _assert_reuse_equals_dense(dense, reuse, tmp_path / "d", tmp_path / "a", 2)


def test_ep2_ranks_with_different_shapes_are_refused(tree):
    """Without --rl-synthetic-uniform-groups the two expert-parallel ranks get groups of other
    response lengths: the dense baseline's unequal microbatch counts are refused before compute
    (never a hang); reuse plans are checked by the executor (tests/test_moe_parallel.py)."""
    args = [a for a in moe_args(1) if a != "--rl-synthetic-uniform-groups"]
    run = torchrun(tree, 2, args, timeout=300)
    assert run.returncode != 0 and "every expert-parallel rank needs the same number" in (
        run.stdout + run.stderr), (run.stdout + run.stderr)[-3000:]
