"""A check that fails on one rank only refuses the step on every rank together, before any
compute, and the job stays usable ([Note: agreed refusal] in megatron_patches/runtime/agreement.py).

Each test runs a few scenarios in one gloo world of 2 ranks; in each, rank 1 alone gets bad data
(or a bad plan) and every rank must raise `StepRefused` (a ValueError) naming rank 1 and its
message, with no gradient computed. Before the agreement, rank 1 raised alone while rank 0 went
on into a collective (the expert-parallel schedule check, the DDP gradient reduction, a CP K/V
all-gather): a hang on NCCL until its timeout, here a timeout or a broken-collective error. A
good step after the refusals shows that the ranks are still in step.
"""

import pytest
import torch

from dist_harness import run_distributed
from test_equivalence import LOSS, make_batch
from test_moe_parallel import MODEL, MOE

pytestmark = pytest.mark.megatron

SHAPES = [(12, [5, 8, 3]), (9, [6, 6])]


def _bad_token(batch):
    batch.groups[0].trajectories[1].suffix[2] = MODEL["vocab_size"] + 7  # beyond the vocabulary
    return batch


def _outcome(model, run) -> dict:
    """What `run()` raised (a ValueError only: anything else fails the test on its rank)."""
    try:
        run()
    except ValueError as error:
        grads = [getattr(p, "main_grad", None) for p in model.parameters()]
        return dict(type=type(error).__name__, message=str(error),
                    computed=any(g is not None and bool(torch.count_nonzero(g)) for g in grads))
    return dict(type="no error", message="", computed=True)


def _reuse(model, batch, **plan_options):
    from megatron_patches.runtime.agreement import refuse_step
    from megatron_patches.training import reuse_step
    from prefix_schedule.planning.planner import plan_microbatches

    try:  # this rank's own planning: a refusal here joins the executor's agreement
        plan = plan_microbatches(batch, **{"token_budget": 9, "max_seq_len": 512,
                                           **plan_options})
    except ValueError as error:
        refuse_step(model, error)
    return reuse_step(model, batch, plan, LOSS)


def _good_step(model, batch) -> float:
    from megatron_patches.training import zero_grads

    zero_grads(model)
    result = _reuse(model, batch)
    assert all(torch.isfinite(p.main_grad).all() for p in model.parameters())
    return result.loss


def expert_parallel_rank(scenarios) -> dict:
    """EP=2 (the expert-parallel ranks are the 2 data-parallel ranks), MoE in every layer."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import prepare_for_training

    megatron_patches.install()
    initialize_distributed(seed=1234, ep=2)
    model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL), **MOE), ddp=True)
    bad = parallel_state.get_expert_model_parallel_rank() == 1
    out = {}
    if "bad_token" in scenarios:  # the executor's batch check on rank 1 only
        batch = make_batch(3, SHAPES)
        out["bad_token"] = _outcome(model, lambda: _reuse(model, _bad_token(batch) if bad
                                                          else batch))
    if "planning" in scenarios:  # rank 1's own planning refuses (its rows exceed max_seq_len)
        out["planning"] = _outcome(model, lambda: _reuse(
            model, make_batch(3, SHAPES), max_seq_len=16 if bad else 512))
    out["good_loss"] = _good_step(model, make_batch(4, SHAPES))
    return out


def data_parallel_rank(scenarios) -> dict:
    """DP=2 (dense model, Megatron's DDP), then CP=2 on the same 2 ranks."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import dense_step, prepare_for_training
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    out = {}
    if {"foreign_plan", "dense_bad_token"} & set(scenarios):
        initialize_distributed(seed=1234)
        model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL)), ddp=True)
        bad = parallel_state.get_data_parallel_rank() == 1
        batch = make_batch(3, SHAPES)
        if "foreign_plan" in scenarios:  # rank 1's plan belongs to another batch: it used to
            other = make_batch(3, [(12, [5, 8, 4]), (9, [6, 6])])  # fail mid-step
            plan = plan_microbatches(other if bad else batch, token_budget=9, max_seq_len=512)
            from megatron_patches.training import reuse_step

            out["foreign_plan"] = _outcome(model, lambda: reuse_step(model, batch, plan, LOSS))
        if "dense_bad_token" in scenarios:  # the dense step's own checks (stock schedule)
            out["dense_bad_token"] = _outcome(model, lambda: dense_step(
                model, _bad_token(make_batch(3, SHAPES)) if bad else batch, LOSS))
        out["good_loss"] = _good_step(model, make_batch(4, SHAPES))
    if "cp_row_multiple" in scenarios:  # rank 1 plans rows CP cannot take: its ReuseStep refuses
        initialize_distributed(seed=1234, cp=2)
        model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL)), ddp=True)
        bad = parallel_state.get_context_parallel_rank() == 1
        out["cp_row_multiple"] = _outcome(model, lambda: _reuse(
            model, make_batch(3, SHAPES), row_multiple=2 if bad else 1))
        out["cp_good_loss"] = _good_step(model, make_batch(4, SHAPES))
    return out


def pipeline_rank() -> dict:
    """PP=2: the two stages of one pipeline are given steps of different batches (a replica's
    ranks must share its step); then the same step on both runs."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import prepare_for_training

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL)), ddp=True)
    last = parallel_state.is_pipeline_last_stage()
    shapes = [(12, [5, 8, 4]), (9, [6, 6])] if last else SHAPES
    out = {"different_plans": _outcome(model, lambda: _reuse(model, make_batch(3, shapes)))}
    from megatron_patches.training import zero_grads

    zero_grads(model)
    _reuse(model, make_batch(4, SHAPES))
    out["good_step"] = all(torch.isfinite(p.main_grad).all() for p in model.parameters())
    return out


def _check_refused(results, scenario: str, rank_message: str) -> None:
    for rank, out in enumerate(results):
        got = out[scenario]
        assert got["type"] == "StepRefused", (rank, scenario, got)
        assert got["message"].startswith("rank 1 refused the step"), (rank, scenario, got)
        assert rank_message in got["message"], (rank, scenario, got)
        assert not got["computed"], (rank, scenario, "a gradient was computed")


def test_expert_parallel_rank_with_bad_data_is_refused_on_every_rank(megatron_env):
    results = run_distributed(expert_parallel_rank, world_size=2,
                              kwargs=dict(scenarios=("bad_token", "planning")),
                              timeout_s=180, collective_timeout_s=30)
    _check_refused(results, "bad_token", "vocab")
    _check_refused(results, "planning", "max_seq_len")
    assert all(out["good_loss"] == out["good_loss"] for out in results)  # finite, not NaN


def test_data_and_context_parallel_rank_with_bad_data_is_refused_on_every_rank(megatron_env):
    results = run_distributed(data_parallel_rank, world_size=2,
                              kwargs=dict(scenarios=("foreign_plan", "dense_bad_token",
                                                     "cp_row_multiple")),
                              timeout_s=240, collective_timeout_s=30)
    _check_refused(results, "foreign_plan", "the plan does not belong to this batch")
    _check_refused(results, "dense_bad_token", "vocab")
    _check_refused(results, "cp_row_multiple", "row_multiple=1")


def test_pipeline_stages_with_different_plans_are_refused_on_every_rank(megatron_env):
    """Nothing checked this before: the stages' p2p would not pair up (a hang on NCCL)."""
    results = run_distributed(pipeline_rank, world_size=2, timeout_s=180,
                              collective_timeout_s=30)
    for rank, out in enumerate(results):
        got = out["different_plans"]
        assert got["type"] == "StepRefused" and not got["computed"], (rank, got)
        assert got["message"].startswith("the ranks of data-parallel rank 0 "), (rank, got)
        assert out["good_step"], rank
