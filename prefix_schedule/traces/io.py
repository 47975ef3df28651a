"""Streaming reader and writer of traces (format.py): one line at a time, a step at most in memory.

    from prefix_schedule.traces import read_steps, TraceWriter, TraceHeader
    for batch in read_steps("trace.jsonl"):      # GroupBatch per optimizer step, in order
        ...
    with TraceWriter("trace.jsonl.gz", TraceHeader(vocab_size=V, source="...")) as w:
        w.write_group(group, step=0)
"""
from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from prefix_schedule.planning.data import Group, GroupBatch
from prefix_schedule.traces.format import TraceHeader, group_from_record, record_from_group

__all__ = ["read_header", "read_steps", "iter_groups", "TraceGroup", "TraceWriter", "open_text"]

PathLike = Union[str, Path]


def open_text(path: PathLike, mode: str = "r"):
    """Open a trace (or any JSON-lines file) as text; gzip when the name ends in .gz."""
    path = Path(path)
    if mode == "r" and not path.is_file():
        raise ValueError(f"{path}: no such file; give the path of a trace (.jsonl or .jsonl.gz)")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _not_finite(text: str) -> float:
    # Python's json accepts NaN / Infinity; keep them so the field checks can name them.
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[text]


def parse_line(line: str, *, where: str) -> Any:
    try:
        return json.loads(line, parse_constant=_not_finite)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); every line "
                         "of a trace is one JSON object") from None


def read_header(path: PathLike) -> TraceHeader:
    """The trace's header (its first line)."""
    with open_text(path) as f:
        first = f.readline()
    if not first.strip():
        raise ValueError(f"{path}: empty file; a trace starts with its header line")
    try:
        return TraceHeader.from_json(parse_line(first, where=f"{path}:1"))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class TraceGroup:
    """One group as read from a trace, with where it came from."""

    step: int
    index: int
    """Position of the group in its step."""
    line: int
    group: Group
    rewards: Optional[list] = None
    uid: Optional[str] = None


def iter_groups(path: PathLike, *, vocab_size: Optional[int] = None) -> Iterator[TraceGroup]:
    """Every group of the trace, validated, in order. `vocab_size` overrides the header's."""
    header = read_header(path)
    vocab = vocab_size if vocab_size is not None else header.vocab_size
    expected_step, index = 0, 0
    with open_text(path) as f:
        f.readline()
        for number, line in enumerate(f, start=2):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            record = parse_line(line, where=where)
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                if step == expected_step + 1 and index > 0:
                    expected_step, index = step, 0
                if step != expected_step:
                    raise ValueError(f"{where}: step {step} after step {expected_step}; steps start "
                                     "at 0, increase by one, and a step's groups are consecutive "
                                     "lines")
                where = f"{where} (step {step}, group {index})"
            group = group_from_record(record, where=where, vocab_size=vocab)
            yield TraceGroup(step=step, index=index, line=number, group=group,
                             rewards=record.get("rewards"), uid=record.get("uid"))
            index += 1


def read_steps(path: PathLike, *, start: int = 0, stop: Optional[int] = None,
               vocab_size: Optional[int] = None) -> Iterator[GroupBatch]:
    """One GroupBatch per optimizer step, steps `start` <= s < `stop`, streamed (a step at a
    time). Every line is validated (ValueError naming the line and field)."""
    groups: list[Group] = []
    current = None
    for item in iter_groups(path, vocab_size=vocab_size):
        if stop is not None and item.step >= stop:
            break
        if item.step != current and groups:
            yield _batch(groups, current, path)
            groups = []
        current = item.step
        if item.step >= start:
            groups.append(item.group)
    if groups:
        yield _batch(groups, current, path)


def _batch(groups: list[Group], step: int, path: PathLike) -> GroupBatch:
    batch = GroupBatch(groups=groups)
    try:
        batch._check_logprob_presence()
    except ValueError as exc:
        raise ValueError(f"{path}: step {step}: {exc}") from None
    return batch


class TraceWriter:
    """Write a trace line by line (a context manager). Groups must come step by step."""

    def __init__(self, path: PathLike, header: TraceHeader) -> None:
        self.path = Path(path)
        self.header = header
        self._file = open_text(self.path, "w")
        self._file.write(json.dumps(header.to_json(), separators=(",", ":")) + "\n")
        self._step = 0
        self.num_groups = 0

    def write_group(self, group: Group, *, step: int, rewards=None, uid: Optional[str] = None) -> None:
        if step not in (self._step, self._step + 1) or (step != self._step and self.num_groups == 0):
            raise ValueError(f"write_group(step={step}) after step {self._step}; write steps 0, 1, "
                             "2, ... in order, each step's groups together")
        self._step = step
        record = record_from_group(group, step=step, rewards=rewards, uid=uid)
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self.num_groups += 1

    def write_step(self, batch: GroupBatch, *, step: int) -> None:
        for group in batch.groups:
            self.write_group(group, step=step)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
