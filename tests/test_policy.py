"""The planner policy (prefix_schedule/planning/policy.py): which groups run dense, how
suffixes are packed, and that its plans train exactly like stock Megatron dense."""
import pytest
import torch

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.flops import ModelDims, ideal_speedup
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.planning.policy import ReusePolicy, group_gain, plan_with_policy

DIMS = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, gated_linear_unit=True)


def group(prefix_len, suffix_lens, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    return Group(prefix=torch.randint(0, vocab, (prefix_len,), generator=gen), trajectories=[
        Trajectory(suffix=torch.randint(0, vocab, (n,), generator=gen),
                   loss_mask=(torch.rand(n, generator=gen) > 0.2).float(),
                   advantages=torch.randn(n, generator=gen),
                   old_logprobs=-torch.rand(n, generator=gen) * 5 - 0.1,
                   ref_logprobs=-torch.rand(n, generator=gen) * 5 - 0.1) for n in suffix_lens])


def test_gain_grows_with_prefix_share_and_group_size():
    assert group_gain(DIMS, group(8, [40, 40])) < group_gain(DIMS, group(40, [8, 8]))
    assert group_gain(DIMS, group(40, [8, 8])) < group_gain(DIMS, group(40, [8] * 8))
    assert group_gain(DIMS, group(1, [5, 5])) == 1.0
    one = GroupBatch(groups=[group(40, [8] * 8)])
    plan = plan_microbatches(one, token_budget=64, max_seq_len=64)
    assert group_gain(DIMS, one.groups[0]) == pytest.approx(ideal_speedup(DIMS, one, plan))


def test_small_gain_groups_run_dense_and_it_is_said():
    batch = GroupBatch(groups=[group(40, [8] * 6, 1), group(3, [30, 33], 2), group(1, [4], 3)])
    planned = plan_with_policy(batch, policy=ReusePolicy(dims=DIMS), max_seq_len=64)
    assert planned.dense_groups == (1, 2)
    assert planned.token_budget == 4 * (40 - 1 + 8)  # four longest dense rows (group 0)
    assert all(mb.row_length <= 188 for mb in planned.plan.microbatches)
    assert [w.group for w in planned.plan.prefixes] == [0]
    text = planned.describe()
    assert "g0: reuse (FLOP gain" in text and "g1: dense (FLOP gain" in text
    assert "cannot pay its overhead" in text
    everything = plan_with_policy(batch, policy=ReusePolicy(dims=DIMS, min_gain=0.5), max_seq_len=64)
    assert everything.dense_groups == (2,)  # a 1-token prompt caches nothing: dense anyway


def test_small_gain_group_whose_rows_exceed_the_budget_keeps_the_cache():
    batch = GroupBatch(groups=[group(3, [30, 33])])
    planned = plan_with_policy(batch, policy=ReusePolicy(dims=DIMS, token_budget=33),
                               max_seq_len=64)
    assert planned.dense_groups == () and "keeps the cache" in planned.describe()


def test_planner_dense_groups_are_checked():
    batch = GroupBatch(groups=[group(10, [5, 6])])
    with pytest.raises(ValueError, match="dense_groups names group 3"):
        plan_microbatches(batch, token_budget=32, max_seq_len=32, dense_groups=[3])
    with pytest.raises(ValueError, match="token_budget >= 15"):
        plan_microbatches(batch, token_budget=8, max_seq_len=32, dense_groups=[0])
    plan = plan_microbatches(batch, token_budget=32, max_seq_len=32, dense_groups=[0])
    assert plan.prefixes == () and [s.cached_len for s in plan.microbatches[0].segments] == [0, 0]
    with pytest.raises(ValueError, match="min_gain"):
        ReusePolicy(dims=DIMS, min_gain=0)
    with pytest.raises(ValueError, match="dims"):
        ReusePolicy(dims=None)


@pytest.mark.megatron
@pytest.mark.parametrize("row_multiple", [1, 4])
def test_policy_plans_equal_stock_dense(megatron_env, row_multiple):
    """Mixed plan (a group reused, one run dense, a singleton through the cache) vs stock Megatron dense: loss and
    every gradient within 1e-5 (fp32)."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import (dense_step, max_relative_diff, param_grads,
                                           reuse_step, scale_grads_by_token_count)
    from prefix_schedule.losses import PolicyLossConfig

    cfg = TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                          num_query_groups=2, vocab_size=256, max_seq_len=128)
    model = build_model(cfg, seed=3)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = GroupBatch(groups=[group(40, [8, 5, 9, 7], 4), group(3, [30, 27], 5), group(20, [6], 6)])
    planned = plan_with_policy(batch, policy=ReusePolicy(dims=DIMS), max_seq_len=128,
                               row_multiple=row_multiple)
    assert planned.dense_groups == (1,) and [w.group for w in planned.plan.prefixes] == [0, 2]
    loss = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05)
    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, loss)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, planned.plan, loss)
    assert abs(dense.loss - reuse.loss) <= 1e-5 * abs(dense.loss)
    assert dense.num_tokens == reuse.num_tokens
    assert max_relative_diff(dense_grads, param_grads(model)) <= 1e-5
