"""The Megatron-LM entry point (examples/megatron_lm/train_grpo.py) under torchrun on the offline
Megatron-LM core_r0.19.0 checkout (CPU, gloo), as a user runs it:

* TP=2 from a Hugging Face Qwen3 checkpoint: weights loaded, Megatron's log lines and
  tensorboard, checkpoint saved at iteration 2, a resumed run (--load, --ckpt-step 2) reaches
  bitwise the same weights and loss at iteration 3, the HF export loads in transformers.
* Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1, examples/megatron_lm/
  torchrun_multinode.sh) run PP=2: prefix reuse == stock dense step by step.
* (slow) TP=2 x PP=2 on 4 processes: reuse == dense, and save/resume bitwise.
* (slow, versions) Megatron-LM main (0.20.0): PP=2 reuse == dense, checkpoint saved.

"reuse == dense": the policy loss of every iteration within 1e-5 relative, and every rank's
gradients (DDP's reduced main_grad) and weights after every step, dumped by
--prefix-reuse-dump-params, within 1e-5 per tensor, none missing, zero or non-finite
(megatron_lm_runs.assert_dumps_equal); Adam with eps=1 (COMPARE_ARGS) so weights compare.
"""

import concurrent.futures
import os
import socket
import sys

import pytest
import torch

from megatron_lm_runs import (COMPARE_ARGS, REPO, assert_dumps_equal, child_env, entry_tree,
                              iterations, model_args, rank_params, small_args, torchrun)
from reaped import run_reaped

pytestmark = pytest.mark.megatron
QWEN = "qwen3-8b-tiny"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from megatron_patches.models.model_configs import MODELS

    config = {k: v for k, v in MODELS[QWEN].hf_config().items() if k != "model_type"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3", **config)).float()
    path = tmp_path_factory.mktemp("hf") / "qwen3-tiny"
    model.save_pretrained(path, safe_serialization=True)
    return path


def _ok(run):
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return iterations(run.stdout + run.stderr)


def _assert_same_params(a, b):
    assert a.keys() == b.keys() and a
    for rank in a:
        for name, tensor in a[rank].items():
            assert torch.equal(tensor, b[rank][name]), (rank, name)


def test_tp2_from_hf_checkpoint_save_resume_bitwise(tree, hf_checkpoint, tmp_path):
    from megatron_patches.models.checkpoints import RankLayout, to_megatron
    from megatron_patches.models.hf_checkpoints import hf_tensor_names, read_hf_config, read_hf_tensors

    common = [*model_args(QWEN), *small_args(3), "--tensor-model-parallel-size", "2",
              "--prefix-reuse", "--hf-checkpoint", str(hf_checkpoint)]
    first = _ok(torchrun(tree, 2, [*common, "--save", str(tmp_path / "ckpt"), "--save-interval",
                                   "2", "--prefix-reuse-dump-params", str(tmp_path / "a"),
                                   "--tensorboard-dir", str(tmp_path / "tb"),
                                   "--export-hf", str(tmp_path / "export")]))
    assert sorted(first) == [1, 2, 3]
    spec, _ = read_hf_config(hf_checkpoint)
    hf = read_hf_tensors(hf_checkpoint, hf_tensor_names(hf_checkpoint))
    start = rank_params(tmp_path / "a", 0)
    for rank in (0, 1):  # iteration 0 holds the HF weights, split over TP
        expected = to_megatron(spec, hf, RankLayout(tp_rank=rank, tp_size=2, padded_vocab_size=512))
        for name, tensor in expected.items():
            assert torch.equal(start[f"rank_{rank}.safetensors"][f"0.module.{name}"], tensor), name
    assert list((tmp_path / "tb").iterdir()) and (tmp_path / "ckpt" / "iter_0000002").is_dir()

    second = _ok(torchrun(tree, 2, [*common, "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2",
                                    "--prefix-reuse-dump-params", str(tmp_path / "b")]))
    assert sorted(second) == [3] and second[3] == first[3]
    _assert_same_params(rank_params(tmp_path / "a", 3), rank_params(tmp_path / "b", 3))

    transformers = pytest.importorskip("transformers")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert not torch.equal(exported.model.embed_tokens.weight,
                           hf["model.embed_tokens.weight"])  # trained, and readable by HF


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_agents(tree, args, tmp_path):
    """Two torchrun agents, one "node" each, meeting at a c10d rendezvous on 127.0.0.1."""
    env = {**child_env(tree), "NNODES": "2", "NPROC_PER_NODE": "1", "PYTHON": sys.executable,
           "RDZV_ENDPOINT": f"127.0.0.1:{_free_port()}", "RDZV_ID": f"test-{os.getpid()}",
           "PREFIX_REUSE_COLLECTIVE_TIMEOUT_S": "120"}
    script = str(REPO / "examples" / "megatron_lm" / "torchrun_multinode.sh")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each agent's processes are ended
        agents = list(pool.map(lambda _: run_reaped(["bash", script, *args], env=env, cwd=REPO,
                                                     timeout=600), range(2)))
    outputs = [agent.stdout + agent.stderr for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-6000:]
    return iterations("\n".join(outputs))


def _assert_losses_equal(dense, reuse, iters):
    assert sorted(dense) == sorted(reuse) == list(range(1, iters + 1))
    for i in dense:
        assert abs(dense[i][0] - reuse[i][0]) <= 1e-5 * abs(dense[i][0]), (i, dense[i], reuse[i])


def test_two_nodes_pp2_reuse_equals_dense(tree, tmp_path):
    common = [*model_args("llama3.1-8b-tiny"), *small_args(2), *COMPARE_ARGS,
              "--pipeline-model-parallel-size", "2"]
    dense = _two_agents(tree, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")],
                        tmp_path)
    reuse = _two_agents(tree, [*common, "--prefix-reuse", "--prefix-chunk-tokens", "16",
                               "--prefix-reuse-dump-params", str(tmp_path / "r")], tmp_path)
    _assert_losses_equal(dense, reuse, 2)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2)


@pytest.mark.slow
def test_tp2_pp2_four_processes_reuse_equals_dense_and_resumes(tree, tmp_path):
    common = [*model_args(QWEN), *small_args(3), *COMPARE_ARGS, "--tensor-model-parallel-size",
              "2", "--pipeline-model-parallel-size", "2"]
    dense = _ok(torchrun(tree, 4, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")]))
    reuse = _ok(torchrun(tree, 4, [*common, "--prefix-reuse", "--save", str(tmp_path / "ckpt"),
                                   "--save-interval", "2",
                                   "--prefix-reuse-dump-params", str(tmp_path / "a")]))
    _assert_losses_equal(dense, reuse, 3)
    assert_dumps_equal(tmp_path / "d", tmp_path / "a", 3)
    resumed = _ok(torchrun(tree, 4, [*common, "--prefix-reuse", "--load", str(tmp_path / "ckpt"),
                                     "--ckpt-step", "2",
                                     "--prefix-reuse-dump-params", str(tmp_path / "b")]))
    assert resumed[3] == reuse[3]
    _assert_same_params(rank_params(tmp_path / "a", 3), rank_params(tmp_path / "b", 3))


@pytest.mark.slow
@pytest.mark.versions
def test_megatron_lm_main_pp2_reuse_equals_dense(tmp_path_factory, tmp_path):
    """The same entry point on Megatron-LM main (0.20.0): PP=2, reuse == dense, checkpoint saved."""
    main_tree = entry_tree("0.20.0", tmp_path_factory)
    common = [*model_args("llama3.1-8b-tiny"), *small_args(2), *COMPARE_ARGS,
              "--pipeline-model-parallel-size", "2"]
    dense = _ok(torchrun(main_tree, 2, [*common, "--prefix-reuse-dump-params",
                                        str(tmp_path / "d")]))
    reuse = _ok(torchrun(main_tree, 2, [*common, "--prefix-reuse", "--save", str(tmp_path / "c"),
                                        "--save-interval", "2", "--prefix-reuse-dump-params",
                                        str(tmp_path / "r")]))
    _assert_losses_equal(dense, reuse, 2)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2)
    assert (tmp_path / "c" / "iter_0000002").is_dir()


def test_pp2_virtual_stages_reuse_equals_dense(tree, tmp_path):
    """PP=2 x 2 virtual stages (one layer per model chunk) through the entry point: Megatron's
    interleaved dense schedule vs the reuse executor's interleaved plan, loss, gradients and
    weights per step (every chunk's); deallocate_pipeline_outputs as Megatron-LM sets it (True)."""
    common = [*model_args("llama3.1-8b-tiny"), *small_args(2), *COMPARE_ARGS,
              "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    dense = _ok(torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")]))
    reuse = _ok(torchrun(tree, 2, [*common, "--prefix-reuse", "--prefix-chunk-tokens", "16",
                                   "--prefix-reuse-dump-params", str(tmp_path / "r")]))
    _assert_losses_equal(dense, reuse, 2)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2)
