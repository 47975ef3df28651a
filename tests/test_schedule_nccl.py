"""The plan tier under NCCL semantics: the simulator's NCCL model can fail (today's ungrouped
lowering deadlocks at PP=2), grouped exchanges fix it, and every generated plan -- PP 1-8,
virtual stages 1-4, prefix chunks -- lowers to a plan that is deadlock-free under NCCL and even
when every op blocks ([Note: p2p posting order] in prefix_schedule/pipeline/lowering.py,
[Note: the NCCL p2p model] in nccl.py). No model."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_schedule.pipeline import (ActionKind, DeadlockError, Schedule, ScheduleError,
                                      build_schedule, flatten_exchanges, forward_only, lower,
                                      simulate, validate_schedule)
from prefix_schedule.pipeline.lowering import add_grouped_p2p
from prefix_schedule.pipeline.units import number_units
from test_schedule import GOLDEN_SHAPES, step_shapes

K = ActionKind


def plan_of(text: str) -> Schedule:
    return Schedule.from_text(text)


# ---------------------------------------------------------------- the model can fail
def test_ungrouped_lowering_of_a_pp2_plan_deadlocks_under_nccl():
    plan = build_schedule(**GOLDEN_SHAPES["pp2_groups2x3"])
    ungrouped = lower(plan, group_exchanges=False)
    simulate(ungrouped, p2p="buffered")  # gloo buffers sends: no hang there
    with pytest.raises(DeadlockError) as caught:
        simulate(ungrouped, p2p="nccl")
    message = str(caught.value)
    # who waits on whom: rank 0's send of SF1 sits at the head of its stream to rank 1, whose
    # matching receive is queued behind rank 1's own send of SB0, which waits for rank 0's
    # receive, queued behind that send of SF1.
    assert "rank 0 waits at step" in message and "rank 1 waits at step" in message
    assert "0SFS1 waits for rank 1's 1SFR1" in message
    assert "queued behind 1SBS0" in message
    assert "queued behind 0SFS1" in message
    assert ">" in message and "rank0" in message  # the grid, stuck steps marked
    simulate(lower(plan), p2p="nccl")  # grouped: the crossing pairs share an exchange


def test_a_crossing_pair_completes_only_as_one_exchange():
    separate = plan_of("0: 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SBR1 0SB1\n"
                       "1: 1SFR0 1SF0 1SB0 1SBS0 1SFR1 1SF1 1SB1 1SBS1\n")
    with pytest.raises(DeadlockError, match="0SFS1 waits for rank 1's 1SFR1"):
        simulate(separate, p2p="nccl")
    simulate(separate, p2p="buffered")
    exchanged = plan_of("0: 0SF0 0SFS0 0SF1 0SFS1+0SBR0 0SB0 0SBR1 0SB1\n"
                        "1: 1SFR0 1SF0 1SB0 1SBS0+1SFR1 1SF1 1SB1 1SBS1\n")
    for p2p in ("nccl", "blocking", "buffered"):
        simulate(exchanged, p2p=p2p)


ROW0 = "0: 0SF0 0SFS0 0SF1 0SFS1 0SF2 0SFS2 0SBR0 0SB0 0SBR1 0SB1 0SBR2 0SB2\n"
ROW1 = ("1: 1SFR0 1SF0 1SFS0 1SFR1 1SBR0 1SF1 1SFS1 1SFR2 1SB0 {} 1SB1 1SBS1 1SF2 1SFS2 1SBR2 "
        "1SB2 1SBS2\n")
ROW2 = "2: 2SFR0 2SF0 2SB0 2SBS0 2SFR1 2SF1 2SB1 2SBS1 2SFR2 2SF2 2SB2 2SBS2\n"


def test_a_compute_waits_for_its_whole_exchange():
    # Rank 1 groups its gradient send to rank 0 with its receive of SB1's gradient from rank 2.
    # Rank 0 posts the matching receive only after a long SF2 (t = 22): SB1 on rank 1 waits for
    # that, although its own data arrived at t = 8. Posted as two ops, it starts at 8.
    cost = lambda a: 20.0 if str(a) == "0SF2" else {"SF": 1.0, "SB": 2.0}.get(a.kind.value, 0.0)
    grouped = simulate(plan_of(ROW0 + ROW1.format("1SBS0+1SBR1") + ROW2), cost=cost)
    starts = {str(t.action): (t.start, t.end) for row in grouped.timeline for t in row}
    assert starts["2SBS1"] == (8.0, 8.0) and starts["1SBS0+1SBR1"] == (7.0, 22.0)
    assert starts["1SB1"][0] == 22.0
    single = simulate(plan_of(ROW0 + ROW1.format("1SBS0 1SBR1") + ROW2), cost=cost)
    assert {str(t.action): t.start for row in single.timeline for t in row}["1SB1"] == 8.0
    assert simulate(plan_of(ROW0 + ROW1.format("1SBS0+1SBR1") + ROW2), cost=cost,
                    p2p="blocking").makespan >= grouped.makespan


def test_nccl_mode_reports_an_unmatched_send_and_an_exchange_on_the_wrong_rank():
    with pytest.raises(ScheduleError, match="rank 1 never receives it"):
        simulate(plan_of("0: 0SF0 0SFS0\n1:\n"), p2p="nccl")
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        simulate(plan_of("0: 0SF0 0SFS0+1SFR0\n1: 1SF0\n"), p2p="nccl")
    with pytest.raises(ValueError, match="choose one of"):
        simulate(plan_of("0: 0SF0\n"), p2p="gloo")


# ---------------------------------------------------------------- the grouping pass
def test_add_grouped_p2p_groups_crossing_pairs_and_receives_by_send_time():
    plan = plan_of("0: 0PF0 0SF0 0SF1 0SB0 0SB1 0PB0\n1: 1PF0 1SF0 1SB0 1SF1 1SB1 1PB0\n")
    assert add_grouped_p2p(plan).to_text() == (
        "0: 0PF0 0PFS0 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SBR1 0SB1 0PBR0 0PB0\n"
        "1: 1PFR0 1PF0 1SFR0 1SF0 1SFR1 1SB0 1SBS0 1SF1 1SB1 1SBS1 1PB0 1PBS0\n")
    # unit costs, PP=2, 1F1B: at t=7 rank 0's SF2 output and rank 1's SB1 gradient cross:
    # Megatron's send_forward_recv_backward on rank 0, send_backward_recv_forward on rank 1
    plan = build_schedule(num_stages=2, microbatch_groups=[()] * 3, prefix_groups=())
    assert add_grouped_p2p(plan).to_text() == (
        "0: 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SF2 0SFS2+0SBR1 0SB1 0SBR2 0SB2\n"
        "1: 1SFR0 1SF0 1SFR1 1SB0 1SBS0 1SF1 1SB1 1SBS1+1SFR2 1SF2 1SB2 1SBS2\n")


def test_exchanges_flatten_to_sends_first_and_forward_only_keeps_forward_ops():
    plan = build_schedule(**GOLDEN_SHAPES["pp2_vpp2_groups2"])
    lowered = lower(plan)
    exchanges = [a for row in lowered.actions for a in row if a.kind is K.EXCHANGE]
    assert exchanges and all(len(a.ops) == 2 for a in exchanges)
    assert all(a.ops[0].kind.is_send and a.ops[1].kind.is_recv for a in exchanges)
    flat = flatten_exchanges(lowered)
    assert not any(a.kind is K.EXCHANGE for row in flat.actions for a in row)
    assert [op for a in lowered.actions[0] for op in (a.ops or (a,))] == list(flat.actions[0])
    simulate(flat, p2p="buffered")
    fwd = forward_only(lowered)
    assert all(op.kind.is_forward for row in fwd.actions for a in row for op in (a.ops or (a,)))
    simulate(fwd, p2p="nccl")
    simulate(fwd, p2p="blocking")


# ---------------------------------------------------------------- every generated plan
@st.composite
def layouts(draw):
    """step_shapes (test_schedule) on PP 1-8 ranks x 1-4 model chunks (PP >= 2 for V > 1), with
    1-3 chunks per prefix in half the draws, and unit or uneven costs."""
    shape = draw(step_shapes())
    ranks = shape.pop("num_stages")
    chunks = 1 if ranks == 1 else draw(st.integers(1, 4))
    shape.update(num_stages=ranks * chunks, num_model_chunks=chunks)
    if shape["prefix_groups"] and draw(st.booleans()):
        shape["prefix_units"] = number_units({g: draw(st.integers(1, 3))
                                              for g in shape["prefix_groups"]})
    weights = draw(st.sampled_from([None, {"PF": 1, "SF": 1, "SB": 2, "PB": 2},
                                    {"PF": 3, "SF": 1, "SB": 2, "PB": 5},
                                    {"PF": 0.5, "SF": 2, "SB": 3, "PB": 1}]))
    cost = None if weights is None else (lambda a: float(weights.get(a.kind.value, 0.0)))
    return shape, cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_every_generated_plan_is_deadlock_free_under_nccl(drawn):
    shape, cost = drawn
    rules = {k: v for k, v in shape.items() if k not in ("num_stages", "num_model_chunks")}
    plan = build_schedule(**shape, cost=cost)
    validate_schedule(plan, **rules)
    lowered = lower(plan, cost=cost)
    validate_schedule(lowered, **rules)  # p2p actions change no compute rule
    nccl = simulate(lowered, cost=cost, p2p="nccl")  # raises on deadlock or any p2p mismatch
    simulate(lowered, cost=cost, p2p="blocking")
    buffered = simulate(flatten_exchanges(lowered), cost=cost, p2p="buffered")
    simulate(forward_only(lowered), cost=cost, p2p="nccl")
    # lowered with the costs it runs with, no exchange waits for a busy peer: NCCL's timeline
    # is the buffered one
    assert nccl.makespan == pytest.approx(buffered.makespan)
    assert lowered.num_ranks == len(plan.actions) == shape["num_stages"] // plan.num_model_chunks
