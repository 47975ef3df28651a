"""The schedule IR: typed actions per pipeline rank, their text and CSV forms, the grid printer.

A schedule is one list of `Action`s per pipeline stage (one stage per rank), in execution order.
`str(action)` is compact text (`0PF1`, `1SF3`, `1SB3`, `0PB1`, `0SFS3`, `1SFR3`) and
`parse_action` reads it back exactly. This module knows nothing of how schedules are made
(generate.py), checked (validate.py), lowered (lowering.py) or simulated (simulate.py): those
import it, never the reverse.

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
from typing import Mapping, Optional

__all__ = ["Action", "ActionKind", "Schedule", "ScheduleError", "format_grid", "check_count",
           "parse_action", "peer_dependency", "unit_cost"]


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


def check_count(name: str, value: object, minimum: int) -> None:
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
        check_count("Action.stage", self.stage, 0)
        check_count("Action.index", self.index, 0)
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
        check_count("Schedule.num_stages", self.num_stages, 1)
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


def peer_dependency(action: Action, num_stages: int) -> Optional[tuple[int, ActionKind, int]]:
    """The same action on the neighbouring stage that feeds this one, if any."""
    kind = action.kind
    if kind.is_forward and action.stage > 0:
        return action.stage - 1, kind, action.index
    if not kind.is_forward and action.stage < num_stages - 1:
        return action.stage + 1, kind, action.index
    return None
