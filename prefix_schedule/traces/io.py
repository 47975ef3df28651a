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
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from prefix_schedule.planning.data import Group, GroupBatch
from prefix_schedule.traces.format import TraceHeader, group_from_record, record_from_group
from prefix_schedule.traces.lines import iter_lines, parse_line

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


def read_header(path: PathLike) -> TraceHeader:
    """The trace's header (its first line)."""
    first = next((text for _, text in iter_lines(path)), "")
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
    for number, line in iter_lines(path):
        if number == 1 or not line.strip():
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
    """Write a trace line by line (a context manager). Groups must come step by step.

    The lines go to a temporary file beside `path`, renamed to `path` when the writer closes
    without an error: a reader never sees half a trace, a failed import leaves no output (and
    whatever was at `path` before), and an input named as the output is read whole first."""

    def __init__(self, path: PathLike, header: TraceHeader) -> None:
        self.path = Path(path)
        self.header = header
        if not self.path.parent.is_dir():
            raise ValueError(f"{self.path}: the directory {self.path.parent} does not exist; "
                             "create it or write the trace elsewhere")
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.",
                                   suffix=".tmp")
        os.close(fd)
        self._tmp = Path(tmp)
        raw = gzip.open(self._tmp, "wb") if self.path.suffix == ".gz" else open(self._tmp, "wb")
        self._file = io.TextIOWrapper(raw, encoding="utf-8")
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
        """Finish the trace: it appears at `path` now, whole."""
        if self._file.closed:
            return
        self._file.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        """Drop what was written; `path` is left as it was."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()
