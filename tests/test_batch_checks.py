"""[Note: checks at step build]: a batch edited after it was built, or a plan that is not
exactly its plan, is refused when the step is built (ReuseStep, the planner, the dense path)."""
import copy

import pytest

from prefix_schedule.planning.batch_checks import check_batch_arrays, check_plan_covers, validate_batch
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS, make_batch

EDITS = {
    "nan advantage": (lambda tr: tr.advantages.__setitem__(1, float("nan")),
                      "group 1: trajectory 0: advantages\\[1\\] is nan"),
    "half loss mask": (lambda tr: tr.loss_mask.__setitem__(0, 0.5),
                       "group 1: trajectory 0: loss_mask\\[0\\] is 0.5, not 0 or 1"),
    "inf old logprob": (lambda tr: tr.old_logprobs.__setitem__(2, float("-inf")),
                        "old_logprobs\\[2\\] is -inf"),
    "positive ref logprob": (lambda tr: tr.ref_logprobs.__setitem__(0, 0.5),
                             "ref_logprobs\\[0\\] is 0.5"),
    "huge advantage": (lambda tr: tr.advantages.__setitem__(0, 1e30), "normalise"),
    "shorter mask": (lambda tr: setattr(tr, "loss_mask", tr.loss_mask[:-1]),
                     "loss_mask has 3 entries but the suffix has 4"),
}


def _batch():
    return make_batch(3, [(6, [4, 5]), (5, [4, 3, 6])])


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_arrays_edited_in_place_are_refused_when_the_step_is_built(edit):
    batch = _batch()
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=64)
    ReuseStep(batch, plan)  # fine before the edit
    change, message = EDITS[edit]
    change(batch.groups[1].trajectories[0])
    with pytest.raises(ValueError, match=message):
        ReuseStep(batch, plan)
    with pytest.raises(ValueError, match=message):
        plan_microbatches(batch, token_budget=16, max_seq_len=64)
    with pytest.raises(ValueError, match=message):
        validate_batch(batch, max_seq_len=64)


def test_a_plan_of_another_batch_is_refused():
    batch = _batch()
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=64)
    fewer = make_batch(3, [(6, [4, 5])])
    with pytest.raises(ValueError, match="which the batch does not have"):
        ReuseStep(fewer, plan)
    more = make_batch(3, [(6, [4, 5]), (5, [4, 3, 6]), (4, [2, 2])])
    with pytest.raises(ValueError, match="runs 5 of the batch's 7 trajectories .group 2, "
                                         "trajectory 0"):
        ReuseStep(more, plan)
    other_prefix = make_batch(3, [(7, [3, 5]), (5, [4, 3, 6])])  # same row lengths, P differs
    with pytest.raises(ValueError, match="plan this batch again"):
        ReuseStep(other_prefix, plan)


@pytest.mark.parametrize("change", ["trajectory", "group"])
def test_a_batch_grown_after_planning_is_refused(change):
    """Issue 22: an appended trajectory or group used to run, silently untrained."""
    batch = _batch()
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=64)
    step = ReuseStep(batch, plan)
    extra = make_batch(4, [(5, [3])]).groups[0]
    if change == "trajectory":
        batch.groups[1].trajectories.append(copy.deepcopy(batch.groups[1].trajectories[0]))
    else:
        batch.groups.append(extra)
    with pytest.raises(ValueError, match="runs 5 of the batch's 6 trajectories"):
        step.check()  # the executor's agreed check: grown after the step was built
    with pytest.raises(ValueError, match="runs 5 of the batch's 6 trajectories"):
        ReuseStep(batch, plan)


def test_a_plan_that_runs_a_trajectory_twice_is_refused():
    from prefix_schedule.planning.planner import StepPlan, SuffixMicrobatch

    batch = make_batch(3, [(6, [4, 4])])
    plan = plan_microbatches(batch, token_budget=4, max_seq_len=64)
    first = plan.microbatches[0]
    twice = StepPlan(microbatches=(first, SuffixMicrobatch(index=1, segments=first.segments)),
                     prefixes=plan.prefixes, token_budget=4)
    with pytest.raises(ValueError, match="appears in microbatches 0 and 1"):
        check_plan_covers(batch, twice)


def test_a_non_trajectory_appended_is_refused():
    batch = _batch()
    batch.groups[0].trajectories.append({"suffix": [1, 2]})
    with pytest.raises(ValueError, match="group 0: trajectory 2: expected a Trajectory"):
        check_batch_arrays(batch)


@pytest.mark.megatron
def test_dense_step_refuses_an_edited_batch_before_compute(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import dense_step, scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64,
                                        num_attention_heads=2, num_query_groups=1,
                                        vocab_size=256, max_seq_len=64))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = _batch()
    batch.groups[0].trajectories[1].advantages[0] = float("nan")
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="group 0: trajectory 1: advantages\\[0\\] is nan"):
        dense_step(model, batch, LOSS)
    assert all(p.grad is None for p in model.parameters())


def test_context_loss_arrays_edited_in_place_are_refused():
    from tree_batches import make_tree_batch

    batch = make_tree_batch(5, [dict(depth=2, branching=2, node_len=5, suffix_len=4,
                                     node_loss=True)])
    plan = plan_microbatches(batch, token_budget=64, max_seq_len=64)
    ReuseStep(batch, plan)
    loss = batch.groups[0].trajectories[1].context_loss
    before = loss.advantages
    loss.advantages[2] = float("inf")
    with pytest.raises(ValueError, match="group 0: trajectory 1: context advantages\\[2\\] is inf"):
        ReuseStep(batch, plan)
    assert loss.advantages is before  # checked, not converted in place
    loss.advantages[2] = 0.0
    loss.loss_mask[0] = 1.0
    with pytest.raises(ValueError, match="0 at entry 0"):
        validate_batch(batch, max_seq_len=64)
