"""Megatron-LM RL (train_rl.py, megatron/rl on the offline Megatron-LM main checkout): its
get_grpo_data_iterator (collection replayed from a trace; prepare_data_for_update with the old/ref
log-prob passes) and GRPO training step on rollouts in its agents' types, stock vs prefix reuse (TrainRLReuse hooks), 3 iterations on CPU.

tests/train_rl_replay.py runs both in one process on the patched checkout (what is Megatron's
own code there and what is stubbed is listed in its docstring); this test compares, fp32:
per iteration the loss (train_rl.loss_func's reports), the grad norm, every gradient, the old and reference
log-probs (every position), and every weight after the (SGD) optimizer step, within 1e-5
relative, failing on NaN/inf on either side; and that the reuse step really shared prefixes.
"""
import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from megatron_lm_runs import REPO, child_env
import megatron_trees
from megatron_trees import patched_tree

pytestmark = pytest.mark.megatron
TOL = 1e-5
RL_MODULES = ("httpx", "fastapi", "uvicorn", "openai")
"""Imported at the top of megatron/rl (its inference client and server): pinned in the Makefile."""


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    missing = [m for m in RL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        megatron_trees.missing(f"Megatron-LM's megatron/rl imports {', '.join(missing)}: run "
                               "make setup (or make test-frameworks)")
    return patched_tree("0.20.0", tmp_path_factory)  # skips naming the places when absent


def _run(tree, script, arg):
    run = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / script), str(arg)],
                         env=child_env(tree), cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return run.stdout


@pytest.fixture(scope="module")
def replay(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("train_rl") / "replay.pt"
    _run(tree, "train_rl_replay.py", out)
    return torch.load(out)


def test_train_rl_prefix_reuse_launcher(tree, tmp_path):
    """examples/megatron_lm/train_rl_prefix_reuse.py: tests/train_rl_launcher_check.py."""
    assert "launcher ok" in _run(tree, "train_rl_launcher_check.py", tmp_path)


def _close(a, b, what):
    assert math.isfinite(a) and math.isfinite(b), (what, a, b)
    assert abs(a - b) <= TOL * abs(a), (what, a, b)


def _tensors_close(a, b, what):
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: NaN or inf"
    scale = a.abs().max().item()
    assert scale > 0, f"{what}: all zero"
    diff = (a - b).abs().max().item() / scale
    assert diff <= TOL, f"{what}: max relative difference {diff:.3e}"


def test_train_rl_grpo_step_reuse_equals_stock_over_3_iterations(replay):
    stock, reuse = replay["stock"], replay["reuse"]
    assert len(stock["loss"]) == len(reuse["loss"]) == 3
    assert stock["collections"] == reuse["collections"] == 3  # get_grpo_data_iterator collected
    for it in range(3):
        _close(stock["loss"][it], reuse["loss"][it], f"loss {it + 1}")
        _close(stock["grad_norm"][it], reuse["grad_norm"][it], f"grad norm {it + 1}")
        _tensors_close(stock["old"][it], reuse["old"][it], f"old log-probs {it + 1}")
        _tensors_close(stock["ref"][it], reuse["ref"][it], f"ref log-probs {it + 1}")
        assert stock["grads"][it].keys() == reuse["grads"][it].keys()
        for name, g in stock["grads"][it].items():
            _tensors_close(g, reuse["grads"][it][name], f"gradient of {name}, iteration {it + 1}")
        assert stock["weights"][it].keys() == reuse["weights"][it].keys()
        for name, w in stock["weights"][it].items():
            _tensors_close(w, reuse["weights"][it][name], f"{name} after iteration {it + 1}")
    assert stock["loss"][0] != stock["loss"][2]  # the weights moved: 3 distinct iterations
    assert all(r == "dense" for r in stock["report"])
    for report in reuse["report"]:
        assert report.count("reuse (FLOP gain") == 2, report  # both GRPO groups shared


def _rows(n=4, length=12):
    tokens = torch.arange(n * length).reshape(n, length) % 50 + 1
    mask = torch.zeros(n, length)
    mask[:, 6:9] = 1.0
    lp = -torch.rand(n, length - 1)
    return tokens, mask, torch.randn(n), lp, lp - 0.1


def test_train_rl_rows_to_rollout_alignment_and_pad_rows(megatron_env):
    from megatron_patches.frameworks.megatron_rl import rollout_from_train_rl

    tokens, mask, adv, old, ref = _rows()
    rollout = rollout_from_train_rl(tokens, mask, adv, old, ref, group_size=2)
    assert rollout.group_ids == [0, 0, 1, 1]
    assert [int(t.numel()) for t in rollout.tokens] == [9] * 4  # cut after the last loss token
    # entry j predicts tokens[j]: train_rl's old[:, j - 1]
    assert torch.equal(rollout.old_logprobs[1][1:], old[1, :8])
    assert rollout.old_logprobs[1][0] == 0 and torch.equal(rollout.loss_mask[1], mask[1, :9])
    mask[3] = 0.0  # a PAD row (prepare_data_for_update pads to DP x micro batch size)
    with pytest.raises(ValueError, match="no loss token"):
        rollout_from_train_rl(tokens, mask, adv, old, ref, group_size=2)


@pytest.mark.parametrize("change, message", [
    (dict(rl_inference_logprobs_is_correction=True), "--rl-inference-logprobs-is-correction"),
    (dict(per_token=False), "--calculate-per-token-loss"),
])
def test_train_rl_refusals_before_compute(megatron_env, change, message):
    from types import SimpleNamespace
    from megatron_patches.frameworks.megatron_rl import TrainRLReuse

    config = SimpleNamespace(calculate_per_token_loss=change.pop("per_token", True),
                             pipeline_model_parallel_size=1, context_parallel_size=1)
    args = SimpleNamespace(**{"rl_use_sequence_packing": False,
                              "rl_inference_logprobs_is_correction": False, **change})
    step = object()
    hooks = TrainRLReuse(args=args, train_forward_step=step, loss_func=None,
                         calculate_grpo_loss=None, group_size=2)
    pulled = []

    def data():
        pulled.append(1)
        yield _rows()

    fb = hooks.forward_backward_func(lambda **kw: pytest.fail("stock called"))
    with pytest.raises(ValueError, match=message):
        fb(forward_step_func=step, data_iterator=data(),
           model=[SimpleNamespace(config=config)], num_microbatches=1)
    assert not pulled  # refused before reading the data
    with pytest.raises(ValueError, match=message):
        hooks.compute_logprobs_batch(SimpleNamespace(config=config), pytest.fail, None, None, 4,
                                     12, 1, None, torch.float32, None, False)


def _packing_context(bin_seq_indices, loss_masks):
    """A PackingContext-shaped stand-in of two bins of 12 tokens (Megatron's field names)."""
    from types import SimpleNamespace

    seqs = [len(s) for s in bin_seq_indices]
    return SimpleNamespace(
        packing_info=SimpleNamespace(bin_seq_indices=bin_seq_indices,
                                     seq_starts={b: [0, 6][:n] + [12] for b, n in enumerate(seqs)},
                                     seq_lengths=[6] * 4),
        packed_trajs=torch.arange(24).reshape(2, 12) % 50 + 1,
        packed_loss_mask=torch.tensor(loss_masks, dtype=torch.float32),
        bin_advantages=[torch.ones(n) for n in seqs])


def _load(bin_idx, context, _is_correction):
    """Megatron's load_packed_data_by_index, reduced to the fields packed_sequences reads."""
    info = context.packing_info
    seqs = info.bin_seq_indices[bin_idx]
    return (context.packed_trajs[bin_idx:bin_idx + 1], context.bin_advantages[bin_idx], None,
            context.packed_loss_mask[bin_idx:bin_idx + 1, 1:], None, None, None,
            info.seq_starts[bin_idx], [info.seq_lengths[i] for i in seqs], seqs, None)


def test_train_rl_packed_bins_to_sequences_and_refusals(megatron_env):
    from megatron_patches.frameworks.megatron_rl import packed_sequences

    mask = [0, 0, 0, 1, 1, 1] * 2
    context = _packing_context([[0, 3], [1, 2]], [mask, mask])
    seqs = packed_sequences(context, [1, 0], _load)
    assert [(q.bin, q.start, q.length, q.index) for q in seqs] == [
        (1, 0, 6, 1), (1, 6, 6, 2), (0, 0, 6, 0), (0, 6, 6, 3)]  # bin order, sequence order
    empty = _packing_context([[0, 1], []], [mask, mask])
    with pytest.raises(ValueError, match="holds no sequence"):
        packed_sequences(empty, [0, 1], _load)
    silent = _packing_context([[0, 3], [1, 2]], [mask, [0] * 12])
    with pytest.raises(ValueError, match="no loss token"):
        packed_sequences(silent, [0, 1], _load)


def test_train_rl_other_calls_go_to_stock(megatron_env):
    from types import SimpleNamespace
    from megatron_patches.frameworks.megatron_rl import TrainRLReuse

    hooks = TrainRLReuse(args=SimpleNamespace(), train_forward_step=object(), loss_func=None,
                         calculate_grpo_loss=None, group_size=2)
    fb = hooks.forward_backward_func(lambda **kw: ("stock", kw["forward_only"]))
    assert fb(forward_step_func=lambda *a: None, data_iterator=None, model=None,
              num_microbatches=1) == ("stock", False)
    assert fb(forward_step_func=hooks.train_forward_step, data_iterator=None, model=None,
              num_microbatches=1, forward_only=True) == ("stock", True)
