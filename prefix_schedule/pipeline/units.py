"""Prefix units: a group's cached prefix as one or more chunks, each its own PF/PB action.

[Note: prefix chunks]
With `prefix_chunk_tokens` set, the P-1 cached tokens of a group are split into chunks of at most
that many tokens (`chunk_spans`: fixed-size chunks in order, the last one may be shorter). Each
chunk is a *prefix unit*: its own PF/PB action pair on every stage, with its own p2p (hidden
states [chunk_len, 1, h]), so a long prefix flows through the pipeline like microbatches instead
of one long action that must pass every stage before any suffix can start.
Chunk c's forward is the two-part attention a suffix does, with the K/V of its group's chunks < c
(read from the cache) as the "prefix": causal within the chunk, positions continuing at the
chunk's offset; it stores its own K/V. Reading earlier chunks goes through the cache's
accumulator, so chunk c's backward adds gK/gV into the fp32 buffers of chunks < c. Hence, per
stage:
    PF (g, c)  after PF (g, c-1);
    PB (g, c)  after PF (g, c), every SB of g, and PB (g, c+1)   (chunks backward in reverse).
A suffix reads the concatenation of all its group's chunks, so SF m needs every chunk's PF.
Prefix trees ([Note: prefix trees] in planning/tree.py) generalise the chain: `unit_parents`
gives each unit's parent unit (same group, None for the root), and the rules become PF u after
PF parent(u), PB u after the PB of every child of u.
Unit ids are the PF/PB action indices; `StepShape.units` maps them to (group, chunk). Without a
table every prefix group is one unit whose id is the group id, so unchunked schedules read as
before (PF g is group g's prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from prefix_schedule.pipeline.ir import ActionKind, check_count

__all__ = ["StepShape", "chunk_spans", "number_units"]

_PF, _SF = ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD
_SB, _PB = ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD


def chunk_spans(length: int, chunk_tokens: Optional[int]) -> tuple[tuple[int, int], ...]:
    """(start, length) of each chunk of `length` cached tokens, at most `chunk_tokens` each, in
    order; None means one chunk. See [Note: prefix chunks]."""
    check_count("length", length, 1)
    if chunk_tokens is None:
        return ((0, length),)
    check_count("prefix_chunk_tokens", chunk_tokens, 1)
    return tuple((start, min(chunk_tokens, length - start))
                 for start in range(0, length, chunk_tokens))


def number_units(num_chunks: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """unit id -> (group, chunk), numbered 0, 1, ... over the groups in the mapping's order and
    each group's chunks in order (`num_chunks`: group -> how many chunks)."""
    table, unit = {}, 0
    for group, count in num_chunks.items():
        check_count(f"number of chunks of group {group}", count, 1)
        for chunk in range(count):
            table[unit] = (group, chunk)
            unit += 1
    return table


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What a step's schedule must run: the suffix microbatches and the prefix units."""

    microbatch_groups: tuple[tuple[int, ...], ...]
    """Per suffix microbatch, the groups it touches (lists are converted to tuples)."""
    prefix_groups: frozenset
    """Groups with a cached prefix (a PF/PB per unit on every stage)."""
    prefix_units: Optional[Mapping[int, tuple[int, int]]] = None
    """unit id (the PF/PB index) -> (group, chunk); None: each prefix group is one unit with the
    group's id. Chunks of a group must be numbered 0, 1, ... without gaps."""
    units: dict = field(init=False)
    """The unit table actually used (derived)."""
    chunks_of: dict = field(init=False)
    """group -> its unit ids in chunk order (derived)."""
    microbatches_of: dict = field(init=False)
    """group -> the microbatches that touch it, in order (derived)."""
    unit_parents: Optional[Mapping[int, Optional[int]]] = None
    """unit -> its parent unit (a prefix tree: [Note: prefix trees]); None: each chunk continues
    the previous chunk of its group."""
    children_of: dict = field(init=False)
    """unit -> the units that continue it (derived)."""

    def __post_init__(self) -> None:
        groups_of = tuple(tuple(groups) for groups in self.microbatch_groups)
        object.__setattr__(self, "microbatch_groups", groups_of)
        object.__setattr__(self, "prefix_groups", frozenset(self.prefix_groups))
        if not groups_of:
            raise ValueError("microbatch_groups is empty: a step needs at least one suffix "
                             "microbatch")
        for m, groups in enumerate(groups_of):
            for g in groups:
                check_count(f"microbatch {m}: group id", g, 0)
            if len(set(groups)) != len(groups):
                raise ValueError(f"microbatch {m} lists a group twice: {groups}; list each "
                                 "group once")
        unused = sorted(self.prefix_groups.difference(*groups_of))
        if unused:
            raise ValueError(f"prefix groups {unused} are touched by no microbatch: a cached prefix "
                             "nobody reads cannot be scheduled; drop them from prefix_groups")
        units = ({g: (g, 0) for g in sorted(self.prefix_groups)} if self.prefix_units is None
                 else dict(self.prefix_units))
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "chunks_of", self._chunks_of(units))
        object.__setattr__(self, "children_of", self._children_of(units))
        touching: dict = {}
        for m, groups in enumerate(groups_of):
            for g in groups:
                touching.setdefault(g, []).append(m)
        object.__setattr__(self, "microbatches_of", touching)

    def _chunks_of(self, units: dict) -> dict:
        chunks: dict = {}
        for unit, (group, chunk) in units.items():
            check_count("prefix unit id", unit, 0)
            check_count(f"unit {unit}: chunk", chunk, 0)
            if group not in self.prefix_groups:
                raise ValueError(f"prefix unit {unit} belongs to group {group}, which is not in "
                                 f"prefix_groups {sorted(self.prefix_groups)}; list it there")
            chunks.setdefault(group, {})[chunk] = unit
        for group in self.prefix_groups:
            found = sorted(chunks.get(group, {}))
            if found != list(range(len(found))) or not found:
                raise ValueError(f"group {group} has prefix chunks {found}; number each group's "
                                 "chunks 0, 1, ... without gaps (one unit per chunk)")
        return {g: tuple(c[i] for i in range(len(c))) for g, c in chunks.items()}

    def _children_of(self, units: dict) -> dict:
        children: dict = {u: [] for u in units}
        if self.unit_parents is None:
            for unit in units:
                after = self.next_chunk(unit)
                if after is not None:
                    children[unit].append(after)
            return {u: tuple(c) for u, c in children.items()}
        if set(self.unit_parents) != set(units):
            raise ValueError("unit_parents must name exactly the prefix units "
                             f"{sorted(units)}, got {sorted(self.unit_parents)}")
        for unit, parent in self.unit_parents.items():
            group, chunk = units[unit]
            if (parent is None) != (chunk == 0) or (parent is not None and (
                    parent not in units or units[parent][0] != group
                    or units[parent][1] >= chunk)):
                raise ValueError(f"unit {unit} (group {group}, chunk {chunk}) has parent "
                                 f"{parent}; a chunk > 0 continues an earlier chunk of its group, "
                                 "chunk 0 continues none")
            if parent is not None:
                children[parent].append(unit)
        return {u: tuple(c) for u, c in children.items()}

    def parent_of(self, unit: int) -> Optional[int]:
        """The unit whose cached K/V (with its ancestors') `unit` continues, None for a root."""
        if self.unit_parents is None:
            return self.previous_chunk(unit)
        return self.unit_parents[unit]

    def group_of(self, unit: int) -> int:
        """The group whose prefix chunk `unit` is."""
        return self.units[unit][0]

    def next_chunk(self, unit: int) -> Optional[int]:
        """The unit of the same group's next chunk, or None for its last chunk."""
        group, chunk = self.units[unit]
        chunks = self.chunks_of[group]
        return chunks[chunk + 1] if chunk + 1 < len(chunks) else None

    def previous_chunk(self, unit: int) -> Optional[int]:
        """The unit of the same group's previous chunk, or None for chunk 0."""
        group, chunk = self.units[unit]
        return self.chunks_of[group][chunk - 1] if chunk > 0 else None

    def local_needs(self, kind: ActionKind, index: int) -> list[tuple[ActionKind, int]]:
        """(kind, index) of the compute that must precede `kind index` on its own stage
        ([Note: prefix-reuse dependency rules] in ir.py, [Note: prefix chunks])."""
        if kind is _SF:
            return [(_PF, u) for g in self.microbatch_groups[index] if g in self.prefix_groups
                    for u in self.chunks_of[g]]
        if kind is _SB:
            return [(_SF, index)]
        if kind is _PF:
            previous = self.parent_of(index)
            return [] if previous is None else [(_PF, previous)]
        assert kind is _PB, kind
        group = self.group_of(index)
        return ([(_PF, index)] + [(_SB, m) for m in self.microbatches_of[group]]
                + [(_PB, child) for child in self.children_of[index]])
