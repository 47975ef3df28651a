"""Prefix trees without a model ([Note: prefix trees] in prefix_schedule/planning/tree.py): the
data model's refusals, the plan's units and chains, the schedule rules (validator, generator,
lowering, NCCL simulator) over trees on 1-4 stages, and the cache's child-before-parent rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.planning.data import Group, GroupBatch, PrefixNode, Trajectory
from prefix_schedule.planning.inputs import build_dense_inputs, build_prefix_inputs
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.pipeline import ScheduleError, build_schedule, lower, simulate, validate_schedule
from prefix_schedule.runtime.cache import CacheProtocolError, PrefixKVCache
from prefix_schedule.runtime.step import ReuseStep
from tree_batches import make_tree_batch


def _tr(n, node=0):
    return Trajectory(suffix=list(range(1, n + 1)), advantages=1.0, node=node)


def test_tree_refusals():
    with pytest.raises(ValueError, match="parent < node index"):
        Group(prefix=[1, 2], nodes=[PrefixNode(parent=1, tokens=[3, 4])], trajectories=[_tr(2)])
    with pytest.raises(ValueError, match="nodes 0..1"):
        Group(prefix=[1, 2], nodes=[PrefixNode(parent=0, tokens=[3, 4])],
              trajectories=[_tr(2, node=2)])
    with pytest.raises(ValueError, match="lead to no trajectory"):
        Group(prefix=[1, 2], nodes=[PrefixNode(parent=0, tokens=[3, 4])], trajectories=[_tr(2)])
    with pytest.raises(ValueError, match="1-token leaf"):
        Group(prefix=[1, 2], nodes=[PrefixNode(parent=0, tokens=[3])],
              trajectories=[_tr(2, node=1)])
    with pytest.raises(ValueError, match="node="):
        _tr(2, node=-1)


def test_tree_rows_units_and_chains():
    # root [10 11 12] -> node 1 [20 21] -> node 2 [30 31 32]; trajectories after nodes 0, 1, 2
    group = Group(prefix=[10, 11, 12], nodes=[PrefixNode(parent=0, tokens=[20, 21]),
                                              PrefixNode(parent=1, tokens=[30, 31, 32])],
                  trajectories=[_tr(2, 0), _tr(3, 1), _tr(2, 2), _tr(1, 2)])
    batch = GroupBatch(groups=[group])
    dense = build_dense_inputs(batch, 0, 2)
    assert dense["tokens"][0].tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 1]
    assert dense["loss_mask"][0].tolist() == [0.0] * 7 + [1.0, 1.0]
    plan = plan_microbatches(batch, token_budget=4, max_seq_len=64)
    units = plan.prefix_units()
    # nodes with children cache all their tokens, the leaf node all but its last
    assert [(c.node, c.start, c.length, c.parent_chunk) for c in units.values()] == [
        (0, 0, 3, None), (1, 3, 2, 0), (2, 5, 2, 1)]
    assert build_prefix_inputs(batch, units[2])["tokens"][0].tolist() == [30, 31]
    assert plan.chain_chunks(0, 1) == (0, 1)
    cached = {s.trajectory: s.cached_len for mb in plan.microbatches for s in mb.segments}
    assert cached == {0: 2, 1: 4, 2: 7, 3: 7}
    chunked = plan_microbatches(batch, token_budget=4, max_seq_len=64, prefix_chunk_tokens=2)
    assert [(c.node, c.start, c.length, c.parent_chunk)
            for c in chunked.prefix_units().values()] == [
        (0, 0, 2, None), (0, 2, 1, 0), (1, 3, 2, 1), (2, 5, 2, 2)]


def test_branching_units_are_a_tree_and_siblings_do_not_read_each_other():
    batch = make_tree_batch(3, [dict(depth=3, branching=2, node_len=5, suffix_len=3)])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=128)
    step = ReuseStep(batch, plan, num_stages=2)
    parents = {c.chunk: c.parent_chunk for c in plan.prefix_units().values()}
    assert parents == {0: None, 1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}
    context = step.prefix_context(5, stop_after_layer=None)
    group = batch.groups[0]  # unit 5 is node 5, under node 2
    assert group.chain(5) == (0, 2, 5) and context.reads == (0, 2)
    assert context.position_offset == group.prefix_len + group.node_tokens(2).numel()


def _rules(step):
    units = {u: (c.group, c.chunk) for u, c in step.plan.prefix_units().items()}
    unit_of = {v: u for u, v in units.items()}
    parents = {u: (None if c.parent_chunk is None else unit_of[c.group, c.parent_chunk])
               for u, c in step.plan.prefix_units().items()}
    return dict(microbatch_groups=step.plan.microbatch_groups(),
                prefix_groups=[w.group for w in step.plan.prefixes], prefix_units=units,
                unit_parents=parents)


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(1, 4), branching=st.integers(1, 4), stages=st.integers(1, 4),
       chunk=st.sampled_from([None, 3]), budget=st.integers(6, 20), seed=st.integers(0, 99),
       virtual=st.sampled_from([1, 2]), state_reads=st.booleans())
def test_every_tree_plan_validates_lowers_and_simulates(depth, branching, stages, chunk, budget,
                                                         seed, virtual, state_reads):
    """On 1-4 ranks, with and without virtual stages (2 model chunks per rank), with and without
    the units StepPlan.state_reads cuts."""
    virtual = virtual if stages > 1 else 1
    batch = make_tree_batch(seed, [dict(depth=depth, branching=branching, node_len=5,
                                        suffix_len=4, inner=seed % 2),
                                   dict(depth=2, branching=2, node_len=4, suffix_len=3)])
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512,
                             prefix_chunk_tokens=chunk, state_reads=state_reads)
    step = ReuseStep(batch, plan, num_stages=stages, num_model_chunks=virtual)
    validate_schedule(step.schedule, **_rules(step))
    validate_schedule(step.lowered, **_rules(step))
    simulate(step.lowered)  # raises on deadlock or a p2p mismatch


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(1, 4), branching=st.integers(1, 3), chunk=st.sampled_from([None, 2, 5]),
       seed=st.integers(0, 99))
def test_state_reads_cut_units_exactly_where_readers_stop(depth, branching, chunk, seed):
    """StepPlan.state_reads: every reader's cached length is the end of a unit of its chain (a
    recurrent layer's state exists there); the units of a node still tile its cached span, at
    most `chunk` long; the suffix rows are unchanged. Without it, a reader of a node with
    children stops inside a unit."""
    batch = make_tree_batch(seed, [dict(depth=depth, branching=branching, node_len=6,
                                        suffix_len=3, inner=1, per_leaf=2)])
    kw = dict(token_budget=16, max_seq_len=512, prefix_chunk_tokens=chunk)
    plan = plan_microbatches(batch, state_reads=True, **kw)
    plain = plan_microbatches(batch, **kw)
    assert plan.microbatches == plain.microbatches

    def stops_inside(p):
        units = {c.chunk: c for c in p.prefix_units().values()}
        inside = []
        for mb in p.microbatches:
            for s in mb.segments:
                if s.cached_len:
                    chain = p.chain_chunks(s.group, s.node)
                    ends = {sum(units[c].length for c in chain[:i + 1]) for i in range(len(chain))}
                    inside.append(s.cached_len not in ends)
        return any(inside)

    assert not stops_inside(plan)
    if chunk is None:  # inner trajectories read a node with children: one token short of it
        assert stops_inside(plain) == (depth > 1)
    for span in plan.prefixes[0].spans():
        units = sorted((c.start, c.length) for c in plan.prefix_units().values()
                       if c.node == span.node)
        assert units[0][0] == span.start and sum(n for _, n in units) == span.length
        assert all(a + n == b for (a, n), (b, _) in zip(units, units[1:]))
        assert chunk is None or all(n <= chunk for _, n in units)


def test_validator_refuses_a_parent_backward_before_its_child():
    rules = dict(microbatch_groups=[(0,)], prefix_groups=[0],
                 prefix_units={0: (0, 0), 1: (0, 1), 2: (0, 2)}, unit_parents={0: None, 1: 0, 2: 0})
    good = build_schedule(num_stages=1, **rules)
    validate_schedule(good, **rules)
    assert str(good.actions[0][-1]).endswith("PB0")  # the root's backward comes last
    row = list(good.actions[0])
    pb = [i for i, a in enumerate(row) if a.kind.value == "PB"]
    row[pb[0]], row[pb[-1]] = row[pb[-1]], row[pb[0]]
    with pytest.raises(ScheduleError, match="PB"):
        validate_schedule(type(good)(num_stages=1, actions=[row]), **rules)
    with pytest.raises(ValueError, match="continues an earlier chunk"):
        build_schedule(num_stages=1, **{**rules, "unit_parents": {0: None, 1: 2, 2: 0}})


def test_cache_runs_children_before_parents():
    cache = PrefixKVCache()
    cache.set_tree(0, {0: None, 1: 0, 2: 0})
    for chunk in range(3):
        k = torch.randn(2, 1, 1, 4, requires_grad=True)
        cache.store(0, 1, k * 1, k * 2, chunk=chunk)
    k, v = cache.read(0, 1, chunks=(0, 2), length=3)
    assert k.shape[0] == 3
    (k.sum() + v.sum()).backward()
    with pytest.raises(CacheProtocolError, match="chunk 1"):
        cache.backward(0, chunk=0)
    cache.backward(0, chunk=2)
    cache.backward(0, chunk=1)
    cache.backward(0, chunk=0)
    assert cache.live_groups() == ()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 999), depth=st.integers(2, 4), data=st.data())
def test_subgroup_keeps_every_dense_row(seed, depth, data):
    """Placement splits a tree over DP ranks with tree.subgroup: the trajectories' dense rows
    (tokens, labels, loss arrays) stay exactly the same, 1-token leaves included."""
    from prefix_schedule.planning.tree import subgroup

    batch = make_tree_batch(seed, [dict(depth=depth, branching=2, node_len=2, suffix_len=3,
                                        inner=1, node_loss=seed % 2 == 0)])
    group = batch.groups[0]
    picked = data.draw(st.lists(st.integers(0, len(group.trajectories) - 1), min_size=1,
                                unique=True).map(sorted))
    part = GroupBatch(groups=[subgroup(group, picked)])
    for new, old in enumerate(picked):
        a, b = build_dense_inputs(batch, 0, old), build_dense_inputs(part, 0, new)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (old, new)


def test_placement_splits_a_tree_over_ranks():
    from prefix_schedule.planning.placement import place_groups

    batch = make_tree_batch(4, [dict(depth=3, branching=2, node_len=5, suffix_len=3)])
    placement = place_groups(batch, dp_size=2, token_budget=16, max_seq_len=128)
    shards = [r.batch.groups[0] for r in placement.ranks]
    assert sum(len(g.trajectories) for g in shards) == len(batch.groups[0].trajectories)
    assert all(g.num_nodes < batch.groups[0].num_nodes for g in shards)  # only the nodes read


@pytest.mark.parametrize("with_loss", [False, True])
def test_subgroup_lifts_a_one_token_leaf_into_the_suffix(with_loss):
    from prefix_schedule.planning.data import ContextLoss
    from prefix_schedule.planning.tree import subgroup

    def tr(n, node, context):
        loss = (ContextLoss(loss_mask=[0.0] + [1.0] * (context - 1), advantages=0.5,
                            old_logprobs=[-1.0] * context) if with_loss else None)
        return Trajectory(suffix=list(range(7, 7 + n)), advantages=1.0, node=node,
                          old_logprobs=[-2.0] * n, context_loss=loss)
    group = Group(prefix=[1, 2], nodes=[PrefixNode(parent=0, tokens=[3]),
                                        PrefixNode(parent=1, tokens=[4, 5])],
                  trajectories=[tr(2, 1, 3), tr(3, 2, 5)])
    part = subgroup(group, [0])
    assert not part.nodes and part.trajectories[0].suffix.tolist() == [3, 7, 8]
    a = build_dense_inputs(GroupBatch(groups=[group]), 0, 0)
    b = build_dense_inputs(GroupBatch(groups=[part]), 0, 0)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_context_parallelism_with_trees_is_refused_before_compute():
    """CP x prefix trees: a node's chain read is not sharded over the CP group; ReuseStep refuses
    it (a CPGroup of size 2 stands in: the refusal comes before any collective)."""
    from prefix_schedule.runtime.cp import CPGroup

    batch = make_tree_batch(5, [dict(depth=2, branching=2, node_len=6, suffix_len=4)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512)
    ReuseStep(batch, plan, cp_group=CPGroup(None, size=1, rank=0))  # CP=1: no refusal
    with pytest.raises(ValueError, match="context parallelism with prefix trees"):
        ReuseStep(batch, plan, cp_group=CPGroup(None, size=2, rank=0))


@pytest.mark.parametrize("context_loss,match", [
    (dict(loss_mask=[1.0, 0.0, 0.0], advantages=1.0), "0 at entry 0"),
    (dict(loss_mask=[0.0, 1.0], advantages=1.0), "context loss_mask has 2 entries"),
    (dict(loss_mask=[0.0, 1.0, 1.0], advantages=1.0, old_logprobs=[-1.0] * 3),
     "context_loss.old_logprobs exactly when"),
])
def test_context_loss_refusals(context_loss, match):
    from prefix_schedule.planning.data import ContextLoss

    with pytest.raises(ValueError, match=match):
        Group(prefix=[1, 2, 3], trajectories=[Trajectory(
            suffix=[4, 5], advantages=1.0, context_loss=ContextLoss(**context_loss))])
