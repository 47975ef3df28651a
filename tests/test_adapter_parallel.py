"""The adapter under data parallelism (2 gloo ranks, Megatron DDP): each rank runs its own groups
with the framework's global normaliser (tokens all-reduced over DP) and verl-style `x dp_size x
num_microbatches` factor; reuse == the framework's dense step on every rank (fp32 1e-5)."""
import pytest

from dist_harness import run_distributed

pytestmark = pytest.mark.megatron


def dp_adapter_rank() -> dict:
    import torch
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.frameworks import (AdapterConfig, PrefixReuseAdapter, RolloutBatch,
                                             dense_forward_backward)
    from megatron_patches.models import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (max_relative_diff, param_grads, prepare_for_training,
                                           zero_grads)
    from framework_data import SMALL, grpo_sequences, rollout_arrays

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=1)
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = False
    model = prepare_for_training(model, ddp=True)
    dp_group = parallel_state.get_data_parallel_group()
    dp, rank = torch.distributed.get_world_size(dp_group), torch.distributed.get_rank(dp_group)
    seqs, gen = grpo_sequences(21)  # the same global batch on every rank ...
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    groups = sorted({s[2] for s in seqs})
    mine = [i for i, s in enumerate(seqs) if groups.index(s[2]) % dp == rank]  # ... split by group
    rollout = RolloutBatch(tokens=[seqs[i][0] for i in mine], loss_mask=[masks[i] for i in mine],
                           group_ids=[seqs[i][2] for i in mine], advantages=[adv[i] for i in mine],
                           old_logprobs=[old[i] for i in mine], ref_logprobs=[ref[i] for i in mine])
    global_tokens = torch.tensor(float(rollout.num_loss_tokens))
    torch.distributed.all_reduce(global_tokens, group=dp_group)

    def loss_fn(b):
        ratio = torch.exp(b.logprobs - b.old_logprobs)
        pg = -torch.minimum(ratio * b.advantages, ratio.clamp(0.8, 1.2) * b.advantages)
        loss = (pg * b.loss_mask).sum() / global_tokens
        return loss * dp * b.num_microbatches, {"loss": loss.detach()}

    config = AdapterConfig(min_shared_len=8, node_overhead_tokens=0, min_gain=1.0)
    zero_grads(model)
    dense = dense_forward_backward(model, rollout, loss_fn, config=config,
                                   micro_batches=[[i] for i in range(rollout.num_sequences)])
    dense_grads = param_grads(model)
    zero_grads(model)
    reuse = PrefixReuseAdapter(model, config).forward_backward(rollout, loss_fn)
    reuse_grads = param_grads(model)
    finite = all(torch.isfinite(g).all() for g in list(dense_grads.values()) + list(reuse_grads.values()))
    return {"diff": max_relative_diff(dense_grads, reuse_grads), "finite": bool(finite),
            "nonzero": all(g.abs().max() > 0 for g in dense_grads.values()),
            "microbatches": (dense.num_microbatches, reuse.num_microbatches)}


def test_dp2_adapter_equals_framework_dense():
    results = run_distributed(dp_adapter_rank, world_size=2, timeout_s=600)
    for r in results:
        assert r["finite"] and r["nonzero"], r
        assert r["diff"] <= 1e-5, r
        assert r["microbatches"][0] != r["microbatches"][1], r


def tp_adapter_rank() -> dict:
    """TP=2: the same batch on both ranks, vocab-parallel log-probs and entropy in the loss."""
    import torch
    import megatron_patches
    from megatron_patches.frameworks import (AdapterConfig, PrefixReuseAdapter, RolloutBatch,
                                             dense_forward_backward)
    from megatron_patches.models import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (max_relative_diff, param_grads, prepare_for_training,
                                           zero_grads)
    from framework_data import SMALL, grpo_sequences, rollout_arrays

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=2)
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = False
    model = prepare_for_training(model, ddp=False)
    seqs, gen = grpo_sequences(22)
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    rollout = RolloutBatch(tokens=[s[0] for s in seqs], loss_mask=masks, advantages=adv,
                           old_logprobs=old, ref_logprobs=ref, group_ids=[s[2] for s in seqs])

    def loss_fn(b):
        ratio = torch.exp(b.logprobs - b.old_logprobs)
        pg = -torch.minimum(ratio * b.advantages, ratio.clamp(0.8, 1.2) * b.advantages)
        loss = ((pg - 0.01 * b.entropy) * b.loss_mask).sum() / rollout.num_loss_tokens
        return loss * b.num_microbatches, {"loss": loss.detach()}

    config = AdapterConfig(min_shared_len=8, node_overhead_tokens=0, min_gain=1.0,
                           compute_entropy=True)
    zero_grads(model)
    dense = dense_forward_backward(model, rollout, loss_fn, config=config,
                                   micro_batches=[[i, i + 1] for i in range(0, 12, 2)] + [[12]])
    dense_grads = param_grads(model)
    zero_grads(model)
    reuse = PrefixReuseAdapter(model, config).forward_backward(rollout, loss_fn)
    reuse_grads = param_grads(model)
    finite = all(torch.isfinite(g).all() for g in list(dense_grads.values()) + list(reuse_grads.values()))
    entropy = max(float((a - b).abs().max()) for a, b in zip(dense.entropy, reuse.entropy))
    return {"diff": max_relative_diff(dense_grads, reuse_grads), "finite": bool(finite),
            "nonzero": all(g.abs().max() > 0 for g in dense_grads.values()), "entropy": entropy}


def test_tp2_adapter_equals_framework_dense():
    results = run_distributed(tp_adapter_rank, world_size=2, timeout_s=600)
    for r in results:
        assert r["finite"] and r["nonzero"], r
        assert r["diff"] <= 1e-5 and r["entropy"] <= 1e-5, r
