"""The adapter under pipeline parallelism (PP=2, 2 gloo ranks, Megatron's 1F1B for the dense
reference): the same rollout on both stages (GRPO groups, a prefix tree with loss tokens inside
a shared node, a group that runs dense), Megatron-LM RL's per-token contract
(`(sum, num_tokens, report)`, calculate_per_token_loss=True) and verl's `x num_microbatches`
contract; reuse == the framework's dense step on every stage: every gradient within 1e-5
relative (NaN/inf fail, none missing), the reported loss on the last stage, and both stages
agree on the reuse step's microbatch count."""
import pytest

from dist_harness import run_distributed

pytestmark = pytest.mark.megatron
TOL = 1e-5


def pp_adapter_rank(per_token: bool) -> dict:
    import torch
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.frameworks import (AdapterConfig, PrefixReuseAdapter, RolloutBatch,
                                             dense_forward_backward)
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (max_relative_diff, missing_grads, param_grads,
                                           prepare_for_training, zero_grads)
    from framework_data import SMALL, grpo_sequences, rollout_arrays

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = per_token
    model.config.variable_seq_lengths = True  # the dense microbatches differ in length
    model = prepare_for_training(model, ddp=False)
    seqs, gen = grpo_sequences(23)
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    rollout = RolloutBatch(tokens=[s[0] for s in seqs], loss_mask=masks, advantages=adv,
                           old_logprobs=old, ref_logprobs=ref, group_ids=[s[2] for s in seqs])

    def terms(b):
        ratio = torch.exp(b.logprobs - b.old_logprobs)
        pg = -torch.minimum(ratio * b.advantages, ratio.clamp(0.8, 1.2) * b.advantages)
        kl = torch.exp(b.ref_logprobs - b.logprobs) - (b.ref_logprobs - b.logprobs) - 1
        return (pg + 0.05 * kl) * b.loss_mask

    def loss_fn(b):
        if per_token:
            total = terms(b).sum()
            return total, b.loss_mask.sum().int(), {"loss": torch.stack(
                [total.detach(), b.loss_mask.sum()])}
        loss = terms(b).sum() / rollout.num_loss_tokens
        return loss * b.num_microbatches, {"loss": torch.stack([loss.detach(), torch.ones(())])}

    # a small token budget: several reuse microbatches in flight in the 1F1B pipeline
    config = AdapterConfig(min_shared_len=8, node_overhead_tokens=0, min_gain=1.0,
                           token_budget=48)
    n = rollout.num_sequences
    zero_grads(model)
    dense = dense_forward_backward(model, rollout, loss_fn, config=config,
                                   micro_batches=[list(range(i, min(i + 2, n)))
                                                  for i in range(0, n, 2)])
    dense_grads = param_grads(model)
    zero_grads(model)
    reuse = PrefixReuseAdapter(model, config).forward_backward(rollout, loss_fn)
    reuse_grads = param_grads(model)

    def reported(result):
        if not result.losses_reduced:
            return None
        total = torch.stack([r["loss"] for r in result.losses_reduced]).sum(0)
        return float(total[0] / total[1]) if per_token else float(total[0])
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(),
            "diff": max_relative_diff(dense_grads, reuse_grads),
            "missing": missing_grads(dense=dense_grads, reuse=reuse_grads),
            "num_grads": len(dense_grads), "losses": (reported(dense), reported(reuse)),
            "microbatches": (dense.num_microbatches, reuse.num_microbatches),
            "report": reuse.report}


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "x_num_microbatches"])
def test_pp2_adapter_equals_framework_dense(per_token):
    results = run_distributed(pp_adapter_rank, world_size=2, args=(per_token,), timeout_s=600)
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        assert r["num_grads"] > 0 and not r["missing"], r
        assert r["diff"] <= TOL, r
    last = next(r for r in results if r["stage"] == 1)
    dense_loss, reuse_loss = last["losses"]
    assert dense_loss is not None and abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss)
    assert results[0]["microbatches"] == results[1]["microbatches"]
    assert results[0]["microbatches"][1] >= 3  # a reuse plan of several microbatches
    assert "reuse (FLOP gain" in last["report"], last["report"]
