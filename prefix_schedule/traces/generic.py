"""Import the generic JSON-lines layout: one line per trajectory, as RL frameworks hold them.

verl, NeMo-RL and most GRPO trainers keep a step's samples flattened (one row per trajectory,
the group known by a prompt id); this layout is that row, unpadded:

    {"step": 0, "group": "prompt-17",            # group: any id (str/int); optional: lines
     "prompt": [..token ids..],                   #   with identical prompts then form a group
     "response": [..token ids..],
     "advantage": 0.83,                           # a float, or one float per response token
     "loss_mask": [1, 1, 0, ...],                 # optional (alias: "response_mask")
     "old_logprobs": [...], "ref_logprobs": [...], "reward": 1.0}   # optional

Lines of one step must be consecutive, steps in increasing order (any numbering: they are
renumbered 0, 1, ...). Ids are compared as text: step 0 and step "0" are one step, group 7 and
group "7" one group (JSON writers differ in how they write an id). Within a step, trajectories of one group keep their line order and groups
their order of first appearance; every trajectory of a group must carry the same prompt (checked
token by token). Per-token arrays are per response token (entry i is about predicting
response[i]), as in the trace format.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from prefix_schedule.traces.format import TraceHeader
from prefix_schedule.traces.io import PathLike, TraceWriter
from prefix_schedule.traces.lines import iter_lines, parse_line

__all__ = ["import_generic", "GENERIC_FIELDS"]

GENERIC_FIELDS = {"step", "group", "prompt", "response", "advantage", "loss_mask",
                  "response_mask", "old_logprobs", "ref_logprobs", "reward"}


def _lines(path: PathLike) -> Iterator[tuple[int, dict]]:
    for number, line in iter_lines(path):
        if line.strip():
            where = f"{path}:{number}"
            row = parse_line(line, where=where)
            _check_row(row, where)
            yield number, row


def _check_row(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object (one trajectory)")
    unknown = sorted(set(row) - GENERIC_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known fields: {sorted(GENERIC_FIELDS)}")
    missing = [k for k in ("step", "prompt", "response", "advantage") if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; each line needs step, prompt, "
                         "response and advantage (see the generic layout in the README)")
    if "loss_mask" in row and "response_mask" in row:
        raise ValueError(f"{where}: both loss_mask and response_mask given; give one")
    if not isinstance(row["prompt"], list):
        raise ValueError(f"{where}: prompt must be a list of token ids")
    for name in ("step", "group"):  # ids: compared and used as keys
        value = row.get(name, "")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{where}: {name} is {type(value).__name__} {str(value)[:30]!r}; "
                             f"give the {name} id as an int or a string")


def _steps(path: PathLike) -> Iterator[tuple[Any, list[tuple[int, dict]]]]:
    current, rows, seen = None, [], set()
    for number, row in _lines(path):
        step = str(row["step"])  # 0 and "0" are one step
        if rows and step != current:
            yield current, rows
            rows = []
        if step != current:
            if step in seen:
                raise ValueError(f"{path}:{number}: step {row['step']!r} appears again after other steps; "
                                 "write each step's lines together")
            seen.add(step)
            current = step
        rows.append((number, row))
    if rows:
        yield current, rows


def _group_records(path: PathLike, step: int, rows: list[tuple[int, dict]]) -> list[dict]:
    groups: dict = {}
    for number, row in rows:
        key = ("id", str(row["group"])) if "group" in row else ("prompt", tuple(row["prompt"]))
        record = groups.get(key)
        if record is None:
            record = groups[key] = {"step": step, "prompt": row["prompt"], "responses": [],
                                    "advantages": [], "_lines": [],
                                    "_id": row.get("group", f"with the prompt of line {number}")}
        elif row["prompt"] != record["prompt"]:
            first = next((i for i, (a, b) in enumerate(zip(row["prompt"], record["prompt"]))
                          if a != b), min(len(row["prompt"]), len(record["prompt"])))
            raise ValueError(f"{path}:{number}: group {row['group']!r}: the prompt differs from its "
                             f"first trajectory's (line {record['_lines'][0]}) at token {first}; "
                             "a group's trajectories share one prompt")
        _append(record, row, number)
    return list(groups.values())


def _append(record: dict, row: dict, number: int) -> None:
    index = len(record["responses"])
    record["responses"].append(row["response"])
    record["advantages"].append(row["advantage"])
    record["_lines"].append(number)
    mask = row.get("loss_mask", row.get("response_mask"))
    for name, value in (("loss_mask", mask), ("old_logprobs", row.get("old_logprobs")),
                        ("ref_logprobs", row.get("ref_logprobs")), ("rewards", row.get("reward"))):
        present = name in record
        if index == 0 and value is not None:
            record[name] = [value]
        elif present != (value is not None):
            raise ValueError(f"line {number}: {name} is {'missing' if present else 'given'} here but "
                             f"{'given' if present else 'missing'} on line {record['_lines'][0]} of "
                             "the same group; give it for every trajectory or for none")
        elif present:
            record[name].append(value)
    if mask is not None:  # booleans are fine in masks
        record["loss_mask"][-1] = [int(v) if isinstance(v, bool) else v for v in mask]


def import_generic(path: PathLike, out: PathLike, *, vocab_size: Optional[int] = None,
                   source: str = "") -> int:
    """Convert a generic JSON-lines file to a trace; returns the number of steps written.
    Every group is validated as the trace reader would (ValueError naming input line and field)."""
    from prefix_schedule.traces.format import group_from_record

    header = TraceHeader(vocab_size=vocab_size, source=source or f"import-generic {path}")
    steps = 0
    with TraceWriter(out, header) as writer:
        for step, (_, rows) in enumerate(_steps(path)):
            for record in _group_records(path, step, rows):
                lines, group_id = record.pop("_lines"), record.pop("_id")
                where = f"{path}: lines {lines} (step {step}, group {group_id!r})"
                group = group_from_record(record, where=where, vocab_size=vocab_size)
                writer.write_group(group, step=step, rewards=record.get("rewards"))
            steps += 1
        if not steps:
            raise ValueError(f"{path}: no trajectories (the file is empty or blank); give one "
                             "JSON line per trajectory (the generic layout above)")
    return steps
