"""The schedule IR: typed actions per pipeline rank, their text and CSV forms, the grid printer.

A schedule is one list of `Action`s per pipeline *rank*, in execution order. `str(action)` is
compact text (`0PF1`, `1SF3`, `1SB3`, `0PB1`, `0SFS3`, `1SFR3`, an exchange `1SBS0+1SFR1`) and
`parse_action` reads it back exactly. This module knows nothing of how schedules are made
(generate.py), checked (validate.py), lowered (lowering.py) or simulated (simulate.py): those
import it, never the reverse.

[Note: virtual stages]
`num_ranks` = PP ranks each hold `num_model_chunks` = V model chunks; the model is cut into
`num_stages` = PP * V virtual stages. Virtual stage s lives on rank s % PP as model chunk s // PP
(Megatron's interleaved layout: chunk v of rank r holds virtual stage v * PP + r).
`Action.stage` is the virtual stage; row r of `Schedule.actions` holds every action of the
stages of rank r. Forward data flows stage s -> s + 1 (rank r -> (r + 1) % PP: the last rank
feeds rank 0's next chunk), gradients s + 1 -> s. With V = 1 stage and rank coincide and every
form reads as before (`Schedule.num_stages` is then the pipeline size).

[Note: grouped p2p exchanges]
An action of kind EXCHANGE holds, in `ops`, two or more sends/receives of ONE rank that are
posted together as one grouped exchange (`torch.distributed.batch_isend_irecv`, i.e. one
ncclGroupStart/End, as Megatron's p2p_communication does): they may match their counterparts
in any order, and the exchange completes when all of them have. Text: the ops joined by `+`.
Its own `stage` is that of its first op and its `index` is 0. `ops` are in posting order; ops
on one channel (same peer, same direction) keep the channel's FIFO order (lowering.py,
[Note: p2p posting order]).

Executor API (the contract the runtime builds on):

    sched = step.lowered                              # a lowered Schedule
    sched.num_ranks, sched.num_model_chunks, sched.num_stages   # PP, V, PP * V
    for action in sched.actions[rank]:                # this rank's row, in order
        chunk = sched.model_chunk_of(action)          # which of the rank's model chunks
        if action.kind is ActionKind.EXCHANGE:        # post action.ops as ONE group, wait all
            ops = [(op.kind, op.index, sched.peer_rank(op), sched.model_chunk_of(op))
                   for op in action.ops]              # op.kind.is_send / .is_recv
        elif action.kind.is_send or action.kind.is_recv:    # one op alone
            peer = sched.peer_rank(action)
        elif action.kind.is_compute: ...               # PF / SF / SB / PB of chunk `chunk`
        else: ...                                      # REDUCE_GRAD (index 0, one per chunk)

`action.p2p_ops` gives the ops uniformly (an exchange's ops, (action,) for a single send or
receive, () otherwise). `op.kind.compute` is the compute kind whose data an op carries and
`op.index` its prefix unit / microbatch, so (kind.compute, index, model chunk) keys the tensor.

[Note: prefix-reuse dependency rules]
Microbatch m touches the groups `microbatch_groups[m]`; groups in `prefix_groups` have a cached
prefix and so a PF/PB pair on every (virtual) stage. On each stage s:
  PF g  before every SF m that touches g;   SB m after SF m;
  PB g  after every SB m that touches g (PB g consumes the gK/gV those backwards accumulated).
Across stages: PF g and SF m on s need the same action's output from s-1 (forward flows up);
SB m and PB g on s need the same action's input gradient from s+1 (backward flows down; the last
stage's PB needs none). With chunked prefixes PF/PB name prefix units (group, chunk) instead of
groups and two rules join: PF chunk c after PF chunk c-1, PB chunk c after PB chunk c+1 (see
[Note: prefix chunks] in units.py). `validate_schedule` checks exactly these rules, the generator
obeys them, and the simulator re-checks the cross-stage half through sends and receives.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

from prefix_schedule.pipeline.support import check_count, format_grid, without_gc

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError", "format_grid", "check_count",
           "parse_action", "peer_dependency", "peer_stage", "unit_cost", "without_gc"]


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message holds the per-rank grid, failing step marked."""


class ActionKind(enum.Enum):
    """What an action does. Compute kinds first, then the p2p kinds that lowering adds."""

    PREFIX_FORWARD = "PF"
    SUFFIX_FORWARD = "SF"
    SUFFIX_BACKWARD = "SB"
    PREFIX_BACKWARD = "PB"
    # Sends go to the next stage for forward data and to the previous stage for gradients;
    # a receive comes from the other side. Code = compute code + S(end) / R(eceive).
    SEND_PREFIX_FORWARD = "PFS"
    RECV_PREFIX_FORWARD = "PFR"
    SEND_SUFFIX_FORWARD = "SFS"
    RECV_SUFFIX_FORWARD = "SFR"
    SEND_SUFFIX_BACKWARD = "SBS"
    RECV_SUFFIX_BACKWARD = "SBR"
    SEND_PREFIX_BACKWARD = "PBS"
    RECV_PREFIX_BACKWARD = "PBR"
    # Placeholder for the data-parallel gradient reduce of one model chunk's parameters.
    REDUCE_GRAD = "RG"
    # Sends/receives posted together as one group ([Note: grouped p2p exchanges]); written as
    # its ops joined by '+', never by this code.
    EXCHANGE = "X"

    # Members hash by identity (they are singletons): Enum's default hashes the name in Python,
    # and kinds key the dicts of every pass and simulation.
    __hash__ = object.__hash__

    # Set per member below (plain attributes, not properties: read once per action per pass):
    #   is_compute  PF, SF, SB or PB.
    #   is_send     a single send lowering added;   is_recv  a single receive.
    #   is_forward  forward compute, or a p2p kind that carries forward outputs.
    #   compute     the compute kind whose data a p2p kind carries (others: itself).


_COMPUTE = frozenset(k for k in ActionKind if len(k.value) == 2 and k.value != "RG")
_SENDS = frozenset(k for k in ActionKind if len(k.value) == 3 and k.value.endswith("S"))
_RECVS = frozenset(k for k in ActionKind if len(k.value) == 3 and k.value.endswith("R"))
_FORWARD = frozenset(k for k in ActionKind if k.value[1:2] == "F")
for _kind in ActionKind:
    _kind.is_compute = _kind in _COMPUTE
    _kind.is_send = _kind in _SENDS
    _kind.is_recv = _kind in _RECVS
    _kind.is_forward = _kind in _FORWARD
    _kind.compute = ActionKind(_kind.value[:2]) if len(_kind.value) > 1 else _kind
del _kind
_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([A-Z]+)(0|[1-9][0-9]*)")
_CODES = frozenset(k.value for k in ActionKind if k is not ActionKind.EXCHANGE)


class _ActionFields(NamedTuple):
    stage: int
    """Virtual pipeline stage that executes the action ([Note: virtual stages]); with one model
    chunk per rank, the rank."""
    kind: ActionKind
    """What the action does."""
    index: int
    """Prefix unit for PF/PB and their p2p kinds (the group id unless prefixes are chunked:
    units.py); microbatch for SF/SB and theirs; 0 for REDUCE_GRAD and EXCHANGE."""
    ops: tuple = ()
    """EXCHANGE only: its sends/receives in posting order; () for every other kind."""


class Action(_ActionFields):
    """One step of one rank's list: an immutable, hashable record (a named tuple, so it also
    equals the plain tuple (stage, kind, index, ops)). Build with keywords; an exchange with
    `Action.exchange(ops)`."""

    __slots__ = ()

    def __new__(cls, *, stage: int, kind: ActionKind, index: int, ops: Iterable = ()):
        check_count("Action.stage", stage, 0)
        check_count("Action.index", index, 0)
        if not isinstance(kind, ActionKind):
            raise ValueError(f"Action.kind must be an ActionKind, got {kind!r}")
        ops = tuple(ops)
        if kind is ActionKind.EXCHANGE:
            _check_exchange(stage, index, ops)
        elif ops:
            raise ValueError(f"only an EXCHANGE holds ops; {kind.name} got {len(ops)}")
        return tuple.__new__(cls, (stage, kind, index, ops))

    @classmethod
    def exchange(cls, ops: Iterable["Action"]) -> "Action":
        """The grouped exchange of `ops` (two or more sends/receives of one rank, posting order)."""
        ops = tuple(ops)
        stage = ops[0].stage if ops and isinstance(ops[0], Action) else 0
        return cls(stage=stage, kind=ActionKind.EXCHANGE, index=0, ops=ops)

    @property
    def p2p_ops(self) -> tuple:
        """The sends/receives this action posts: an exchange's ops, (self,) for one send or
        receive, () for compute and REDUCE_GRAD."""
        if self.kind is ActionKind.EXCHANGE:
            return self.ops
        return (self,) if self.kind in _SENDS or self.kind in _RECVS else ()

    def __str__(self) -> str:
        if self.kind is ActionKind.EXCHANGE:
            return "+".join(map(str, self.ops))
        return f"{self.stage}{self.kind.value}{self.index}"

    def __repr__(self) -> str:
        return f"Action({self})"

    def __reduce__(self):  # pickle/copy through the keyword constructor
        return _rebuild_action, (self.stage, self.kind, self.index, self.ops)


def _rebuild_action(stage, kind, index, ops) -> Action:
    return Action(stage=stage, kind=kind, index=index, ops=ops)


def _check_exchange(stage: int, index: int, ops: tuple) -> None:
    if len(ops) < 2:
        raise ValueError(f"an exchange groups two or more sends/receives, got {len(ops)}; "
                         "post a single op as a plain action")
    for op in ops:
        if not isinstance(op, Action) or not (op.kind in _SENDS or op.kind in _RECVS):
            raise ValueError(f"an exchange holds sends/receives only, got {op!r}")
    if len(set(ops)) != len(ops):
        raise ValueError(f"exchange {'+'.join(map(str, ops))} posts an op twice")
    if stage != ops[0].stage or index != 0:
        raise ValueError("an exchange's stage is its first op's and its index is 0; build it "
                         "with Action.exchange(ops)")


def _parse_single(text: str) -> Action:
    match = _ACTION_RE.fullmatch(text)
    if match is None or match.group(2) not in _CODES:
        raise ScheduleError(f"cannot parse action {text!r}: expected <stage><code><index> such as "
                            f"'0PF1' or '1SFR3' (code one of {sorted(_CODES)}), or an exchange "
                            "of sends/receives joined by '+' such as '1SBS0+1SFR1'")
    stage, code, index = match.groups()
    return Action(stage=int(stage), kind=ActionKind(code), index=int(index))


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: `"1SF3"` -> Action(stage=1, kind=SUFFIX_FORWARD, index=3);
    `"1SBS0+1SFR1"` -> the exchange of those two ops."""
    text = text.strip()
    if "+" not in text:
        return _parse_single(text)
    ops = [_parse_single(part) for part in text.split("+")]
    try:
        return Action.exchange(ops)
    except ValueError as error:
        raise ScheduleError(f"cannot parse action {text!r}: {error}") from None


_HEADER = "model_chunks"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per-rank action lists; which rules they obey is `validate_schedule`'s business."""

    num_stages: int
    """Virtual pipeline stages = num_ranks * num_model_chunks; with one model chunk per rank
    (the default), the pipeline size."""
    actions: tuple[tuple[Action, ...], ...]
    """Row r = rank r's actions in execution order (lists are converted to tuples)."""
    num_model_chunks: int = 1
    """Model chunks per rank (Megatron's virtual pipeline size V); [Note: virtual stages]."""

    def __post_init__(self) -> None:
        check_count("Schedule.num_stages", self.num_stages, 1)
        check_count("Schedule.num_model_chunks", self.num_model_chunks, 1)
        if self.num_stages % self.num_model_chunks:
            raise ValueError(f"num_stages={self.num_stages} is not a multiple of "
                             f"num_model_chunks={self.num_model_chunks}; num_stages counts the "
                             "virtual stages, num_ranks * num_model_chunks")
        rows = tuple(tuple(row) for row in self.actions)
        if len(rows) != self.num_ranks:
            raise ValueError(f"Schedule has {len(rows)} action rows for {self.num_ranks} ranks "
                             f"(num_stages={self.num_stages}, num_model_chunks="
                             f"{self.num_model_chunks}); give exactly one row per rank")
        for row in rows:
            for action in row:
                if not isinstance(action, Action):
                    raise ValueError(f"Schedule rows hold Actions, got {action!r}")
        object.__setattr__(self, "actions", rows)

    @classmethod
    def _trusted(cls, num_stages: int, rows: tuple, num_model_chunks: int) -> "Schedule":
        """A schedule of `rows` (a tuple of tuples of Actions) built by a pass of this package:
        the per-action type check of __post_init__ skipped (it is linear but not free)."""
        schedule = object.__new__(cls)
        for name, value in (("num_stages", num_stages), ("actions", rows),
                            ("num_model_chunks", num_model_chunks)):
            object.__setattr__(schedule, name, value)
        assert len(rows) == num_stages // num_model_chunks
        return schedule

    # ---- layout ([Note: virtual stages])
    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (PP): one row each."""
        return self.num_stages // self.num_model_chunks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The virtual stages rank `rank` holds, by model chunk."""
        return tuple(range(rank, self.num_stages, self.num_ranks))

    def rank_of(self, action: Action) -> int:
        """The rank that executes `action` (its stage % num_ranks)."""
        return action.stage % self.num_ranks

    def model_chunk_of(self, action: Action) -> int:
        """The model chunk of its rank that `action` runs on (its stage // num_ranks)."""
        return action.stage // self.num_ranks

    def peer_rank(self, action: Action) -> Optional[int]:
        """The rank a send/receive talks to (a compute: where its output goes); None if none."""
        peer = peer_stage(action, self.num_stages)
        return None if peer is None else peer % self.num_ranks

    # ---- text and CSV forms
    def to_text(self) -> str:
        """One line per rank, `<rank>: <action> <action> ...`, after a `model_chunks: V` line
        when V > 1."""
        head = f"{_HEADER}: {self.num_model_chunks}\n" if self.num_model_chunks > 1 else ""
        return head + "".join(f"{s}: {' '.join(map(str, row))}".rstrip() + "\n"
                              for s, row in enumerate(self.actions))

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Inverse of `to_text`; blank lines and lines starting with '#' are skipped."""
        rows, chunks = [], 1
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            label, sep, rest = line.partition(":")
            if label.strip() == _HEADER and sep and not rows:
                chunks = _parse_chunks(rest)
                continue
            if not sep or label.strip() != str(len(rows)):
                raise ScheduleError(f"line {line!r}: expected '{len(rows)}: <actions>' "
                                    "(rows numbered from 0, in order)")
            rows.append(tuple(parse_action(tok) for tok in rest.split()))
        return cls._of_rows(rows, chunks)

    def to_csv(self) -> str:
        """One CSV row per rank, one action per cell (torchtitan `custom_schedule.csv` style),
        after a `model_chunks: V` row when V > 1."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        if self.num_model_chunks > 1:
            writer.writerow([f"{_HEADER}: {self.num_model_chunks}"])
        for row in self.actions:
            writer.writerow([str(action) for action in row])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        """Inverse of `to_csv`; empty cells are skipped."""
        lines = list(csv.reader(io.StringIO(text)))
        chunks = 1
        if lines and lines[0] and lines[0][0].startswith(_HEADER):
            label, _, rest = lines.pop(0)[0].partition(":")
            chunks = _parse_chunks(rest)
        rows = [tuple(parse_action(cell) for cell in cells if cell.strip()) for cells in lines]
        return cls._of_rows(rows, chunks)

    @classmethod
    def _of_rows(cls, rows: list, chunks: int) -> "Schedule":
        if not rows:
            raise ScheduleError("no action rows: a schedule has one row per rank")
        return cls(num_stages=len(rows) * chunks, actions=tuple(rows), num_model_chunks=chunks)


def _parse_chunks(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ScheduleError(f"'{_HEADER}:{text}': expected '{_HEADER}: V' with an int V >= 1")
    return int(text)


def unit_cost(action: Action) -> float:
    """Default costs: forward 1, backward 2 (twice the forward), p2p and grad reduce free."""
    if not action.kind.is_compute:
        return 0.0
    return 1.0 if action.kind.is_forward else 2.0


def peer_stage(action: Action, num_stages: int) -> Optional[int]:
    """The virtual stage a send/receive talks to; for a compute, where its output goes (None:
    nowhere); None for REDUCE_GRAD and EXCHANGE (ask each of its ops)."""
    kind = action.kind
    if kind is ActionKind.REDUCE_GRAD or kind is ActionKind.EXCHANGE:
        return None
    # forward data goes up, gradients come down; a receive faces the other way
    up = kind.is_forward != (kind in _RECVS)
    peer = action.stage + 1 if up else action.stage - 1
    return peer if 0 <= peer < num_stages else None


def peer_dependency(action: Action, num_stages: int) -> Optional[tuple[int, ActionKind, int]]:
    """The same action on the neighbouring stage that feeds this one, if any."""
    kind = action.kind
    if kind.is_forward and action.stage > 0:
        return action.stage - 1, kind, action.index
    if not kind.is_forward and action.stage < num_stages - 1:
        return action.stage + 1, kind, action.index
    return None
