"""DP placement: whole groups balanced by LPT, splits only when needed, refusals, invariants.

Costs in these tests are "tokens run" (no model dims): a group planned alone with the cache costs
(P-1) + sum of its suffix lengths; a group of one trajectory runs dense: P-1+n.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.flops import ModelDims, reuse_flops
from prefix_schedule.planning.placement import place_groups
from prefix_schedule.planning.planner import plan_microbatches

DIMS = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, gated_linear_unit=True)


def group(prefix_len, *suffix_lens):
    return Group(prefix=list(range(1, prefix_len + 1)),
                 trajectories=[Trajectory(suffix=[5] * n, advantages=1.0) for n in suffix_lens])


def place(batch, dp_size, **kwargs):
    return place_groups(batch, dp_size=dp_size, token_budget=kwargs.pop("token_budget", 64),
                        max_seq_len=512, **kwargs)


def layout(placement):
    return [[(s.group, s.trajectories) for s in shard.shares] for shard in placement.ranks]


def test_one_rank_gets_the_batch_itself():
    batch = GroupBatch(groups=[group(9, 3, 4), group(5, 2, 2, 2)])
    placement = place(batch, 1)
    assert layout(placement) == [[(0, (0, 1)), (1, (0, 1, 2))]]
    assert all(a is b for a, b in zip(placement.ranks[0].batch.groups, batch.groups))
    assert placement.imbalance == 1.0 and placement.split_groups == {}


def test_lpt_places_whole_groups_by_cost():
    # costs: g0 = 8+12 = 20, g1 = 4+8 = 12, g2 = 6+9 = 15, g3 = 2+4 = 6 (mean 26.5 over 2 ranks)
    batch = GroupBatch(groups=[group(9, 6, 6), group(5, 4, 4), group(7, 3, 3, 3), group(3, 2, 2)])
    placement = place(batch, 2)
    # LPT: g0 -> r0 (20), g2 -> r1 (15), g1 -> r1 (27), g3 -> r0 (26)
    assert layout(placement) == [[(0, (0, 1)), (3, (0, 1))], [(1, (0, 1)), (2, (0, 1, 2))]]
    assert [r.cost for r in placement.ranks] == [26.0, 27.0]
    assert placement.imbalance == pytest.approx(27 / 26.5)
    assert placement.split_groups == {}
    assert placement.ranks[1].batch.groups[1] is batch.groups[2]  # whole groups are not copied
    assert placement.num_loss_tokens == batch.num_loss_tokens


def test_more_ranks_than_groups_splits_and_says_so():
    batch = GroupBatch(groups=[group(21, 5, 5, 5, 5), group(4, 3, 3)])
    placement = place(batch, 3)
    assert layout(placement) == [[(0, (0, 1))], [(0, (2, 3))], [(1, (0, 1))]]
    assert placement.split_groups == {0: (0, 1)}
    text = placement.describe()
    assert "group 0 split over ranks 0,1: its prefix runs once per rank" in text
    assert "rank 0: cost 30 " in text and "g0[t0,1]" in text and "imbalance" in text
    part = placement.ranks[1].batch.groups[0]
    assert part is not batch.groups[0] and part.trajectories[0] is batch.groups[0].trajectories[2]
    assert part.prefix.tolist() == batch.groups[0].prefix.tolist()


def test_a_group_far_above_the_mean_is_split():
    # g0 costs 40 + 8*10 = 120, the other three 15 each: mean per rank 82.5 over 2 ranks
    batch = GroupBatch(groups=[group(41, *[10] * 8), group(6, 5, 5), group(6, 5, 5), group(6, 5, 5)])
    placement = place(batch, 2)
    assert placement.split_groups == {0: (0, 1)}
    assert layout(placement)[0][0] == (0, (0, 1, 2, 3)) and layout(placement)[1][0] == (0, (4, 5, 6, 7))
    assert placement.imbalance < 1.1
    assert place(batch, 2, split_above=2.0).split_groups == {}  # 120 < 2 x 82.5: kept whole


def test_a_split_that_does_not_lower_the_makespan_is_not_made():
    # g0 = 20 + 20 = 40 > mean 30, but its halves run dense (30 each): makespan 50 > 40
    batch = GroupBatch(groups=[group(21, 10, 10), group(11, 5, 5)])
    placement = place(batch, 2)
    assert placement.split_groups == {} and [r.cost for r in placement.ranks] == [40.0, 20.0]


def test_equal_groups_stay_whole_even_if_unbalanced():
    batch = GroupBatch(groups=[group(11, 5, 5, 5)] * 3)
    placement = place(batch, 2)
    assert placement.split_groups == {} and placement.imbalance == pytest.approx(4 / 3)


def test_flop_costs_are_reuse_flops_of_each_share_alone():
    batch = GroupBatch(groups=[group(30, 6, 9, 4), group(12, 8), group(20, 5, 5)])
    placement = place(batch, 2, dims=DIMS, token_budget=16)
    assert placement.cost_unit == "flops"
    for shard in placement.ranks:
        for share, g in zip(shard.shares, shard.batch.groups):
            plan = plan_microbatches(GroupBatch(groups=[g]), token_budget=16, max_seq_len=512)
            assert share.cost == reuse_flops(DIMS, plan)
        assert shard.cost == sum(s.cost for s in shard.shares)


def test_deterministic():
    batch = GroupBatch(groups=[group(p, *([4 + p % 3] * (1 + p % 4))) for p in range(2, 14)])
    first, second = place(batch, 4, dims=DIMS), place(batch, 4, dims=DIMS)
    assert layout(first) == layout(second) and first.describe() == second.describe()


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_size=0), "dp_size=0"),
    (dict(dp_size=True), "dp_size=True"),
    (dict(dp_size=6), "fewer than dp_size=6"),
    (dict(dp_size=2, split_above=0), "split_above"),
    (dict(dp_size=2, token_budget=3), "group 1, trajectory 0"),
    (dict(dp_size=2, dims="big"), "ModelDims"),
])
def test_refusals(kwargs, message):
    batch = GroupBatch(groups=[group(8, 3, 3), group(5, 4, 2), group(4, 3)])
    kwargs = {"token_budget": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        place_groups(batch, max_seq_len=512, **kwargs)


def test_empty_batch_is_refused():
    batch = GroupBatch(groups=[group(3, 2)])
    batch.groups.clear()
    with pytest.raises(ValueError, match="non-empty GroupBatch"):
        place(batch, 1)
    with pytest.raises(ValueError, match="non-empty GroupBatch"):
        place([group(3, 2)], 1)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 30), st.lists(st.integers(1, 12), min_size=1, max_size=6)),
                       min_size=1, max_size=6),
       dp_size=st.integers(1, 6), split_above=st.sampled_from([0.5, 1.0, 3.0]))
def test_every_trajectory_placed_once(shapes, dp_size, split_above):
    batch = GroupBatch(groups=[group(p, *ns) for p, ns in shapes])
    if sum(len(ns) for _, ns in shapes) < dp_size:
        with pytest.raises(ValueError, match="fewer than dp_size"):
            place(batch, dp_size)
        return
    placement = place(batch, dp_size, split_above=split_above)
    seen = []
    for shard in placement.ranks:
        assert shard.shares, "a rank got no work"
        groups = [s.group for s in shard.shares]
        assert groups == sorted(set(groups)), "a group twice on one rank, or out of order"
        for share, g in zip(shard.shares, shard.batch.groups):
            source = batch.groups[share.group]
            assert [t for t in g.trajectories] == [source.trajectories[i] for i in share.trajectories]
            assert (g is source) == (share.group not in placement.split_groups)
            seen += [(share.group, t) for t in share.trajectories]
    assert sorted(seen) == [(g, t) for g, (_, ns) in enumerate(shapes) for t in range(len(ns))]
    for g, ranks in placement.split_groups.items():
        assert ranks == tuple(r for r, s in enumerate(placement.ranks) if g in [x.group for x in s.shares])
        assert len(ranks) > 1
    assert placement.num_loss_tokens == batch.num_loss_tokens
