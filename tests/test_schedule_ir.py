"""The IR contract: grouped p2p exchanges and virtual stages in Action / Schedule, their text and
CSV forms, and the layout helpers an executor uses ([Note: grouped p2p exchanges] and
[Note: virtual stages] in prefix_schedule/pipeline/ir.py). No model."""

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.pipeline import Action, ActionKind, Schedule, ScheduleError, parse_action

K = ActionKind
SINGLE = [k for k in ActionKind if k is not K.EXCHANGE]
P2P = [k for k in ActionKind if k.is_send or k.is_recv]
SETTINGS = settings(max_examples=40, deadline=None)

singles = st.builds(Action, stage=st.integers(0, 12), kind=st.sampled_from(SINGLE),
                    index=st.integers(0, 300))
p2p_ops = st.builds(Action, stage=st.integers(0, 12), kind=st.sampled_from(P2P),
                    index=st.integers(0, 300))
exchanges = st.lists(p2p_ops, min_size=2, max_size=4, unique=True).map(Action.exchange)


@st.composite
def schedules(draw):
    chunks = draw(st.integers(1, 4))
    rows = draw(st.lists(st.lists(st.one_of(singles, exchanges), max_size=6), min_size=1,
                         max_size=5))
    return Schedule(num_stages=len(rows) * chunks, actions=rows, num_model_chunks=chunks)


@SETTINGS
@given(st.one_of(singles, exchanges))
def test_every_action_round_trips_through_text(action):
    assert parse_action(str(action)) == action
    assert pickle.loads(pickle.dumps(action)) == action and copy.deepcopy(action) == action


@SETTINGS
@given(schedules())
def test_schedules_with_exchanges_and_model_chunks_round_trip(plan):
    assert Schedule.from_text(plan.to_text()) == plan
    assert Schedule.from_csv(plan.to_csv()) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_exchange_text_is_its_ops_joined_by_plus():
    ops = [Action(stage=1, kind=K.SEND_SUFFIX_BACKWARD, index=0),
           Action(stage=1, kind=K.RECV_SUFFIX_FORWARD, index=1)]
    exchange = Action.exchange(ops)
    assert str(exchange) == "1SBS0+1SFR1"
    assert (exchange.kind, exchange.stage, exchange.index, exchange.ops) == (K.EXCHANGE, 1, 0,
                                                                             tuple(ops))
    assert exchange.p2p_ops == tuple(ops) and ops[0].p2p_ops == (ops[0],)
    assert parse_action("0PF1").p2p_ops == () and parse_action("0RG0").p2p_ops == ()
    assert not (K.EXCHANGE.is_send or K.EXCHANGE.is_recv or K.EXCHANGE.is_compute
                or K.EXCHANGE.is_forward)


@pytest.mark.parametrize("bad, message", [
    ("0X0", "cannot parse"),                    # an exchange is never written by its code
    ("0SF0+0SFS0", "sends/receives only"),      # no compute inside an exchange
    ("0SFS0+0SFS0", "twice"),
    ("0SFS0+", "cannot parse"),
    ("0SFS0++0SBR1", "cannot parse"),
])
def test_malformed_exchanges_are_refused(bad, message):
    with pytest.raises(ScheduleError, match=message):
        parse_action(bad)


def test_exchange_construction_errors_say_what_to_fix():
    send = Action(stage=0, kind=K.SEND_SUFFIX_FORWARD, index=0)
    with pytest.raises(ValueError, match="two or more"):
        Action.exchange([send])
    with pytest.raises(ValueError, match="only an EXCHANGE holds ops"):
        Action(stage=0, kind=K.SUFFIX_FORWARD, index=0, ops=(send, send))
    with pytest.raises(ValueError, match="Action.exchange"):
        Action(stage=3, kind=K.EXCHANGE, index=0,
               ops=(send, Action(stage=0, kind=K.RECV_SUFFIX_BACKWARD, index=0)))


def test_one_model_chunk_reads_exactly_as_before():
    plan = Schedule.from_text("0: 0PF0 0SF0 0SFS0\n1: 1SFR0 1SF0\n")
    assert (plan.num_stages, plan.num_ranks, plan.num_model_chunks) == (2, 2, 1)
    assert plan.to_text() == "0: 0PF0 0SF0 0SFS0\n1: 1SFR0 1SF0\n"
    assert plan.to_csv() == "0PF0,0SF0,0SFS0\n1SFR0,1SF0\n"
    assert plan.stages_of(1) == (1,)
    send, recv = plan.actions[0][2], plan.actions[1][0]
    assert (plan.peer_rank(send), plan.peer_rank(recv)) == (1, 0)
    assert plan.peer_rank(plan.actions[1][1]) is None  # the last stage's output goes nowhere


def test_virtual_stage_layout_follows_megatron():
    # PP=2, V=2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    plan = Schedule.from_text("model_chunks: 2\n"
                              "0: 0SF0 0SFS0 2SFR0 2SF0 2SFS0 2SBR0 2SB0 2SBS0\n"
                              "1: 1SFR0 1SF0 1SFS0 3SFR0 3SF0 3SB0 3SBS0\n")
    assert (plan.num_stages, plan.num_ranks, plan.num_model_chunks) == (4, 2, 2)
    assert plan.stages_of(0) == (0, 2) and plan.stages_of(1) == (1, 3)
    where = {str(a): (plan.rank_of(a), plan.model_chunk_of(a), plan.peer_rank(a))
             for row in plan.actions for a in row}
    assert where["0SFS0"] == (0, 0, 1)
    assert where["1SFS0"] == (1, 0, 0)   # stage 1 -> 2 wraps from the last rank to rank 0
    assert where["2SFR0"] == (0, 1, 1)
    assert where["2SFS0"] == (0, 1, 1)
    assert where["3SBS0"] == (1, 1, 0)   # gradients flow 3 -> 2
    assert where["2SBS0"] == (0, 1, 1)   # ... and 2 -> 1 (rank 0 -> rank 1)
    assert where["3SF0"] == (1, 1, None)  # the last virtual stage sends no activations
    assert plan.to_text().startswith("model_chunks: 2\n0: 0SF0")
    assert plan.to_csv().startswith("model_chunks: 2\n0SF0,0SFS0,2SFR0")
    exchange = parse_action("2SBS0+2SFR1")
    assert plan.rank_of(exchange) == 0 and [plan.peer_rank(op) for op in exchange.ops] == [1, 1]


@pytest.mark.parametrize("text, message", [
    ("model_chunks: 0\n0: 0SF0\n", "model_chunks: V"),
    ("model_chunks: two\n0: 0SF0\n", "model_chunks: V"),
    ("1: 1SF0\n", "expected '0: <actions>'"),
    ("# only a comment\n", "no action rows"),
])
def test_malformed_text_is_refused(text, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_text(text)


def test_schedule_layout_errors():
    with pytest.raises(ValueError, match="not a multiple of num_model_chunks"):
        Schedule(num_stages=3, actions=[[]], num_model_chunks=2)
    with pytest.raises(ValueError, match="one row per rank"):
        Schedule(num_stages=4, actions=[[]], num_model_chunks=2)
    with pytest.raises(ScheduleError, match="no action rows"):
        Schedule.from_csv("")
