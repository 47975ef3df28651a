"""Bad inputs on the training path: a clear ValueError before any compute, one test each."""

import pytest
import torch

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=64)


@pytest.fixture(scope="module")
def model(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    built = build_model(TinyLlamaConfig(**SMALL))
    built.config.finalize_model_grads_func = scale_grads_by_token_count
    return built


class CountingForwardStep:
    """The policy forward step, counting how often compute started."""

    def __init__(self, loss=LOSS):
        from megatron_patches.rl import make_policy_forward_step

        self.inner = make_policy_forward_step(loss)
        self.check_batch = self.inner.check_batch
        self.calls = 0

    def __call__(self, data_iterator, model):
        self.calls += 1
        return self.inner(data_iterator, model)


def _reuse_refused(model, batch, plan=None, loss=LOSS, step=None) -> str:
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse

    plan = plan or plan_microbatches(batch, token_budget=8, max_seq_len=4096)
    step = step or ReuseStep(batch, plan)
    forward_step = CountingForwardStep(loss)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError) as info:
        forward_backward_prefix_reuse(forward_step_func=forward_step, data_iterator=step,
                                      model=[model], num_microbatches=step.num_microbatches)
    assert forward_step.calls == 0, "compute ran before the input was refused"
    assert all(p.grad is None for p in model.parameters())
    return str(info.value)


def _dense_refused(model, batch, loss=LOSS) -> str:
    from megatron_patches.training import dense_step

    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError) as info:
        dense_step(model, batch, loss)
    assert all(p.grad is None for p in model.parameters()), "compute ran before the refusal"
    return str(info.value)


def _with_token(position: int, token: int) -> GroupBatch:
    batch = make_batch(3, [(6, [4, 5])])
    suffix = batch.groups[0].trajectories[1].suffix
    suffix[position] = token
    return batch


@pytest.mark.parametrize("position", [-1, 1], ids=["final label", "mid-suffix"])
def test_token_ids_outside_the_vocabulary_are_refused(model, position):
    """A final-token label >= vocab used to train on a made-up log-prob (Megatron's cross
    entropy masks out-of-range targets to 0); one mid-suffix crashed inside the embedding."""
    batch = _with_token(position, SMALL["vocab_size"])
    assert "outside [0, 256)" in _reuse_refused(model, batch)
    assert "outside [0, 256)" in _dense_refused(model, batch)
    with pytest.raises(ValueError, match="outside"):
        plan_microbatches(batch, token_budget=8, max_seq_len=64, vocab_size=256)


def test_sequences_longer_than_the_model_are_refused(model):
    """The planner's max_seq_len is the caller's word; the model's is checked too."""
    batch = make_batch(4, [(60, [3, 8])])  # 68 tokens > the model's 64
    message = _reuse_refused(model, batch, plan_microbatches(batch, token_budget=8,
                                                             max_seq_len=4096))
    assert "max_seq_len=64" in message
    assert "max_seq_len=64" in _dense_refused(model, batch)


@pytest.mark.parametrize("field, values, message", [
    ("old_logprobs", [-0.5, 0.3, -1.0], "log-probability is <= 0"),
    ("ref_logprobs", [-0.5, -1.0, 2.0], "log-probability is <= 0"),
    ("advantages", [1.0, 1e30, 0.0], "normalise the advantages"),
    ("advantages", [1.0, -1e39, 0.0], "beyond float32's range"),
    ("old_logprobs", [-0.5, -1e39, -1.0], "beyond float32's range"),
    ("advantages", [1.0, float("nan"), 0.0], "must be finite"),
    ("ref_logprobs", [-1.0, float("-inf"), -1.0], "must be finite"),
])
def test_impossible_values_are_refused(field, values, message):
    kwargs = dict(suffix=[1, 2, 3], advantages=[0.0, 0.0, 0.0])
    kwargs[field] = values
    with pytest.raises(ValueError, match=message):
        Trajectory(**kwargs)


def test_kl_without_reference_logprobs_is_refused_before_compute(model):
    batch = make_batch(5, [(8, [3, 4])], with_ref=False)
    loss = PolicyLossConfig(kl_coef=0.1)
    assert "needs ref_logprobs" in _reuse_refused(model, batch, loss=loss)
    assert "needs ref_logprobs" in _dense_refused(model, batch, loss=loss)


def test_a_reuse_step_given_to_the_stock_schedule_says_what_to_do(model):
    """Without install() or outside use_prefix_reuse_schedule, get_forward_backward_func()
    returns Megatron's own schedule; it used to report that next() was called twice."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch = make_batch(6, [(8, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=8, max_seq_len=64))
    forward_step = CountingForwardStep()
    stock = get_forward_backward_func()  # no use_prefix_reuse_schedule()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="use_prefix_reuse_schedule") as info:
        stock(forward_step_func=forward_step, data_iterator=step, model=[model],
              num_microbatches=step.num_microbatches, seq_length=0, micro_batch_size=1)
    assert "install()" in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_a_used_reuse_step_asks_for_a_new_one(model):
    from megatron_patches.training import reuse_step

    batch = make_batch(7, [(8, [3, 4])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=64)
    step = ReuseStep(batch, plan)
    reuse_step(model, batch, plan, LOSS, step=step)
    assert "build a new ReuseStep" in _reuse_refused(model, batch, plan, step=step)


def test_reuse_step_refuses_a_step_of_another_batch(model):
    from megatron_patches.training import reuse_step

    batch, other = make_batch(8, [(8, [3, 4])]), make_batch(9, [(8, [3, 4])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=64)
    for step in (ReuseStep(other, plan), ReuseStep(batch, plan_microbatches(
            batch, token_budget=5, max_seq_len=64))):
        with pytest.raises(ValueError, match="another batch or plan"):
            reuse_step(model, batch, plan, LOSS, step=step)


def test_plain_finalize_refuses_tp_partial_norm_grads(model, monkeypatch):
    """scale_grads_by_token_count does not sum q/k-norm or SP norm grads over TP ranks."""
    from megatron_patches import training

    monkeypatch.setattr(training.parallel_state, "get_tensor_model_parallel_world_size",
                        lambda: 2)
    monkeypatch.setattr(model.config, "qk_layernorm", True)
    with pytest.raises(ValueError, match="ddp=True"):
        training.prepare_for_training(model, ddp=False)
    with pytest.raises(ValueError, match="ddp=True"):
        training.scale_grads_by_token_count([model], torch.tensor(3))
