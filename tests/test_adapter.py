"""The framework adapter (megatron_patches.frameworks): a framework's batch and loss contract in,
a prefix-reuse step out, equal to the framework's own dense step (stock Megatron over its
microbatches, same loss): gradients, reported loss, log-probs and entropy, fp32 1e-5."""
import pytest
import torch

from framework_data import (SMALL, assert_grads_equal, grpo_sequences, rollout_arrays,
                            reported_sum, run_both)

pytestmark = pytest.mark.megatron


def _rollout(seed=3, **kw):
    from megatron_patches.frameworks import RolloutBatch
    seqs, gen = grpo_sequences(seed, **kw)
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    return RolloutBatch(tokens=[s[0] for s in seqs], loss_mask=masks, advantages=adv,
                        old_logprobs=old, ref_logprobs=ref, group_ids=[s[2] for s in seqs])


def _model(per_token=False):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = per_token
    return model


def _ppo_terms(b, clip=0.2):
    ratio = torch.exp(b.logprobs - b.old_logprobs)
    pg = -torch.minimum(ratio * b.advantages, ratio.clamp(1 - clip, 1 + clip) * b.advantages)
    kl = torch.exp(b.ref_logprobs - b.logprobs) - (b.ref_logprobs - b.logprobs) - 1
    return (pg + 0.05 * kl) * b.loss_mask


def token_mean_times_microbatches(global_tokens):
    """verl / AReaL / NeMo-RL style: masked sum / global tokens, times the microbatch count."""
    def loss_fn(b):
        loss = _ppo_terms(b).sum() / global_tokens
        return loss * b.num_microbatches, {"loss": loss.detach()}
    return loss_fn


def per_token_contract(b):
    """Megatron-LM RL style: (sum, num_tokens, report) with calculate_per_token_loss=True."""
    total = _ppo_terms(b).sum()
    return total, b.loss_mask.sum().int(), {"loss": torch.stack([total.detach(), b.loss_mask.sum()])}


def _trees(**kw):
    """Small thresholds: the partial-sharing group becomes a tree with loss inside its nodes."""
    from megatron_patches.frameworks import AdapterConfig
    return AdapterConfig(min_shared_len=8, node_overhead_tokens=0, min_gain=1.0, **kw)


def _pairs(n, size=2):
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def test_plan_finds_groups_trees_and_dense(megatron_env):
    from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter
    rollout = _rollout()
    prepared = PrefixReuseAdapter(_model(), AdapterConfig(min_shared_len=8, node_overhead_tokens=0,
                                                          min_gain=1.0)).prepare(rollout)
    batch = prepared.step.batch
    sizes = sorted(len(g.trajectories) for g in batch.groups)
    assert sizes == [1, 1, 3, 4, 4], sizes  # 2 GRPO groups, the tree group, 2 lone sequences
    assert any(g.num_nodes > 1 for g in batch.groups), "the partial-sharing group is no tree"
    assert "expected speedup" in prepared.report


def test_microbatch_factor_follows_the_reuse_plan(megatron_env):
    from megatron_patches.frameworks import PrefixReuseAdapter
    rollout = _rollout()
    model = _model()
    loss_fn = token_mean_times_microbatches(rollout.num_loss_tokens)
    dense, dg, reuse, rg = run_both(model, rollout, loss_fn, config=_trees(),
                                    micro_batches=_pairs(rollout.num_sequences))
    assert any(g.num_nodes > 1 for g in PrefixReuseAdapter(model, _trees()).prepare(
        rollout).step.batch.groups)
    assert dense.num_microbatches != reuse.num_microbatches  # the factor really changes
    assert_grads_equal(dg, rg)
    assert abs(reported_sum(dense) - reported_sum(reuse)) <= 1e-5 * abs(reported_sum(dense))


def test_dense_count_in_a_reuse_step_is_caught(megatron_env):
    """The check can fail: the framework's dense microbatch count in the reuse step is wrong."""
    rollout = _rollout()
    model = _model()
    loss_fn = token_mean_times_microbatches(rollout.num_loss_tokens)
    n_dense = len(_pairs(rollout.num_sequences))

    def stale_factor(b):
        loss, report = loss_fn(b)
        return loss / b.num_microbatches * n_dense, report
    _, dg, reuse, rg = run_both(model, rollout, loss_fn, micro_batches=_pairs(rollout.num_sequences),
                                reuse_loss_fn=stale_factor, config=_trees())
    assert reuse.num_microbatches != n_dense
    with pytest.raises(AssertionError, match="relative gradient difference"):
        assert_grads_equal(dg, rg)


def test_per_token_contract(megatron_env):
    rollout = _rollout(seed=5)
    model = _model(per_token=True)
    dense, dg, reuse, rg = run_both(model, rollout, per_token_contract, config=_trees(),
                                    micro_batches=_pairs(rollout.num_sequences, 3))
    assert_grads_equal(dg, rg)
    d = sum(r["loss"] for r in dense.losses_reduced)
    r = sum(r["loss"] for r in reuse.losses_reduced)
    assert torch.allclose(d, r, rtol=1e-5) and d[1] == rollout.num_loss_tokens


def test_logprobs_entropy_and_forward_only(megatron_env):
    from megatron_patches.frameworks import (AdapterConfig, PrefixReuseAdapter,
                                             dense_forward_backward)
    rollout = _rollout(seed=7)
    model = _model()
    config = _trees(compute_entropy=True)
    dense = dense_forward_backward(model, rollout, None, micro_batches=_pairs(rollout.num_sequences),
                                   forward_only=True, config=config)
    reuse = PrefixReuseAdapter(model, config).forward_backward(rollout, None, forward_only=True)
    for i, mask in enumerate(rollout.loss_mask):
        for got, want in ((reuse.logprobs[i], dense.logprobs[i]), (reuse.entropy[i], dense.entropy[i])):
            assert torch.isfinite(got).all() and torch.isfinite(want).all()
            assert (want[mask > 0] != 0).all(), "a loss position got no value"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())


def _gspo(num_sequences):
    """A per-sequence nonlinear loss (GSPO-like sequence ratio); fails if a sequence's loss
    tokens come in two microbatches."""
    seen = set()

    def loss_fn(b):
        delta = (b.logprobs - b.old_logprobs) * b.loss_mask
        zeros = torch.zeros(num_sequences, device=delta.device)
        per_seq = zeros.index_add(0, b.sequence_index, delta)
        count = zeros.index_add(0, b.sequence_index, b.loss_mask)
        adv = zeros.index_add(0, b.sequence_index, b.advantages * b.loss_mask)
        present = (count > 0).nonzero().flatten()
        for s in present.tolist():
            assert s not in seen, f"sequence {s}'s loss tokens are split over microbatches"
            seen.add(s)
        ratio = torch.exp(per_seq[present] / count[present])
        loss = -(ratio * adv[present] / count[present]).sum() / num_sequences
        return loss * b.num_microbatches, {"loss": loss.detach()}
    return loss_fn


def test_sequence_level_loss_keeps_sequences_whole(megatron_env):
    from megatron_patches.frameworks import PrefixReuseAdapter
    rollout = _rollout(seed=9)  # the tree group trains on tokens inside shared nodes
    model = _model()
    n = rollout.num_sequences
    with pytest.raises(AssertionError, match="split over microbatches"):  # the check can fail
        PrefixReuseAdapter(model, _trees()).forward_backward(rollout, _gspo(n))
    config = _trees(sequence_level_loss=True)
    dense, dg, reuse, rg = run_both(model, rollout, _gspo(n), micro_batches=_pairs(n),
                                    config=config, reuse_loss_fn=_gspo(n))
    assert_grads_equal(dg, rg)


def test_refusals_before_compute(megatron_env):
    from megatron_patches.frameworks import PrefixReuseAdapter, RolloutBatch
    rollout = _rollout()
    model = _model()
    adapter = PrefixReuseAdapter(model)
    with pytest.raises(ValueError, match="one group id per sequence"):
        RolloutBatch(tokens=rollout.tokens, loss_mask=rollout.loss_mask, group_ids=[0])
    with pytest.raises(ValueError, match="entry 0"):
        RolloutBatch(tokens=[torch.arange(5)], loss_mask=[torch.ones(5)], group_ids=[0])
    with pytest.raises(ValueError, match="needs the framework's loss_fn"):
        adapter.forward_backward(rollout, None)
    with pytest.raises(ValueError, match="must return"):
        adapter.forward_backward(rollout, lambda b: b.logprobs.sum())
    long = RolloutBatch(tokens=[torch.arange(300) % 256] * 2, loss_mask=[torch.cat(
        [torch.zeros(1), torch.ones(299)])] * 2, group_ids=[0, 0])
    with pytest.raises(ValueError, match="max_seq_len"):
        adapter.prepare(long)


def test_bench_adapter_generic(tmp_path):
    """tools/bench.py --adapter generic on a tiny model (subprocess: it initialises Megatron):
    the JSON fields and the gradient agreement, never timings."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "adapter.json"
    args = ["--adapter", "generic", "--prefix-len", "48", "--suffix-len", "8", "--group-size", "3",
            "--num-groups", "2", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
            "176", "--num-attention-heads", "4", "--steps", "1", "--warmup", "0", "--threads", "1",
            "--overhead-groups", "4", "--overhead-group-size", "3", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(root / "tools" / "bench.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["grads_finite"] and result["max_grad_rel_diff"] <= 1e-5
    assert result["num_microbatches"]["dense"] == 6 > result["num_microbatches"]["reuse"]
    assert result["ideal_speedup"] > 1 and result["adapter_overhead_seconds"] > 0
    assert result["efficiency"] == pytest.approx(result["speedup"] / result["ideal_speedup"])
    bad = subprocess.run([sys.executable, str(root / "tools" / "bench.py"), "--adapter", "nope"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "choose one of generic, verl, megatron-rl" in bad.stderr
