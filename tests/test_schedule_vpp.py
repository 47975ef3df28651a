"""Virtual pipeline stages in the schedule layer: Megatron's interleaved order and its
refusals, prefix units flowing through model chunks, and the simulated bubble against Megatron's
interleaved dense schedule ([Note: virtual stages] in ir.py, [Note: Megatron's interleaved
order] in orders.py). No model (one test reads Megatron's own schedule table)."""

import pytest

from prefix_schedule.pipeline import (Action, ActionKind, Schedule, ScheduleError, TokenCostModel,
                                      build_dense_interleaved, build_schedule, compare_with_dense,
                                      lower, simulate, validate_schedule)
from prefix_schedule.pipeline.orders import interleaved_order, megatron_table
from test_prefix_chunks import chunked_costs
from test_schedule import microbatches_for

K = ActionKind


# ---------------------------------------------------------------- Megatron's order
def test_schedule_table_matches_megatrons_documented_example():
    # megatron/core/pipeline_parallel/schedules.py: "PP2 N3M5 with VP2"
    table = megatron_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [v for _, v in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_dense_interleaved_plan_reads_like_megatrons():
    plan = build_dense_interleaved(num_ranks=2, num_model_chunks=2, num_microbatches=4)
    assert plan.to_text() == (
        "model_chunks: 2\n"
        "0: 0SF0 0SF1 2SF0 2SF1 0SF2 2SB0 0SF3 2SB1 2SF2 0SB0 2SF3 0SB1 2SB2 2SB3 0SB2 0SB3\n"
        "1: 1SF0 1SF1 3SF0 3SB0 3SF1 3SB1 1SF2 1SB0 1SF3 1SB1 3SF2 3SB2 3SF3 3SB3 1SB2 1SB3\n")


class _FakeCommunicator:
    """What get_pp_rank_microbatches reads from a P2PCommunicator."""

    def __init__(self, size, rank, chunks):
        self.pp_group = type("G", (), {"size": lambda _: size, "rank": lambda _: rank})()
        self.virtual_pipeline_model_parallel_size = chunks


def megatron_loop_order(schedules, ranks, rank, chunks, microbatches):
    """forward_backward_pipelining_with_interleaving's compute order on `rank` (its warmup,
    steady 1F1B and cooldown loops), built from Megatron's own table and warmup count."""
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        microbatches, chunks, ranks, p2p_communicator=_FakeCommunicator(ranks, rank, chunks))
    table = schedules.get_schedule_table(microbatches, chunks, ranks)

    def stage(k, forward):
        chunk = table[k % total][1]
        return (chunk if forward else chunks - 1 - chunk) * ranks + rank

    order = [(K.SUFFIX_FORWARD, table[k][0], stage(k, True)) for k in range(warmup)]
    for k in range(remaining):
        order.append((K.SUFFIX_FORWARD, table[k + warmup][0], stage(k + warmup, True)))
        order.append((K.SUFFIX_BACKWARD, table[k][0], stage(k, False)))
    order += [(K.SUFFIX_BACKWARD, table[k][0], stage(k, False)) for k in range(remaining, total)]
    return order


def test_interleaved_order_is_megatrons_own(megatron_env):
    from megatron.core.pipeline_parallel import schedules
    for ranks in (2, 3, 4, 8):
        for chunks in (2, 3, 4):
            for microbatches in (ranks, 2 * ranks, 3 * ranks):
                for rank in range(ranks):
                    ours = interleaved_order(rank, ranks, chunks, microbatches).actions()
                    assert ours == megatron_loop_order(schedules, ranks, rank, chunks,
                                                       microbatches), (ranks, chunks, rank)


@pytest.mark.parametrize("ranks, microbatches, message", [
    (4, 6, "last group would hold 2 < PP=4"),  # Megatron: RuntimeError (dependency bubbles)
    (4, 2, r"in \[PP=4, M=2\]"),               # Megatron: ValueError (group size > M)
    (2, 3, "last group would hold 1 < PP=2"),
])
def test_dense_interleaved_refuses_what_megatron_refuses(ranks, microbatches, message):
    with pytest.raises(ValueError, match=message):
        build_dense_interleaved(num_ranks=ranks, num_model_chunks=2,
                                num_microbatches=microbatches)


def test_the_counts_megatron_refuses_deadlock_its_order_but_not_the_generator():
    # PP=4, V=3, M=5: Megatron refuses (5 % 4 = 1 < 4), and its order would indeed hang
    with pytest.raises(ValueError, match="last group would hold 1"):
        build_dense_interleaved(num_ranks=4, num_model_chunks=3, num_microbatches=5)
    raw = Schedule(num_stages=12, num_model_chunks=3, actions=[
        [Action(stage=s, kind=kind, index=m) for kind, m, s in
         interleaved_order(r, 4, 3, 5).actions()] for r in range(4)])
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(raw, microbatch_groups=[()] * 5, prefix_groups=())
    plan = build_schedule(num_stages=12, num_model_chunks=3, microbatch_groups=[[0]] * 5,
                          prefix_groups=[0])  # one more warmup forward where it would stall
    validate_schedule(plan, microbatch_groups=[[0]] * 5, prefix_groups=[0])
    simulate(lower(plan))


def test_generator_layout_errors():
    with pytest.raises(ValueError, match=">= 2 ranks"):
        build_schedule(num_stages=2, num_model_chunks=2, microbatch_groups=[[0]],
                       prefix_groups=[0])
    with pytest.raises(ValueError, match="multiple of num_model_chunks"):
        build_schedule(num_stages=5, num_model_chunks=2, microbatch_groups=[[0]],
                       prefix_groups=[0])


# ---------------------------------------------------------------- prefix units through chunks
def test_prefix_units_flow_through_every_virtual_stage_like_microbatches():
    from prefix_schedule.pipeline.units import number_units
    shape = dict(microbatch_groups=microbatches_for([3, 3, 2], True), prefix_groups=[0, 1, 2],
                 prefix_units=number_units({0: 2, 1: 1, 2: 3}))
    plan = build_schedule(num_stages=9, num_model_chunks=3, **shape)
    validate_schedule(plan, **shape)
    timeline = simulate(lower(plan)).timeline
    at = {(t.action.stage, t.action.kind, t.action.index): t for row in timeline for t in row
          if t.action.kind.is_compute}
    for unit in shape["prefix_units"]:
        for s in range(9):
            assert (s, K.PREFIX_FORWARD, unit) in at and (s, K.PREFIX_BACKWARD, unit) in at
            if s:  # PF climbs the virtual stages in order, PB comes back down
                assert at[(s, K.PREFIX_FORWARD, unit)].start >= at[
                    (s - 1, K.PREFIX_FORWARD, unit)].end
                assert at[(s - 1, K.PREFIX_BACKWARD, unit)].start >= at[
                    (s, K.PREFIX_BACKWARD, unit)].end
    for r, row in enumerate(plan.actions):
        assert {plan.rank_of(a) for a in row} == {r}
        assert {plan.model_chunk_of(a) for a in row} == {0, 1, 2}


# ---------------------------------------------------------------- bubble vs Megatron interleaved
LAYOUTS = [(2, 2, [4, 4], False), (4, 2, [4, 4], False), (4, 3, [6, 6], False),
           (8, 2, [8, 8], False), (4, 4, [8, 8, 8], False), (8, 4, [4] * 4, False),
           (4, 2, [3, 5, 6], True), (2, 3, [3, 3, 4], True)]


def token_costs(mbs, prefix_tokens):
    groups = sorted({g for gs in mbs for g in gs})
    return groups, None, TokenCostModel(
        prefix_tokens={g: prefix_tokens for g in groups},
        microbatch_rows=[{g: 4 // len(gs) for g in gs} for gs in mbs],
        suffix_tokens=[1024] * len(mbs))


@pytest.mark.parametrize("ranks, chunks, counts, mix", LAYOUTS)
@pytest.mark.parametrize("costs", ["unit", "prefix 256", "prefix 1024", "chunked 2048",
                                   "chunked 4096"])
def test_bubble_is_no_worse_than_megatrons_interleaved_schedule(ranks, chunks, counts, mix,
                                                                costs):
    """Condition (as for 1F1B): every prefix unit's forward costs no more than a suffix
    microbatch's -- unit costs, an unchunked prefix of <= a microbatch's tokens, or chunks of
    one microbatch's tokens (1024) -- and M a count Megatron interleaves (a multiple of PP).
    Both plans run the same lowering under the NCCL model."""
    mbs = microbatches_for(counts, mix)
    assert len(mbs) % ranks == 0
    if costs == "unit":
        groups, units, model = sorted({g for gs in mbs for g in gs}), None, None
    elif costs.startswith("prefix"):
        groups, units, model = token_costs(mbs, int(costs.split()[1]))
    else:
        groups, units, model = chunked_costs(mbs, int(costs.split()[1]), 1024)
    plan = build_schedule(num_stages=ranks * chunks, num_model_chunks=chunks,
                          microbatch_groups=mbs, prefix_groups=groups, prefix_units=units,
                          cost=model.cost if model else None)
    compared = compare_with_dense(plan, num_microbatches=len(mbs), costs=model)
    assert compared.plan.bubble_fraction <= compared.dense.bubble_fraction + 1e-12
    if model is not None:
        assert compared.plan.makespan < compared.dense.makespan


def test_a_dearer_unchunked_prefix_idles_more_than_interleaved_dense_chunking_fixes_it():
    mbs = microbatches_for([4, 4], False)
    groups, _, model = token_costs(mbs, 4096)
    plan = build_schedule(num_stages=8, num_model_chunks=2, microbatch_groups=mbs,
                          prefix_groups=groups, cost=model.cost)
    compared = compare_with_dense(plan, num_microbatches=8, costs=model)
    assert compared.plan.bubble_fraction > compared.dense.bubble_fraction  # the stated limit
    assert compared.plan.makespan < compared.dense.makespan
    groups, units, model = chunked_costs(mbs, 4096, 1024)
    plan = build_schedule(num_stages=8, num_model_chunks=2, microbatch_groups=mbs,
                          prefix_groups=groups, prefix_units=units, cost=model.cost)
    compared = compare_with_dense(plan, num_microbatches=8, costs=model)
    assert compared.plan.bubble_fraction <= compared.dense.bubble_fraction
