"""Prefix reuse inside real Megatron: DDP + finalize_model_grads, selective recompute, forward-only,
schedule selection and refusals (ValueError before any compute)."""

import pytest
import torch

from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS, TOL, assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


def _model(**overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(**SMALL), **overrides)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


def test_ddp_wrapped_model_with_megatron_finalize(megatron_env):
    """Megatron's DDP wrapper (fp32 main_grad buffers) and its finalize_model_grads, which
    divides by the token count summed over microbatches and data-parallel ranks."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    ddp = DistributedDataParallel(_model().config, DistributedDataParallelConfig(), _model())
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    batch = make_batch(5, [(26, [5, 8, 3]), (14, [6, 6])])
    ddp.zero_grad_buffer()
    dense = dense_step(ddp, batch, LOSS)
    dense_grads = param_grads(ddp)
    ddp.zero_grad_buffer()
    reuse = reuse_step(ddp, batch, plan_microbatches(batch, token_budget=9, max_seq_len=512), LOSS)
    reuse_grads = param_grads(ddp)
    assert dense.num_tokens == reuse.num_tokens
    assert abs(dense.loss - reuse.loss) <= TOL * abs(dense.loss)
    assert max_relative_diff(dense_grads, reuse_grads) <= TOL


def test_selective_core_attention_recompute(megatron_env):
    """The attention hook also runs inside recompute (backward); contexts must be set there."""
    model = _model(recompute_granularity="selective", recompute_modules=["core_attn"])
    assert model.decoder.layers[0].self_attention.checkpoint_core_attention
    batch = make_batch(6, [(30, [7, 4, 9]), (12, [5])])
    assert_equal_step(*run_both(model, batch, 12, run_singletons_dense=False)[:4])


def test_forward_only_matches_dense_and_frees_the_cache(megatron_env):
    from megatron_patches.training import dense_step, reuse_step

    model = _model()
    batch = make_batch(8, [(20, [6, 3, 5])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=512)
    step = ReuseStep(batch, plan)
    with torch.no_grad():
        dense = dense_step(model, batch, LOSS, forward_only=True)
        reuse = reuse_step(model, batch, plan, LOSS, forward_only=True, step=step)
    assert abs(dense.loss - reuse.loss) <= TOL * abs(dense.loss)
    assert step.cache.live_groups() == ()
    assert all(p.grad is None for p in model.parameters())


def test_schedule_is_selected_through_megatron(megatron_env):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    import megatron_patches
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse

    assert get_forward_backward_func() is forward_backward_no_pipelining
    with megatron_patches.use_prefix_reuse_schedule():
        assert get_forward_backward_func() is forward_backward_prefix_reuse
    assert get_forward_backward_func() is forward_backward_no_pipelining


def _call_reuse(model, data_iterator, num_microbatches):
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse
    from megatron_patches.rl import make_policy_forward_step

    calls = []

    def forward_step(it, m):
        calls.append(1)
        return make_policy_forward_step(LOSS)(it, m)

    with pytest.raises(ValueError) as info:
        forward_backward_prefix_reuse(forward_step_func=forward_step, data_iterator=data_iterator,
                                      model=[model], num_microbatches=num_microbatches)
    assert not calls, "compute ran before the input was refused"
    return str(info.value)


@pytest.mark.parametrize("override, message", [
    (dict(hidden_dropout=0.1), "dropout"),
    (dict(attention_dropout=0.1), "dropout"),
    (dict(calculate_per_token_loss=False), "calculate_per_token_loss"),
])
def test_settings_that_break_exactness_are_refused(megatron_env, override, message):
    model = _model(**override)
    batch = make_batch(9, [(10, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=8, max_seq_len=512))
    assert message in _call_reuse(model, step, step.num_microbatches)


def test_wrong_iterator_and_microbatch_count_are_refused(megatron_env):
    model = _model()
    batch = make_batch(10, [(10, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=4, max_seq_len=512))
    assert "ReuseStep" in _call_reuse(model, iter([{}]), 1)
    assert "num_microbatches" in _call_reuse(model, step, step.num_microbatches + 1)


def test_position_embeddings_that_are_not_hooked_are_refused(megatron_env):
    model = _model()
    model.position_embedding_type = "yarn"  # as a yarn model would report it
    batch = make_batch(12, [(10, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=8, max_seq_len=512))
    assert "yarn" in _call_reuse(model, step, step.num_microbatches)


def test_prefix_activation_offload_keeps_the_math(megatron_env):
    """Phase A's saved tensors wait in host memory until Phase C ([Note: prefix activation
    offload]): parameters and cached K/V never copied, every unit prefetched, same gradients."""
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    model = _model()
    batch = make_batch(13, [(30, [6, 5, 7]), (18, [4, 9])])
    plan = plan_microbatches(batch, token_budget=10, max_seq_len=512, prefix_chunk_tokens=12)
    dense_step(model, batch, LOSS)
    dense = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse_step(model, batch, plan, LOSS)
    plain = param_grads(model)
    model.zero_grad(set_to_none=True)
    step = ReuseStep(batch, plan, offload_prefix_activations=True)
    reuse_step(model, batch, plan, LOSS, step=step)
    offloader = step.offloader
    assert offloader.stats["offloaded_bytes"] > 0 and offloader.stats["kept_params"] > 0
    assert offloader.pending_units() == (), "every prefix unit was prefetched for its Phase C"
    assert offloader.pool.in_use_bytes == 0 and list(offloader.resident_tensors()) == []
    assert max_relative_diff(dense, param_grads(model)) <= TOL
    assert all(torch.equal(plain[n], g) for n, g in param_grads(model).items()), (
        "offload copies bits in their layout: gradients equal those without offload exactly")


def test_forward_step_func_may_leave_the_item_unread(megatron_env):
    """Megatron's get_batch reads the iterator on TP rank 0 only and broadcasts: a rank whose
    forward_step_func never calls next() must still run the step exactly."""
    from functools import partial

    from megatron_patches import rl
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    model = _model()
    batch = make_batch(14, [(22, [5, 7]), (9, [4])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=512, run_singletons_dense=False)
    dense_step(model, batch, LOSS)
    dense = param_grads(model)
    model.zero_grad(set_to_none=True)
    step = ReuseStep(batch, plan)
    # what TP rank 0 would broadcast: each forward's item, built apart from the iterator
    from prefix_schedule.planning.inputs import build_prefix_inputs, build_suffix_inputs
    units = plan.prefix_units()
    copies = iter([build_prefix_inputs(batch, units[a.index]) if a.kind.value == "PF"
                   else build_suffix_inputs(batch, plan.microbatches[a.index])
                   for a in step.schedule.actions[0] if a.kind.value in ("PF", "SF")])

    def forward_step(data_iterator, m):
        del data_iterator  # never read, like a TP rank > 0
        item = next(copies)
        out = m(item["tokens"], item["position_ids"], None)
        return out, (partial(rl._policy_loss, item, LOSS) if "labels" in item else None)

    from megatron_patches.runtime.executor import forward_backward_prefix_reuse
    forward_backward_prefix_reuse(forward_step_func=forward_step, data_iterator=step,
                                  model=[model], num_microbatches=step.num_microbatches)
    assert max_relative_diff(dense, param_grads(model)) <= TOL
