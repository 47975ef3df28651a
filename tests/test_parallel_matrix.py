"""The combined layouts (4 gloo processes): TP=2 x PP=2 and DP=2 x PP=2.

Each compares prefix reuse with stock Megatron dense training under the same layout (dense =
Megatron's 1F1B pipeline schedule over full rows): loss and every gradient on every rank within
1e-5 relative (fp32), then an optimizer step on both and a second step: gradients and weights still
match.

The optimizer is SGD with momentum here: Adam divides each gradient entry by its own magnitude,
so entries whose exact value is below float noise (|g| ~ 1e-8) get O(lr) updates whose sign is
noise, in dense training too (change the microbatch split and they move). SGD keeps the weight
check a measure of our error; single-process AdamW steps are checked in test_equivalence.py.
"""

import pytest
import torch

from dist_harness import run_distributed
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
SHAPES = [(26, [6, 5, 8]), (15, [7, 4]), (33, [5, 6, 3, 4])]
BUDGET = 12


def _build(ddp: bool):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import prepare_for_training

    return prepare_for_training(build_model(TinyLlamaConfig(**MODEL)), ddp=ddp)


def _optimizer_step(model, optimizer):
    from megatron_patches.training import zero_grads

    for p in model.parameters():  # DDP keeps gradients in main_grad
        if getattr(p, "main_grad", None) is not None:
            p.grad = p.main_grad.to(p.dtype)
    optimizer.step()
    zero_grads(model)


def matrix_rank(tp: int, pp: int, ddp: bool) -> dict:
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step)
    from prefix_schedule.planning.placement import place_groups
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=tp, pp=pp)
    dense_model, reuse_model = _build(ddp), _build(ddp)
    weights = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    assert max_relative_diff(weights(dense_model), weights(reuse_model)) == 0.0
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                  for m in (dense_model, reuse_model)]
    dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_rank())
    out = {"steps": [], "last_stage": parallel_state.is_pipeline_last_stage()}
    for seed in (61, 62):
        batch = make_batch(seed, SHAPES)
        if dp > 1:
            batch = place_groups(batch, dp_size=dp, token_budget=BUDGET,
                                 max_seq_len=MODEL["max_seq_len"]).ranks[dp_rank].batch
        plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"])
        dense = dense_step(dense_model, batch, LOSS)
        reuse = reuse_step(reuse_model, batch, plan, LOSS)
        dense_grads, reuse_grads = param_grads(dense_model), param_grads(reuse_model)
        record = dict(tokens=(dense.num_tokens, reuse.num_tokens),
                      loss=(dense.loss, reuse.loss),
                      grads=max_relative_diff(dense_grads, reuse_grads),
                      missing=missing_grads(dense=dense_grads, reuse=reuse_grads))
        for model, optimizer in zip((dense_model, reuse_model), optimizers):
            _optimizer_step(model, optimizer)
        record["weights"] = max_relative_diff(weights(dense_model), weights(reuse_model))
        out["steps"].append(record)
    return out


def _check(results):
    for rank, result in enumerate(results):
        for step in result["steps"]:
            assert not step["missing"], f"rank {rank}: no (or a non-finite) gradient: {step['missing'][:5]}"
            assert step["grads"] <= 1e-5, (rank, step)
            assert step["weights"] <= 1e-5, (rank, step)
            if result["last_stage"]:
                dense_loss, reuse_loss = step["loss"]
                assert step["tokens"][0] == step["tokens"][1] > 0
                assert abs(dense_loss - reuse_loss) <= 1e-5 * abs(dense_loss), (rank, step)


def test_tp2_x_pp2():
    _check(run_distributed(matrix_rank, world_size=4, args=(2, 2, False), timeout_s=300))


def test_dp2_x_pp2_with_ddp_and_placement():
    _check(run_distributed(matrix_rank, world_size=4, args=(1, 2, True), timeout_s=300))
