"""The RL trace format, version 1: one optimizer step's groups per step, as JSON lines.

A trace is a UTF-8 text file (optionally gzip-compressed: a name ending in `.gz`), never a
pickle. Its first line is the header, every further line one group of one step:

    {"format": "prefix-reuse-trace", "version": 1, "vocab_size": 151936,
     "source": "synth rag seed 0", "metadata": {...}}
    {"step": 0, "prompt": [..P token ids..],
     "responses": [[..n_0 ids..], [..n_1 ids..], ...],
     "advantages": [0.7, -1.2, ...],                 # per response: a float or n_i floats
     "loss_mask": [[1, 1, 0, ...], ...],             # optional, 0/1 per response token
     "old_logprobs": [[-0.3, ...], ...],             # optional, log p_old(response[i])
     "ref_logprobs": [[-0.4, ...], ...],             # optional, log p_ref(response[i])
     "rewards": [1.0, 0.0, ...], "uid": "..."}        # optional, informational only

Per-token arrays follow DESIGN.md "[Note: the split of a trajectory]": entry i is about
predicting `responses[r][i]` (the token after `prompt + responses[r][:i]`). Steps start at 0 and
increase by one; a step's groups are consecutive lines. `vocab_size` (optional) bounds every
token id. Readers stream line by line, so a step is the most ever held in memory.

Every field is checked where it is read: `group_from_record` raises a ValueError that names the
line, step, group, response and entry, and says what to fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from prefix_schedule.planning.data import MAX_ABS_ADVANTAGE, Group, Trajectory

__all__ = ["FORMAT", "FORMAT_VERSION", "TraceHeader", "group_from_record", "record_from_group",
           "REQUIRED_FIELDS", "OPTIONAL_FIELDS"]

FORMAT = "prefix-reuse-trace"
FORMAT_VERSION = 1
REQUIRED_FIELDS = ("step", "prompt", "responses", "advantages")
OPTIONAL_FIELDS = ("loss_mask", "old_logprobs", "ref_logprobs", "rewards", "uid")
_PER_TOKEN = ("loss_mask", "old_logprobs", "ref_logprobs")


@dataclass(frozen=True, kw_only=True)
class TraceHeader:
    """The first line of a trace."""

    version: int = FORMAT_VERSION
    """Format version; readers refuse versions they do not know."""
    vocab_size: Optional[int] = None
    """Every token id must be < vocab_size (None: not checked against a vocabulary)."""
    source: str = ""
    """Where the trace came from (free text: the command, the framework, the run)."""
    metadata: dict = field(default_factory=dict)
    """Anything else worth keeping (JSON values)."""

    def __post_init__(self) -> None:
        if self.version != FORMAT_VERSION:
            raise ValueError(f"trace version {self.version!r} is not supported (this reader knows "
                             f"version {FORMAT_VERSION}); convert the trace or upgrade")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(
                self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"header: vocab_size={self.vocab_size!r}; give an int >= 1 or null")
        if not isinstance(self.source, str):
            raise ValueError(f"header: source={self.source!r}; give a string")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"header: metadata={self.metadata!r}; give a JSON object")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": self.version, "vocab_size": self.vocab_size,
                "source": self.source, "metadata": self.metadata}

    @classmethod
    def from_json(cls, obj: Any) -> "TraceHeader":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"line 1 is not a trace header: expected an object with \"format\": "
                             f"\"{FORMAT}\" (is this a trace written by tools/trace.py, or a raw "
                             "rollout dump that needs `tools/trace.py import-...` first?)")
        unknown = set(obj) - {"format", "version", "vocab_size", "source", "metadata"}
        if unknown:
            raise ValueError(f"header: unknown field(s) {sorted(unknown)}; put extra information "
                             "under \"metadata\"")
        if "version" not in obj:
            raise ValueError("header: no \"version\" field; version 1 traces carry \"version\": 1")
        return cls(version=obj["version"], vocab_size=obj.get("vocab_size"),
                   source=obj.get("source", ""), metadata=obj.get("metadata") or {})


def _int_list(value: Any, *, where: str, vocab_size: Optional[int]) -> torch.Tensor:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of token ids, got "
                         f"{_describe(value)}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        bad = next(i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, int))
        raise ValueError(f"{where}[{bad}] is {value[bad]!r}; token ids must be integers")
    low, high_id = min(value), max(value)
    if low < 0 or high_id >= 2 ** 63:  # torch.tensor would wrap or overflow
        i = value.index(low if low < 0 else high_id)
        raise ValueError(f"{where}[{i}] is token {str(value[i])[:30]}, outside "
                         f"{f'[0, {vocab_size})' if vocab_size is not None else '[0, 2**63)'}; "
                         "token ids are vocabulary indices")
    tokens = torch.tensor(value, dtype=torch.int64)
    high = vocab_size if vocab_size is not None else None
    bad = (tokens < 0) if high is None else (tokens < 0) | (tokens >= high)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        bound = f"[0, {high})" if high is not None else ">= 0"
        raise ValueError(f"{where}[{i}] is token {int(tokens[i])}, outside {bound}"
                         + ("; the header's vocab_size is too small or the trace was tokenized "
                            "with another tokenizer" if high is not None else ""))
    return tokens


def _float_list(value: Any, *, where: str, length: int) -> torch.Tensor:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of {length} numbers, got {_describe(value)}")
    if len(value) != length:
        raise ValueError(f"{where} has {len(value)} entries but the response has {length} tokens; "
                         "give one entry per response token")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        bad = next(i for i, v in enumerate(value) if isinstance(v, bool) or not isinstance(v, (int, float)))
        raise ValueError(f"{where}[{bad}] is {value[bad]!r}; expected a number")
    values = torch.tensor([_finite_float(v) for v in value], dtype=torch.float64)
    bad = ~torch.isfinite(values)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{where}[{i}] is {value[i]}; every entry must be finite (put any finite "
                         "value, e.g. 0, at positions the loss mask excludes)")
    return values


def _finite_float(value: float) -> float:
    """A JSON number as a float; an integer beyond float64 (JSON allows 10**400) becomes inf,
    which the callers then refuse with the field named."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _advantages(value: Any, *, where: str, length: int) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, (int, float, list)):
        raise ValueError(f"{where}: expected a number or a list of {length} numbers, got "
                         f"{_describe(value)}")
    if isinstance(value, list):
        values = _float_list(value, where=where, length=length)
    else:
        value = _finite_float(value)
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}; advantages must be finite (a NaN usually means "
                             "a group whose rewards all failed: drop it or give it advantage 0)")
        values = torch.full((length,), float(value), dtype=torch.float64)
    too_big = values.abs() > MAX_ABS_ADVANTAGE
    if too_big.any():
        i = int(too_big.nonzero()[0, 0])
        raise ValueError(f"{where}: {float(values[i])} is beyond +-{MAX_ABS_ADVANTAGE:g}; normalise "
                         "the advantages (rewards minus a baseline, divided by their std)")
    return values


def _per_response(record: dict, name: str, count: int, where: str) -> Optional[list]:
    value = record.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count:
        got = f"{len(value)} entries" if isinstance(value, list) else _describe(value)
        raise ValueError(f"{where}: \"{name}\" has {got} but there are {count} responses; give "
                         "one entry per response")
    return value


def _check_keys(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object (one group), got {_describe(record)}")
    missing = [k for k in REQUIRED_FIELDS if k not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; a group needs {list(REQUIRED_FIELDS)}")
    unknown = sorted(set(record) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known optional fields are "
                         f"{list(OPTIONAL_FIELDS)} (check the spelling)")
    step = record["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: step={step!r}; give the optimizer step as an int >= 0")


def group_from_record(record: Any, *, where: str, vocab_size: Optional[int] = None) -> Group:
    """One trace line (already parsed) -> a validated Group; ValueError naming what is wrong."""
    _check_keys(record, where)
    prompt = _int_list(record["prompt"], where=f"{where}: prompt", vocab_size=vocab_size)
    responses = record["responses"]
    if not isinstance(responses, list) or not responses:
        raise ValueError(f"{where}: \"responses\" is {_describe(responses)}; a group needs at least "
                         "one response (drop empty groups)")
    count = len(responses)
    advantages = _per_response(record, "advantages", count, where)
    arrays = {name: _per_response(record, name, count, where) for name in _PER_TOKEN}
    _per_response(record, "rewards", count, where)
    trajectories = []
    for r, response in enumerate(responses):
        at = f"{where}, response {r}"
        suffix = _int_list(response, where=f"{at}: tokens", vocab_size=vocab_size)
        n = suffix.numel()
        fields = {"advantages": _advantages(advantages[r], where=f"{at}: advantages", length=n)}
        for name, values in arrays.items():
            if values is not None:
                fields[name] = _float_list(values[r], where=f"{at}: {name}", length=n)
        try:
            trajectories.append(Trajectory(suffix=suffix, **fields))
        except ValueError as exc:
            raise ValueError(f"{at}: {exc}") from None
    return Group(prefix=prompt, trajectories=trajectories)


def _floats(t: torch.Tensor) -> list:
    return [float(v) for v in t.tolist()]


def record_from_group(group: Group, *, step: int, rewards=None, uid: Optional[str] = None) -> dict:
    """A Group -> one trace line (a dict ready for json.dumps). Per-response constant advantages
    are written as one float."""
    advantages = []
    for t in group.trajectories:
        a = t.advantages
        advantages.append(float(a[0]) if bool((a == a[0]).all()) else _floats(a))
    record: dict = {"step": step, "prompt": group.prefix.tolist(),
                    "responses": [t.suffix.tolist() for t in group.trajectories],
                    "advantages": advantages}
    if any(bool((t.loss_mask != 1).any()) for t in group.trajectories):
        record["loss_mask"] = [[int(v) for v in t.loss_mask.tolist()] for t in group.trajectories]
    for name in ("old_logprobs", "ref_logprobs"):
        if group.trajectories[0].__dict__[name] is not None:
            record[name] = [_floats(getattr(t, name)) for t in group.trajectories]
    if rewards is not None:
        record["rewards"] = [float(r) for r in rewards]
    if uid is not None:
        record["uid"] = str(uid)
    return record
