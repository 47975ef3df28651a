"""Prefix-reuse pipeline schedules as data: actions per rank, text forms, generator, validator.

A schedule is one list of `Action`s per pipeline stage (one stage per rank), in execution order.
`str(action)` is compact text (`0PF1`, `1SF3`, `1SB3`, `0PB1`, `0SFS3`, `1SFR3`) and
`parse_action` reads it back exactly. `lowering.py` turns a compute-only plan into one with
point-to-point actions; `simulate.py` executes lowered plans with no model.

[Note: prefix-reuse dependency rules]
Microbatch m touches the groups `microbatch_groups[m]`; groups in `prefix_groups` have a cached
prefix and so a PF/PB pair on every stage. On each stage s:
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
from typing import TYPE_CHECKING, Callable, Collection, Mapping, Optional, Sequence

from prefix_schedule.units import StepShape

if TYPE_CHECKING:  # simulate imports this module; the trace only reads the result's timeline
    from prefix_schedule.simulate import SimResult

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError", "build_schedule", "format_grid",
           "parse_action", "unit_cost", "validate_schedule"]


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
    # Placeholder for the data-parallel gradient reduce of the rank's parameters (index 0).
    REDUCE_GRAD = "RG"

    is_compute = property(lambda self: self in _COMPUTE, doc="PF, SF, SB or PB.")
    is_send = property(lambda self: self in _SENDS, doc="A send lowering added.")
    is_recv = property(lambda self: self in _RECVS, doc="A receive lowering added.")
    is_forward = property(lambda self: self in _FORWARD,
                          doc="Forward compute, or a p2p kind that carries forward outputs.")
    compute = property(lambda self: _CARRIES[self],
                       doc="The compute kind whose data a p2p kind carries (others: itself).")


# Sets, not string tests on .value: these run once per action in every pass and simulation.
_COMPUTE = frozenset(k for k in ActionKind if len(k.value) == 2 and k.value != "RG")
_SENDS = frozenset(k for k in ActionKind if len(k.value) == 3 and k.value.endswith("S"))
_RECVS = frozenset(k for k in ActionKind if len(k.value) == 3 and k.value.endswith("R"))
_FORWARD = frozenset(k for k in ActionKind if k.value[1] == "F")
_CARRIES = {k: ActionKind(k.value[:2]) for k in ActionKind}  # RG carries itself
_ACTION_RE = re.compile(r"(0|[1-9][0-9]*)([A-Z]+)(0|[1-9][0-9]*)")


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Action:
    """One step of one rank's list."""

    stage: int
    """Pipeline stage (one per rank) that executes the action."""
    kind: ActionKind
    """What the action does."""
    index: int
    """Prefix unit for PF/PB and their p2p kinds (the group id unless prefixes are chunked:
    units.py); microbatch for SF/SB and theirs; 0 for REDUCE_GRAD."""

    def __post_init__(self) -> None:
        _check_count("Action.stage", self.stage, 0)
        _check_count("Action.index", self.index, 0)
        if not isinstance(self.kind, ActionKind):
            raise ValueError(f"Action.kind must be an ActionKind, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.index}"


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: `"1SF3"` -> Action(stage=1, kind=SUFFIX_FORWARD, index=3)."""
    match = _ACTION_RE.fullmatch(text.strip())
    codes = {kind.value for kind in ActionKind}
    if match is None or match.group(2) not in codes:
        raise ScheduleError(f"cannot parse action {text!r}: expected <stage><code><index> such as "
                            f"'0PF1' or '1SFR3', with code one of {sorted(codes)}")
    stage, code, index = match.groups()
    return Action(stage=int(stage), kind=ActionKind(code), index=int(index))


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Per-rank action lists; which rules they obey is `validate_schedule`'s business."""

    num_stages: int
    """Pipeline stages, one per rank."""
    actions: tuple[tuple[Action, ...], ...]
    """Row s = rank s's actions in execution order (lists are converted to tuples)."""

    def __post_init__(self) -> None:
        _check_count("Schedule.num_stages", self.num_stages, 1)
        rows = tuple(tuple(row) for row in self.actions)
        if len(rows) != self.num_stages:
            raise ValueError(f"Schedule has {len(rows)} action rows for num_stages="
                             f"{self.num_stages}; give exactly one row per stage")
        for row in rows:
            for action in row:
                if not isinstance(action, Action):
                    raise ValueError(f"Schedule rows hold Actions, got {action!r}")
        object.__setattr__(self, "actions", rows)

    def to_text(self) -> str:
        """One line per rank: `<rank>: <action> <action> ...`."""
        return "".join(f"{s}: {' '.join(map(str, row))}".rstrip() + "\n"
                       for s, row in enumerate(self.actions))

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Inverse of `to_text`; blank lines and lines starting with '#' are skipped."""
        rows = []
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            label, sep, rest = line.partition(":")
            if not sep or label.strip() != str(len(rows)):
                raise ScheduleError(f"line {line!r}: expected '{len(rows)}: <actions>' "
                                    "(rows numbered from 0, in order)")
            rows.append(tuple(parse_action(tok) for tok in rest.split()))
        return cls(num_stages=len(rows), actions=tuple(rows))

    def to_csv(self) -> str:
        """One CSV row per rank, one action per cell (torchtitan `custom_schedule.csv` style)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(action) for action in row])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        """Inverse of `to_csv`; empty cells are skipped."""
        rows = [tuple(parse_action(cell) for cell in cells if cell.strip())
                for cells in csv.reader(io.StringIO(text))]
        return cls(num_stages=len(rows), actions=tuple(rows))

    def to_chrome_trace(self, sim_result: "SimResult") -> str:
        """Chrome/Perfetto trace JSON of a simulated run of this plan (1 cost unit = 1 us)."""
        from prefix_schedule.simulate import chrome_trace  # simulate imports this module

        return chrome_trace(sim_result)


def unit_cost(action: Action) -> float:
    """Default costs: forward 1, backward 2 (twice the forward), p2p and grad reduce free."""
    if not action.kind.is_compute:
        return 0.0
    return 1.0 if action.kind.is_forward else 2.0


def format_grid(schedule: Schedule, marks: Optional[Mapping[tuple[int, int], str]] = None,
                *, width: int = 16) -> str:
    """Per-rank grid by step; `marks[(rank, step)]` flags a cell with `>...<` and a note below.

    A mark at step == len(row) flags the end of the row (something is missing there)."""
    marks = dict(marks or {})
    cells = [[str(a) for a in row] + (["(end)"] if (s, len(row)) in marks else [])
             for s, row in enumerate(schedule.actions)]
    num_steps = max((len(row) for row in cells), default=0)
    cell_w = max([len(c) for row in cells for c in row] + [4]) + 2
    lines = []
    for lo in range(0, max(num_steps, 1), width):
        steps = range(lo, min(lo + width, num_steps))
        lines.append("step  " + "".join(f"{i:^{cell_w}}" for i in steps))
        for s, row in enumerate(cells):
            text = [(f">{row[i]}<" if (s, i) in marks else f" {row[i]} ") if i < len(row) else ""
                    for i in steps]
            lines.append(f"rank{s:<2}" + "".join(f"{c:^{cell_w}}" for c in text).rstrip())
    lines += [f"  rank {s} step {i}: {note}" for (s, i), note in sorted(marks.items())]
    return "\n".join(lines)


# ---------------------------------------------------------------- dependencies
def _shape(microbatch_groups, prefix_groups, prefix_units) -> StepShape:
    return StepShape(microbatch_groups=microbatch_groups, prefix_groups=prefix_groups,
                     prefix_units=prefix_units)


def _peer_dependency(action: Action, num_stages: int) -> Optional[tuple[int, ActionKind, int]]:
    """The same action on the neighbouring stage that feeds this one, if any."""
    kind = action.kind
    if kind.is_forward and action.stage > 0:
        return action.stage - 1, kind, action.index
    if not kind.is_forward and action.stage < num_stages - 1:
        return action.stage + 1, kind, action.index
    return None


def _local_rule(action: Action, done: set, shape: StepShape) -> Optional[str]:
    """Why `action` may not run yet on its stage given the stage's `done` (kind, index) set."""
    need = shape.local_needs(action.kind.value, action.index)
    missing = [f"{action.stage}{code}{j}" for code, j in need if (ActionKind(code), j) not in done]
    return f"runs before {', '.join(missing)} on its stage" if missing else None


# ---------------------------------------------------------------- validator
def validate_schedule(schedule: Schedule, *, microbatch_groups: Sequence[Sequence[int]],
                      prefix_groups: Collection[int],
                      prefix_units: Optional[Mapping[int, tuple[int, int]]] = None) -> None:
    """Check every rule of [Note: prefix-reuse dependency rules]; p2p actions are skipped here
    (the simulator checks them). `prefix_units`: unit -> (group, chunk) of a chunked step
    ([Note: prefix chunks] in units.py). Raises ScheduleError with the grid and the failing step
    marked."""
    shape = _shape(microbatch_groups, prefix_groups, prefix_units)
    kinds = ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_FORWARD, \
        ActionKind.PREFIX_BACKWARD
    required = {(k, m) for m in range(len(shape.microbatch_groups)) for k in kinds[:2]} | {
        (k, u) for u in shape.units for k in kinds[2:]}
    for s, row in enumerate(schedule.actions):
        done: set = set()
        for i, action in enumerate(row):
            problem = _row_problem(action, s, done, required, shape)
            if problem:
                _fail(schedule, {(s, i): problem}, f"rank {s} step {i}: {action} {problem}")
            if action.kind.is_compute:
                done.add((action.kind, action.index))
        missing = sorted(f"{s}{k.value}{j}" for k, j in required - done)
        if missing:
            _fail(schedule, {(s, len(row)): f"missing {' '.join(missing)}"},
                  f"rank {s} never runs {', '.join(missing)}")
    _check_progress(schedule)


def _row_problem(action, s, done, required, shape) -> Optional[str]:
    if action.stage != s:
        return f"belongs to stage {action.stage} but sits in rank {s}'s row"
    if not action.kind.is_compute:
        return None
    if (action.kind, action.index) not in required:
        what = "group with a cached prefix" if action.kind.value[0] == "P" else "microbatch"
        return f"names no {what} of this step"
    if (action.kind, action.index) in done:
        return "runs twice"
    return _local_rule(action, done, shape)


def _check_progress(schedule: Schedule) -> None:
    """Walk all rows together, each action waiting for its peer dependency; stuck means deadlock."""
    num, rows = schedule.num_stages, schedule.actions
    pos, done = [0] * num, set()
    progress = True
    while progress:
        progress = False
        for s in range(num):
            while pos[s] < len(rows[s]):
                action = rows[s][pos[s]]
                dep = _peer_dependency(action, num) if action.kind.is_compute else None
                if dep is not None and dep not in done:
                    break
                done.add((s, action.kind, action.index))
                pos[s], progress = pos[s] + 1, True
    stuck = {(s, pos[s]): "waits for " + "{}{}{}".format(dep[0], dep[1].value, dep[2])
             for s in range(num) if pos[s] < len(rows[s])
             for dep in [_peer_dependency(rows[s][pos[s]], num)]}
    if stuck:
        _fail(schedule, stuck, "deadlock: every unfinished rank waits on another")


def _fail(schedule: Schedule, marks: Mapping[tuple[int, int], str], headline: str) -> None:
    raise ScheduleError(f"{headline}\n{format_grid(schedule, marks)}")


# ---------------------------------------------------------------- generator
def build_schedule(*, num_stages: int, microbatch_groups: Sequence[Sequence[int]],
                   prefix_groups: Collection[int],
                   cost: Optional[Callable[[Action], float]] = None,
                   prefix_units: Optional[Mapping[int, tuple[int, int]]] = None) -> Schedule:
    """Compute-only prefix-reuse plan: 1F1B over the suffix microbatches, prefix work slotted in.

    The stages are played forward in (modelled) time with `cost` (default `unit_cost`). A free
    stage runs, in this order of preference: a prefix backward whose inputs are ready (frees the
    prefix soon and fills idle time), the next 1F1B action (preceded by the PFs of any group it
    is the first to touch), or, if that must wait, the next prefix unit's PF (fills a 1F1B
    bubble; at most one group is forwarded ahead of its first suffix). Every pick is an action
    whose inputs exist, so the order is deadlock-free whatever the real costs turn out to be.
    With one stage this gives PF g, SF m, SB m, then PB g right after the SB of g's last
    microbatch (a chunked group: its PF chunks in order, its PB chunks in reverse).
    `prefix_units` (unit -> (group, chunk)) splits prefixes into chunks ([Note: prefix chunks]
    in units.py); PF/PB indices are then unit ids. Measured (tests, tools/plan.py): the bubble
    fraction is at most dense 1F1B's while a prefix unit's forward costs no more than a
    suffix-microbatch forward; a dearer unprefixed prefix is one long chain through the stages,
    and its fill shows as a larger fraction -- chunking it removes that."""
    _check_count("num_stages", num_stages, 1)
    shape = _shape(microbatch_groups, prefix_groups, prefix_units)
    return _Planner(num_stages, shape, cost or unit_cost).run()


def _one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list:
    """Classic 1F1B order of one stage: warmup forwards, steady 1F1B, cooldown backwards."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    forwards = [(ActionKind.SUFFIX_FORWARD, m) for m in range(num_microbatches)]
    backwards = [(ActionKind.SUFFIX_BACKWARD, m) for m in range(num_microbatches)]
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[num_microbatches - warmup:]


class _Planner:
    """Event-driven play of the stages; see `build_schedule` for the policy."""

    def __init__(self, num_stages, shape: StepShape, cost) -> None:
        self.num, self.shape, self.cost = num_stages, shape, cost
        self.groups_of = shape.microbatch_groups
        groups = dict.fromkeys(g for gs in self.groups_of for g in gs if g in shape.prefix_groups)
        # PFs run in this order on every stage: groups by first use, each group's chunks in order
        self.prefix_order = [u for g in groups for u in shape.chunks_of[g]]
        self.uses = {g: sum(g in gs for gs in self.groups_of) for g in groups}
        self.base = [_one_f_one_b(s, num_stages, len(self.groups_of)) for s in range(num_stages)]
        self.pos = [0] * num_stages
        self.left = [len(row) + 2 * len(self.prefix_order) for row in self.base]  # to place
        self.end: dict[tuple[int, ActionKind, int], float] = {}  # finish time of each placed action
        self.num_pf = [0] * num_stages  # PFs placed per stage (always a prefix of prefix_order)
        self.sb_left = [dict(self.uses) for _ in range(num_stages)]
        self.unused = [set() for _ in range(num_stages)]  # forwarded groups no SF has read yet
        self.rows: list[list[Action]] = [[] for _ in range(num_stages)]

    def run(self) -> Schedule:
        free, now = [0.0] * self.num, 0.0
        while not all(self._finished(s) for s in range(self.num)):
            for s in range(self.num):
                if free[s] <= now and not self._finished(s):
                    action = self._pick(s, now)
                    if action is not None:
                        free[s] = self._place(action, now)
            later = [t for t in free if t > now]
            assert later, f"planner stalled at t={now}: {self.rows}"
            now = min(later)
        return Schedule(num_stages=self.num, actions=tuple(map(tuple, self.rows)))

    def _finished(self, s: int) -> bool:
        return self.left[s] == 0

    def _ready(self, action: Action, now: float) -> bool:
        dep = _peer_dependency(action, self.num)
        return dep is None or self.end.get(dep, now + 1) <= now

    def _placed(self, s: int, kind: ActionKind, index: Optional[int]) -> bool:
        return index is None or (s, kind, index) in self.end

    def _pick(self, s: int, now: float) -> Optional[Action]:
        for u in self.prefix_order[:self.num_pf[s]]:
            pb = Action(stage=s, kind=ActionKind.PREFIX_BACKWARD, index=u)
            # chunks backward in reverse: the next chunk's PB must be placed already
            if (self.sb_left[s][self.shape.group_of(u)] == 0 and not self._placed(s, pb.kind, u)
                    and self._placed(s, pb.kind, self.shape.next_chunk(u))
                    and self._ready(pb, now)):
                return pb
        nxt = self._next_required(s)
        if nxt is not None and self._ready(nxt, now):
            return nxt
        if self.num_pf[s] < len(self.prefix_order):
            unit = self.prefix_order[self.num_pf[s]]
            early = Action(stage=s, kind=ActionKind.PREFIX_FORWARD, index=unit)
            if not self.unused[s] - {self.shape.group_of(unit)} and self._ready(early, now):
                return early
        return None

    def _next_required(self, s: int) -> Optional[Action]:
        if self.pos[s] == len(self.base[s]):
            return None
        kind, m = self.base[s][self.pos[s]]
        if kind is ActionKind.SUFFIX_FORWARD:
            for g in self.groups_of[m]:
                if g in self.uses and not self._placed(s, ActionKind.PREFIX_FORWARD,
                                                       self.shape.chunks_of[g][-1]):
                    unit = self.prefix_order[self.num_pf[s]]
                    assert self.shape.group_of(unit) == g, "PFs run in first-use order"
                    return Action(stage=s, kind=ActionKind.PREFIX_FORWARD, index=unit)
        return Action(stage=s, kind=kind, index=m)

    def _place(self, action: Action, now: float) -> float:
        s, kind, i = action.stage, action.kind, action.index
        cost = float(self.cost(action))
        if not cost > 0:
            raise ValueError(f"cost({action}) = {cost}: compute costs must be > 0")
        if kind is ActionKind.PREFIX_FORWARD:
            assert self.prefix_order[self.num_pf[s]] == i, "PFs run in first-use order"
            self.num_pf[s] += 1
            self.unused[s].add(self.shape.group_of(i))
        elif kind in (ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD):
            self.pos[s] += 1
            for g in self.groups_of[i]:
                self.unused[s].discard(g)
                if kind is ActionKind.SUFFIX_BACKWARD and g in self.uses:
                    self.sb_left[s][g] -= 1
        self.end[(s, kind, i)] = now + cost
        self.rows[s].append(action)
        self.left[s] -= 1
        return now + cost
