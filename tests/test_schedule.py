"""Plan tier: schedule text forms, generator, lowering passes, validator and simulator; no model.

Golden plans live in tests/golden/*.txt. After an intended change of the generator or the
lowering, regenerate them with (then review the diff):

    REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_schedule.py -k golden
"""

import importlib.util
import json
import os
from pathlib import Path

import matplotlib.image
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefix_schedule.pipeline.lowering import add_grad_reduce, add_p2p, lower
from prefix_schedule.pipeline import (Action, ActionKind, Schedule, ScheduleError, build_schedule,
                                      parse_action, validate_schedule)
from prefix_schedule.pipeline.baselines import TokenCostModel, build_dense_1f1b, compare_with_dense
from prefix_schedule.pipeline.simulate import DeadlockError, chrome_trace, simulate

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[1]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PF, SF, SB, PB = (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD,
                  ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD)


def text(plan: Schedule) -> str:
    return plan.to_text()


def plan_of(rows: str) -> Schedule:
    return Schedule.from_text(rows)


# ---------------------------------------------------------------- text forms
SINGLE_KINDS = [k for k in ActionKind if k is not ActionKind.EXCHANGE]
actions = st.builds(Action, stage=st.integers(0, 12), kind=st.sampled_from(SINGLE_KINDS),
                    index=st.integers(0, 300))


@SETTINGS
@given(actions)
def test_action_text_round_trips(action):
    assert parse_action(str(action)) == action


@SETTINGS
@given(st.lists(st.lists(actions, max_size=6), min_size=1, max_size=5))
def test_schedule_text_and_csv_round_trip(rows):
    plan = Schedule(num_stages=len(rows), actions=rows)
    assert Schedule.from_text(plan.to_text()) == plan
    assert Schedule.from_csv(plan.to_csv()) == plan


def test_text_forms_are_compact():
    assert str(Action(stage=0, kind=PF, index=1)) == "0PF1"
    assert str(Action(stage=1, kind=ActionKind.RECV_SUFFIX_FORWARD, index=3)) == "1SFR3"
    plan = plan_of("0: 0PF0 0SF0\n1: 1SFR0\n")
    assert plan.to_csv() == "0PF0,0SF0\n1SFR0\n"


@pytest.mark.parametrize("bad", ["0XF1", "01SF1", "SF1", "0SF", "0 SF1", "-1SF1"])
def test_parse_action_rejects_malformed_text(bad):
    with pytest.raises(ScheduleError, match="cannot parse"):
        parse_action(bad)


def test_user_errors_are_value_errors_with_a_fix():
    with pytest.raises(ValueError, match="touched by no microbatch"):
        build_schedule(num_stages=1, microbatch_groups=[[0]], prefix_groups=[0, 1])
    with pytest.raises(ValueError, match="at least one"):
        build_schedule(num_stages=1, microbatch_groups=[], prefix_groups=[])
    with pytest.raises(ValueError, match="twice"):
        build_schedule(num_stages=1, microbatch_groups=[[0, 0]], prefix_groups=[0])
    with pytest.raises(ValueError, match="num_stages"):
        build_schedule(num_stages=0, microbatch_groups=[[0]], prefix_groups=[0])
    with pytest.raises(ValueError, match="Action.index"):
        Action(stage=0, kind=SF, index=-1)


# ---------------------------------------------------------------- generator
def test_single_stage_follows_the_prefix_lifetime_rules():
    plan = build_schedule(num_stages=1, microbatch_groups=[[0], [0], [0, 1], [1], [2]],
                          prefix_groups={0, 1})
    assert text(plan) == (
        "0: 0PF0 0SF0 0SB0 0SF1 0SB1 0PF1 0SF2 0SB2 0PB0 0SF3 0SB3 0PB1 0SF4 0SB4\n")


def test_without_prefixes_the_plan_is_classic_1f1b():
    assert text(build_dense_1f1b(num_stages=3, num_microbatches=4)) == (
        "0: 0SF0 0SF1 0SF2 0SB0 0SF3 0SB1 0SB2 0SB3\n"
        "1: 1SF0 1SF1 1SB0 1SF2 1SB1 1SF3 1SB2 1SB3\n"
        "2: 2SF0 2SB0 2SF1 2SB1 2SF2 2SB2 2SF3 2SB3\n")


GOLDEN_SHAPES = {
    "pp2_groups2x3": dict(num_stages=2, microbatch_groups=[[0]] * 3 + [[1]] * 3,
                          prefix_groups=[0, 1]),
    "pp4_groups3_mixed": dict(num_stages=4, microbatch_groups=[[0], [0, 1], [1], [1, 2], [2]],
                              prefix_groups=[0, 1, 2]),
    "pp3_one_dense_group": dict(num_stages=3, microbatch_groups=[[0], [0], [1], [2], [2]],
                                prefix_groups=[0, 2]),
    "pp2_vpp2_groups2": dict(num_stages=4, num_model_chunks=2,
                             microbatch_groups=[[0], [0], [0, 1], [1]], prefix_groups=[0, 1]),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_SHAPES))
def test_golden_plans(name):
    shape = GOLDEN_SHAPES[name]
    plan = build_schedule(**shape)
    got = (f"# {shape}\n# compute-only\n{plan.to_text()}# lowered\n{lower(plan).to_text()}")
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), f"{name} changed; see the module docstring to regenerate"
    compute_part = path.read_text().split("# lowered")[0]
    assert Schedule.from_text(compute_part) == plan


@st.composite
def step_shapes(draw):
    """S 1-8, groups 1-6, 1-12 microbatches per group; boundaries may merge, groups may be
    shuffled across microbatches, and some groups may have no cached prefix."""
    num_groups = draw(st.integers(1, 6))
    microbatches: list[tuple[int, ...]] = []
    for group in range(num_groups):
        for k in range(draw(st.integers(1, 12))):
            if microbatches and draw(st.booleans()) and (k == 0 or draw(st.booleans())):
                microbatches[-1] += (group,) if group not in microbatches[-1] else ()
            else:
                microbatches.append((group,))
    if draw(st.booleans()):  # arbitrary mixing: any microbatch, any groups
        microbatches = draw(st.permutations(microbatches))
    prefix = draw(st.sets(st.integers(0, num_groups - 1)))
    return dict(num_stages=draw(st.integers(1, 8)), microbatch_groups=microbatches,
                prefix_groups=sorted(prefix))


@settings(max_examples=40, deadline=None)
@given(step_shapes())
def test_every_generated_plan_validates_lowers_and_simulates(shape):
    plan = build_schedule(**shape)
    validate_schedule(plan, microbatch_groups=shape["microbatch_groups"],
                      prefix_groups=shape["prefix_groups"])
    lowered = lower(plan)
    validate_schedule(lowered, microbatch_groups=shape["microbatch_groups"],
                      prefix_groups=shape["prefix_groups"])  # p2p actions change no compute rule
    result = simulate(lowered)  # raises on deadlock or any p2p mismatch
    num_actions = 2 * len(shape["microbatch_groups"]) + 2 * len(shape["prefix_groups"])
    assert sum(result.busy) > 0 and all(len(row) == num_actions for row in plan.actions)


@settings(max_examples=15, deadline=None)
@given(step_shapes())
def test_single_stage_prefix_lives_from_first_to_last_use(shape):
    shape["num_stages"] = 1
    row = [str(a) for a in build_schedule(**shape).actions[0]]
    for g in shape["prefix_groups"]:
        uses = [m for m, groups in enumerate(shape["microbatch_groups"]) if g in groups]
        i_pf, i_sf = row.index(f"0PF{g}"), row.index(f"0SF{uses[0]}")
        i_sb, i_pb = row.index(f"0SB{uses[-1]}"), row.index(f"0PB{g}")
        # Only other PFs between PF g and its first SF; only other PBs between its last SB and PB g.
        assert i_pf < i_sf and all(a[1:3] == "PF" for a in row[i_pf:i_sf])
        assert i_sb < i_pb and all(a[1:3] == "PB" for a in row[i_sb + 1:i_pb])


# ---------------------------------------------------------------- lowering passes
TWO_STAGES = "0: 0PF0 0SF0 0SF1 0SB0 0SB1 0PB0\n1: 1PF0 1SF0 1SB0 1SF1 1SB1 1PB0\n"


def test_add_p2p_sends_after_producers_and_receives_before_consumers():
    assert text(add_p2p(plan_of(TWO_STAGES))) == (
        "0: 0PF0 0PFS0 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SBR1 0SB1 0PBR0 0PB0\n"
        "1: 1PFR0 1PF0 1SFR0 1SF0 1SB0 1SBS0 1SFR1 1SF1 1SB1 1SBS1 1PB0 1PBS0\n")


def test_add_p2p_receives_in_the_senders_order_at_pp2():
    # Rank 0 sends PF1 before SF0 and PB1 before PB0 arrives in the other order of need: the
    # receives follow the sender, so matching never depends on which item a rank wants first.
    plan = plan_of("0: 0PF0 0PF1 0SF0 0SF1 0SB0 0PB0 0SB1 0PB1\n"
                   "1: 1PF0 1SF0 1PF1 1SF1 1SB0 1SB1 1PB1 1PB0\n")
    validate_schedule(plan, microbatch_groups=[[0], [1]], prefix_groups=[0, 1])
    lowered = add_p2p(plan)
    assert text(lowered) == (
        "0: 0PF0 0PFS0 0PF1 0PFS1 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SBR1 0PBR1 0PBR0 0PB0 0SB1"
        " 0PB1\n"
        "1: 1PFR0 1PF0 1PFR1 1SFR0 1SF0 1PF1 1SFR1 1SF1 1SB0 1SBS0 1SB1 1SBS1 1PB1 1PBS1 1PB0"
        " 1PBS0\n")
    simulate(lowered, p2p="buffered")


def test_add_grad_reduce_appends_one_placeholder_per_rank_after_the_last_send():
    assert text(add_grad_reduce(add_p2p(plan_of(TWO_STAGES)))).splitlines()[1].endswith(
        "1PB0 1PBS0 1RG0")
    assert text(lower(plan_of("0: 0SF0 0SB0\n"))) == "0: 0SF0 0SB0 0RG0\n"


def test_passes_refuse_to_run_twice():
    with pytest.raises(ScheduleError, match="compute-only"):
        add_p2p(add_p2p(plan_of(TWO_STAGES)))
    with pytest.raises(ScheduleError, match="runs once"):
        add_grad_reduce(lower(plan_of(TWO_STAGES)))


# ---------------------------------------------------------------- validator
MUTATION_SHAPE = dict(num_stages=3, microbatch_groups=[[0], [0], [0, 1], [1], [1]],
                      prefix_groups=[0, 1])


def mutated(mutate) -> Schedule:
    rows = [list(row) for row in build_schedule(**MUTATION_SHAPE).actions]
    mutate(rows)
    return Schedule(num_stages=len(rows), actions=rows)


def move_pb_before_last_sb(rows):
    row = rows[1]
    pb = row.index(Action(stage=1, kind=PB, index=1))
    row.insert(row.index(Action(stage=1, kind=SB, index=4)), row.pop(pb))


@pytest.mark.parametrize("mutate, message", [
    (move_pb_before_last_sb, r"rank 1 step \d+: 1PB1 runs before 1SB4"),
    (lambda rows: rows[2].remove(Action(stage=2, kind=SF, index=3)), "2SF3"),
    (lambda rows: rows[0].insert(5, rows[0][1]), "runs twice"),
    (lambda rows: rows[0].__setitem__(0, Action(stage=0, kind=PF, index=2)), "names no group"),
    (lambda rows: rows.reverse(), "belongs to stage 2 but sits in rank 0's row"),
    (lambda rows: rows[2].pop(), "never runs 2PB1"),
])
def test_validator_catches_each_rule_with_the_step_marked(mutate, message):
    with pytest.raises(ScheduleError, match=message) as caught:
        validate_schedule(mutated(mutate), **{k: v for k, v in MUTATION_SHAPE.items()
                                              if k != "num_stages"})
    assert "rank0" in str(caught.value) and ">" in str(caught.value)  # the grid, marked


def test_validator_finds_a_cross_stage_deadlock():
    # Each row is fine alone; together rank 0 waits for 1SB0 while rank 1 waits for 0SF1.
    plan = plan_of("0: 0SF0 0SB0 0SF1 0SB1\n1: 1SF0 1SF1 1SB0 1SB1\n")
    with pytest.raises(ScheduleError, match="deadlock") as caught:
        validate_schedule(plan, microbatch_groups=[[0], [0]], prefix_groups=[])
    assert ">0SB0<" in str(caught.value) and ">1SF1<" in str(caught.value)


@settings(max_examples=15, deadline=None)
@given(step_shapes(), st.data())
def test_validator_rejects_any_dropped_or_duplicated_action(shape, data):
    plan = build_schedule(**shape)
    rank = data.draw(st.integers(0, plan.num_stages - 1))
    rows = [list(row) for row in plan.actions]
    i = data.draw(st.integers(0, len(rows[rank]) - 1))
    if data.draw(st.booleans()):
        del rows[rank][i]
    else:
        rows[rank].insert(data.draw(st.integers(0, len(rows[rank]))), rows[rank][i])
    with pytest.raises(ScheduleError):
        validate_schedule(Schedule(num_stages=len(rows), actions=rows),
                          microbatch_groups=shape["microbatch_groups"],
                          prefix_groups=shape["prefix_groups"])


# ---------------------------------------------------------------- simulator
def test_simulator_reports_a_hand_made_deadlock():
    # Rank 0 waits for a gradient before sending the activation rank 1 waits for.
    plan = plan_of("0: 0SF0 0SBR0 0SFS0 0SB0\n1: 1SFR0 1SF0 1SB0 1SBS0\n")
    with pytest.raises(DeadlockError) as caught:
        simulate(plan, p2p="buffered")
    message = str(caught.value)
    assert "rank 0 waits on 0SBR0 from rank 1" in message
    assert "rank 1 waits on 1SFR0 from rank 0" in message


@pytest.mark.parametrize("p2p", ["buffered", "nccl"])
def test_simulator_refuses_receives_posted_out_of_the_senders_order(p2p):
    plan = plan_of("0: 0SF0 0SFS0 0SF1 0SFS1 0SBR0 0SB0 0SBR1 0SB1\n"
                   "1: 1SFR1 1SFR0 1SF0 1SF1 1SB0 1SBS0 1SB1 1SBS1\n")
    with pytest.raises(ScheduleError, match="posting order mismatch"):
        simulate(plan, p2p=p2p)


@pytest.mark.parametrize("p2p", ["buffered", "nccl"])
@pytest.mark.parametrize("rows, message", [
    ("0: 0SF0 0SFS0 0SB0\n1: 1SF0 1SB0\n", "before its input"),
    ("0: 0SFS0 0SF0 0SB0\n1: 1SFR0 1SF0 1SB0\n", "before computing"),
    ("0: 0SF0 0SFS0 0SF1 0SFS1\n1: 1SFR0 1SF0\n", "0SFS1: rank 1 never receives it"),
    ("0: 0SB0 0SF0\n", "before 0SF0"),
    ("0: 0SF0 0SFS0 0SB0\n", "no peer: there is no stage 1"),
])
def test_simulator_checks_protocol_invariants(rows, message, p2p):
    with pytest.raises(ScheduleError, match=message):
        simulate(plan_of(rows), p2p=p2p)


def test_dense_1f1b_bubble_matches_the_closed_form():
    for stages, microbatches in [(2, 3), (4, 8), (8, 4)]:
        result = simulate(lower(build_dense_1f1b(num_stages=stages, num_microbatches=microbatches)))
        assert result.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_peak_memory_counts_live_prefixes_and_in_flight_suffixes():
    plan = build_schedule(num_stages=1, microbatch_groups=[[0], [0], [1], [1]],
                          prefix_groups=[0, 1])
    assert simulate(plan).peak_memory == (3.0,)  # one prefix (2) + one microbatch (1) at a time
    dense = simulate(lower(build_dense_1f1b(num_stages=4, num_microbatches=8)))
    assert dense.peak_memory == (4.0, 3.0, 2.0, 1.0)  # 1F1B keeps S - s microbatches in flight


COMPARE_SHAPES = [(2, [4, 4], False), (4, [3, 5, 2], True), (8, [6] * 4, False), (4, [12], False),
                  (6, [2, 9, 1, 7, 4, 3], True)]


def microbatches_for(counts, mix):
    out: list[tuple[int, ...]] = []
    for g, n in enumerate(counts):
        for k in range(n):
            if mix and k == 0 and out:
                out[-1] += (g,)
            else:
                out.append((g,))
    return out


@pytest.mark.parametrize("stages, counts, mix", COMPARE_SHAPES)
@pytest.mark.parametrize("prefix_tokens", [None, 256, 1024])
def test_bubble_is_no_worse_than_dense_1f1b(stages, counts, mix, prefix_tokens):
    mbs = microbatches_for(counts, mix)
    groups = sorted({g for gs in mbs for g in gs})
    costs = None if prefix_tokens is None else TokenCostModel(
        prefix_tokens={g: prefix_tokens for g in groups},
        microbatch_rows=[{g: 4 // len(gs) for g in gs} for gs in mbs],
        suffix_tokens=[1024] * len(mbs))
    plan = build_schedule(num_stages=stages, microbatch_groups=mbs, prefix_groups=groups,
                          cost=costs.cost if costs else None)
    compared = compare_with_dense(plan, num_microbatches=len(mbs), costs=costs)
    assert compared.plan.bubble_fraction <= compared.dense.bubble_fraction + 1e-12
    if costs is not None:
        assert compared.plan.makespan < compared.dense.makespan


def test_a_prefix_dearer_than_a_microbatch_still_idles_less_than_dense():
    # A 4x-dearer prefix forward is one long chain through the stages: the bubble *fraction*
    # can exceed dense 1F1B's (see the report), but absolute idle time and makespan do not.
    mbs = microbatches_for([6, 6], False)
    costs = TokenCostModel(prefix_tokens={0: 4096, 1: 4096},
                           microbatch_rows=[{gs[0]: 4} for gs in mbs], suffix_tokens=[1024] * 12)
    plan = build_schedule(num_stages=6, microbatch_groups=mbs, prefix_groups=[0, 1],
                          cost=costs.cost)
    compared = compare_with_dense(plan, num_microbatches=len(mbs), costs=costs)
    assert sum(compared.plan.idle) <= sum(compared.dense.idle)
    assert compared.plan.makespan < compared.dense.makespan


def test_chrome_trace_has_one_slice_per_compute_action():
    plan = build_schedule(**MUTATION_SHAPE)
    trace = json.loads(chrome_trace(simulate(lower(plan))))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == sum(len(row) for row in plan.actions)
    assert {e["name"] for e in slices} == {str(a) for row in plan.actions for a in row}


# ---------------------------------------------------------------- tools/plan.py
def load_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_tool_writes_png_trace_and_csv_and_reloads(tmp_path, capsys):
    tool = load_tool()
    files = [tmp_path / name for name in ("p.png", "t.json", "p.csv")]
    args = ["--pp", "3", "--groups", "2", "--suffix-microbatches", "2,3", "--mix"]
    assert tool.main(args + ["--png", str(files[0]), "--chrome-trace", str(files[1]),
                             "--save", str(files[2])]) == 0
    first = capsys.readouterr().out
    assert "dense 1F1B" in first and "valid" in first
    assert files[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = (matplotlib.image.imread(files[0])[..., :3] * 255).round().astype(int)
    found = {tuple(p) for p in pixels.reshape(-1, 3).tolist()}
    for colour in tool.COLOURS.values():  # a box of every action kind (and its legend patch)
        assert tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5)) in found, colour
    json.loads(files[1].read_text())
    assert tool.main(args + ["--load", str(files[2])]) == 0
    assert capsys.readouterr().out == first
