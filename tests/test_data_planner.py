"""Group data validation, greedy suffix packing and the row builders (DESIGN.md split note)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.inputs import build_dense_inputs, build_prefix_inputs, build_suffix_inputs
from prefix_schedule.planning.planner import (
    PrefixWork,
    Segment,
    StepPlan,
    SuffixMicrobatch,
    plan_microbatches,
)


def traj(n, first=10, **kw):
    kw.setdefault("advantages", 1.0)
    return Trajectory(suffix=list(range(first, first + n)), **kw)


def example_batch():
    """g0: P=4, n=3,2,4; g1: singleton P=2, n=3 (dense row 4); g2: P=1, n=2,2."""
    return GroupBatch(groups=[
        Group(prefix=[1, 2, 3, 4], trajectories=[traj(3), traj(2, loss_mask=[0, 1]), traj(4)]),
        Group(prefix=[5, 6], trajectories=[traj(3, first=20)]),
        Group(prefix=[7], trajectories=[traj(2, first=30), traj(2, first=40)]),
    ])


def layout(plan):
    return [[(s.group, s.trajectory, s.row_start, s.length, s.cached_len) for s in mb.segments]
            for mb in plan.microbatches]


# ---- data ----------------------------------------------------------------------------------------

def test_trajectory_converts_and_broadcasts():
    t = Trajectory(suffix=[3, 4, 5], advantages=0.5, old_logprobs=[-1.0, -2.0, -3.0])
    assert t.suffix.dtype == torch.int64 and t.suffix.tolist() == [3, 4, 5]
    assert t.loss_mask.tolist() == [1.0, 1.0, 1.0]
    assert t.advantages.tolist() == [0.5, 0.5, 0.5] and t.advantages.dtype == torch.float32
    assert t.ref_logprobs is None and t.num_loss_tokens == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(suffix=[1, 2], loss_mask=[1], advantages=1.0), "loss_mask has 1 entries but the suffix has 2"),
    (dict(suffix=[1, 2], loss_mask=[1, 2], advantages=1.0), "only 0 and 1"),
    (dict(suffix=[1, 2], advantages=float("nan")), "advantages[0] is nan"),
    (dict(suffix=[1, 2], advantages=[1.0, float("inf")]), "advantages[1] is inf"),
    (dict(suffix=[1, 2], advantages=1.0, old_logprobs=[0.0, float("-inf")]), "old_logprobs[1]"),
    (dict(suffix=[1, 2], advantages=1.0, ref_logprobs=[0.0]), "ref_logprobs has 1 entries"),
    (dict(suffix=[], advantages=1.0), "suffix is empty"),
    (dict(suffix=[1.5, 2.0], advantages=1.0), "must be integers"),
    (dict(suffix=[1, -2], advantages=1.0), "negative"),
    (dict(suffix=[[1, 2]], advantages=1.0), "1-D"),
])
def test_trajectory_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Trajectory(**kwargs)


def test_group_rejects_empty_prefix_and_trajectories():
    with pytest.raises(ValueError, match="prefix is empty"):
        Group(prefix=[], trajectories=[traj(1)])
    with pytest.raises(ValueError, match="no trajectories"):
        Group(prefix=[1], trajectories=[])
    with pytest.raises(ValueError, match="trajectory 1: expected a Trajectory"):
        Group(prefix=[1], trajectories=[traj(1), [1, 2]])


def test_from_full_sequences_splits_after_prefix():
    group = Group.from_full_sequences(
        sequences=[[1, 2, 3, 4], torch.tensor([1, 2, 5])], prefix_len=2,
        loss_masks=[[0, 1], [1]], advantages=[0.5, [2.0]], old_logprobs=[[-1.0, -2.0], [-3.0]])
    assert group.prefix.tolist() == [1, 2]
    a, b = group.trajectories
    assert a.suffix.tolist() == [3, 4] and a.loss_mask.tolist() == [0, 1] and a.advantages.tolist() == [0.5, 0.5]
    assert b.suffix.tolist() == [5] and b.old_logprobs.tolist() == [-3.0] and b.advantages.tolist() == [2.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(sequences=[[1, 2, 3], [1, 9, 3]], prefix_len=2, advantages=[1, 1]),
     "trajectory 1: token 1 is 9 but sequence 0 has 2"),
    (dict(sequences=[[1, 2, 3], [1, 2]], prefix_len=2, advantages=[1, 1]), "trajectory 1: .*nothing follows"),
    (dict(sequences=[[1, 2]], prefix_len=2, advantages=[1]), "trajectory 0: .*nothing follows"),
    (dict(sequences=[[1, 2, 3], [1, 2, 4]], prefix_len=2, advantages=[1]), "advantages has 1 entries for 2"),
    (dict(sequences=[[1, 2, 3], [1, 2, 4, 5]], prefix_len=2, advantages=[1, 1], loss_masks=[[1], [1]]),
     "trajectory 1: loss_mask has 1 entries but the suffix has 2 tokens"),
    (dict(sequences=[[1, 2, 3]], prefix_len=0, advantages=[1]), "prefix_len=0"),
])
def test_from_full_sequences_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Group.from_full_sequences(**kwargs)


def test_validate_names_the_long_trajectory():
    batch = example_batch()
    batch.validate(max_seq_len=8, vocab_size=42)
    with pytest.raises(ValueError, match=r"group 0, trajectory 2: prefix \(4 tokens\) \+ suffix \(4 tokens\) "
                                         r"= 8 tokens is longer than max_seq_len=7.*>= 8"):
        batch.validate(max_seq_len=7)
    with pytest.raises(ValueError, match=r"group 2, trajectory 1, suffix: token 1 has id 41, outside \[0, 41\)"):
        batch.validate(max_seq_len=8, vocab_size=41)


def test_validate_rejects_mixed_logprob_presence():
    batch = GroupBatch(groups=[Group(prefix=[1], trajectories=[traj(2, ref_logprobs=[0.0, 0.0])]),
                               Group(prefix=[1], trajectories=[traj(2)])])
    with pytest.raises(ValueError, match="group 0, trajectory 0 has ref_logprobs but group 1, trajectory 0 does not"):
        batch.validate(max_seq_len=8)


def test_num_loss_tokens_sums_masks():
    assert example_batch().num_loss_tokens == 3 + 1 + 4 + 3 + 2 + 2


# ---- planner -------------------------------------------------------------------------------------

def test_greedy_packing_by_hand():
    plan = plan_microbatches(example_batch(), token_budget=6, max_seq_len=8)
    assert layout(plan) == [
        [(0, 0, 0, 3, 3), (0, 1, 3, 2, 3)],
        [(0, 2, 0, 4, 3)],
        [(1, 0, 0, 4, 0), (2, 0, 4, 2, 0)],  # g1 runs dense (P+n-1 = 4), g2 has P == 1
        [(2, 1, 0, 2, 0)],
    ]
    assert plan.prefixes == (PrefixWork(group=0, length=3),)
    assert plan.microbatch_groups() == [(0,), (0,), (), ()]
    assert (plan.first_use(0), plan.last_use(0)) == (0, 1)
    with pytest.raises(ValueError, match="group 1 reads no cached prefix"):
        plan.first_use(1)
    text = plan.describe()
    assert "4 microbatches" in text and "g0[3]" in text and "g1t0[4 dense]" in text and "g1, g2" in text


def test_several_groups_share_a_microbatch():
    batch = GroupBatch(groups=[Group(prefix=[1, 2], trajectories=[traj(2), traj(2)]),
                               Group(prefix=[3, 4, 5], trajectories=[traj(1), traj(3)])])
    plan = plan_microbatches(batch, token_budget=100, max_seq_len=8)
    assert layout(plan) == [[(0, 0, 0, 2, 1), (0, 1, 2, 2, 1), (1, 0, 4, 1, 2), (1, 1, 5, 3, 2)]]
    assert plan.microbatch_groups() == [(0, 1)]
    assert plan.prefixes == (PrefixWork(group=0, length=1), PrefixWork(group=1, length=2))


def test_singleton_uses_cache_when_its_dense_row_does_not_fit_or_when_asked():
    batch = GroupBatch(groups=[Group(prefix=[5, 6, 7], trajectories=[traj(3)])])
    assert layout(plan_microbatches(batch, token_budget=5, max_seq_len=8)) == [[(0, 0, 0, 5, 0)]]
    small = plan_microbatches(batch, token_budget=4, max_seq_len=8)
    assert layout(small) == [[(0, 0, 0, 3, 2)]] and small.prefixes == (PrefixWork(group=0, length=2),)
    off = plan_microbatches(batch, token_budget=5, max_seq_len=8, run_singletons_dense=False)
    assert layout(off) == [[(0, 0, 0, 3, 2)]]


def test_plan_rejects_bad_budgets_and_lengths():
    with pytest.raises(ValueError, match=r"token_budget=3 is smaller than the longest row: group 0, "
                                         r"trajectory 2 needs 4 tokens; use token_budget >= 4"):
        plan_microbatches(example_batch(), token_budget=3, max_seq_len=8)
    with pytest.raises(ValueError, match="token_budget=0"):
        plan_microbatches(example_batch(), token_budget=0, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len=6"):
        plan_microbatches(example_batch(), token_budget=6, max_seq_len=6)
    assert len(plan_microbatches(example_batch(), token_budget=4, max_seq_len=8).microbatches) == 5


def test_step_plan_rejects_inconsistent_plans():
    seg = Segment(group=0, trajectory=0, row_start=0, length=3, cached_len=2)
    mb = SuffixMicrobatch(index=0, segments=(seg,))
    with pytest.raises(ValueError, match="over the token budget"):
        StepPlan(microbatches=(mb,), prefixes=(PrefixWork(group=0, length=2),), token_budget=2)
    with pytest.raises(ValueError, match="one PrefixWork"):
        StepPlan(microbatches=(mb,), prefixes=(), token_budget=3)
    with pytest.raises(ValueError, match="expected 0"):
        SuffixMicrobatch(index=0, segments=(Segment(group=0, trajectory=0, row_start=1, length=1, cached_len=0),))


# ---- row builders --------------------------------------------------------------------------------

def test_suffix_row_by_hand():
    batch = example_batch()
    plan = plan_microbatches(batch, token_budget=6, max_seq_len=8)
    row = build_suffix_inputs(batch, plan.microbatches[0])
    assert set(row) == {"tokens", "position_ids", "labels", "loss_mask", "advantages"}
    # [prefix[-1], suffix[:-1]] at positions P-1.., labels = suffix (DESIGN split note).
    assert row["tokens"].tolist() == [[4, 10, 11, 4, 10]]
    assert row["position_ids"].tolist() == [[3, 4, 5, 3, 4]]
    assert row["labels"].tolist() == [[10, 11, 12, 10, 11]]
    assert row["loss_mask"].tolist() == [[1, 1, 1, 0, 1]]
    assert row["tokens"].dtype == torch.int64 and row["loss_mask"].dtype == torch.float32
    dense_mb = build_suffix_inputs(batch, plan.microbatches[2])
    assert dense_mb["tokens"].tolist() == [[5, 6, 20, 21, 7, 30]]
    assert dense_mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]
    assert dense_mb["labels"].tolist() == [[6, 20, 21, 22, 30, 31]]
    assert dense_mb["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1]]
    prefix = build_prefix_inputs(batch, plan.prefixes[0])
    assert prefix["tokens"].tolist() == [[1, 2, 3]] and prefix["position_ids"].tolist() == [[0, 1, 2]]


def test_dense_row_by_hand_and_logprob_keys():
    g = Group(prefix=[1, 2, 3], trajectories=[traj(2, advantages=[0.5, -1.0], old_logprobs=[-0.1, -0.2],
                                                    ref_logprobs=[-0.3, -0.4])])
    row = build_dense_inputs(GroupBatch(groups=[g]), 0, 0)
    assert row["tokens"].tolist() == [[1, 2, 3, 10]] and row["labels"].tolist() == [[2, 3, 10, 11]]
    assert row["loss_mask"].tolist() == [[0, 0, 1, 1]]
    assert row["advantages"].tolist() == [[0, 0, 0.5, -1.0]]
    assert torch.allclose(row["old_logprobs"], torch.tensor([[0, 0, -0.1, -0.2]]))
    assert torch.allclose(row["ref_logprobs"], torch.tensor([[0, 0, -0.3, -0.4]]))


@st.composite
def batches(draw):
    groups = []
    for g in range(draw(st.integers(1, 4))):
        prefix = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6))
        trajectories = [
            Trajectory(suffix=draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)),
                       loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
                       advantages=draw(st.floats(-2, 2)))
            for n in draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))]
        groups.append(Group(prefix=prefix, trajectories=trajectories))
    return GroupBatch(groups=groups)


@settings(max_examples=60, deadline=None)
@given(batch=batches(), extra=st.integers(0, 12), singletons=st.booleans())
def test_plan_covers_in_order_and_rows_rebuild_the_dense_rows(batch, extra, singletons):
    budget = max(t.num_tokens for g in batch.groups for t in g.trajectories) + extra
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=12, run_singletons_dense=singletons)
    order = [(s.group, s.trajectory) for mb in plan.microbatches for s in mb.segments]
    assert order == [(g, t) for g, grp in enumerate(batch.groups) for t in range(len(grp.trajectories))]
    for prev, nxt in zip(plan.microbatches, plan.microbatches[1:]):  # greedy: next one did not fit
        assert prev.num_tokens + nxt.segments[0].length > budget
    prefixes = {w.group: build_prefix_inputs(batch, w) for w in plan.prefixes}
    for mb in plan.microbatches:
        row = build_suffix_inputs(batch, mb)
        for s in mb.segments:
            dense = build_dense_inputs(batch, s.group, s.trajectory)
            part = {k: v[:, s.row_start:s.row_start + s.length] for k, v in row.items()}
            cached = prefixes[s.group] if s.cached_len else {"tokens": dense["tokens"][:, :0],
                                                               "position_ids": dense["position_ids"][:, :0]}
            for key in ("tokens", "position_ids"):
                assert torch.equal(torch.cat([cached[key], part[key]], dim=1), dense[key])
            for key in ("labels", "loss_mask", "advantages"):
                assert torch.equal(part[key], dense[key][:, s.cached_len:])
                assert not dense["loss_mask"][:, :s.cached_len].any()
