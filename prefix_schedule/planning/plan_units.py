"""Prefix units of a StepPlan: each group's cached tokens as PF/PB units ([Note: prefix chunks]
in pipeline/units.py; trees: [Note: prefix trees] in tree.py), cut by `prefix_chunk_tokens` and,
with `state_reads`, where a reader stops inside a tree node (StepPlan.state_reads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefix_schedule.pipeline.support import check_count
from prefix_schedule.pipeline.units import chunk_spans

__all__ = ["PrefixChunk", "node_chunks", "padding"]


def padding(length: int, multiple: int) -> int:
    """Padding tokens that make a row of `length` tokens a multiple of `multiple`."""
    return -length % multiple


@dataclass(frozen=True, kw_only=True)
class PrefixChunk:
    """One prefix unit: tokens start..start+length-1 of a group's cached prefix, run as one
    PF/PB action ([Note: prefix chunks] in units.py)."""

    group: int
    """Index of the group in the batch."""
    chunk: int
    """Position of the chunk in its group (0 first)."""
    start: int
    """Offset of the chunk's first token in the cached prefix (= its first position)."""
    length: int
    """Tokens of the chunk (>= 1)."""
    padding: int = 0
    """Padding tokens after the chunk's tokens in its row ([Note: row padding]); never cached."""
    node: int = 0
    """The prefix-tree node the chunk belongs to ([Note: prefix trees] in tree.py)."""
    parent: Optional[int] = None
    """The chunk whose cached K/V (and its ancestors') this one continues; None: chunk - 1
    (none for chunk 0, the root)."""

    def __post_init__(self) -> None:
        for name, minimum in (("group", 0), ("chunk", 0), ("start", 0), ("length", 1),
                              ("padding", 0), ("node", 0)):
            check_count(f"PrefixChunk.{name}", getattr(self, name), minimum)
        if self.parent is not None and not 0 <= self.parent < self.chunk:
            raise ValueError(f"PrefixChunk.parent={self.parent!r}; a chunk continues an earlier "
                             f"chunk of its group (0 <= parent < chunk={self.chunk})")

    @property
    def parent_chunk(self) -> Optional[int]:
        """The chunk this one continues (None for chunk 0)."""
        return self.parent if self.parent is not None else (self.chunk - 1 if self.chunk else None)

    @property
    def row_length(self) -> int:
        """Length of the unit's row as it runs: real tokens + padding."""
        return self.length + self.padding


def node_chunks(plan, work) -> list[PrefixChunk]:
    """The units of one group's PrefixWork under `plan` (a StepPlan)."""
    # [Note: prefix trees] (tree.py): a node's first chunk continues its parent's last chunk
    chunks, last_of = [], {}
    cuts = read_cuts(plan, work) if plan.state_reads else {}
    for span in work.spans():
        parent = None if span.parent is None else last_of[span.parent]
        ends = sorted(cuts.get(span.node, set()) | {span.length})
        for piece, end in zip([0] + ends, ends):
            for start, length in chunk_spans(end - piece, plan.prefix_chunk_tokens):
                c = len(chunks)
                chunks.append(PrefixChunk(group=work.group, chunk=c,
                                          start=span.start + piece + start, length=length,
                                          padding=padding(length, plan.row_multiple),
                                          node=span.node, parent=parent if c else None))
                parent = c
        last_of[span.node] = parent
    return chunks


def read_cuts(plan, work) -> dict[int, set]:
    """node -> offsets inside its cached span where a suffix reader of the node stops."""
    spans = {span.node: span for span in work.spans()} if work.nodes is not None else {}
    cuts: dict[int, set] = {}
    for mb in plan.microbatches:
        for s in mb.segments:
            span = spans.get(s.node) if s.group == work.group and s.cached_len else None
            if span is not None and span.start < s.cached_len < span.start + span.length:
                cuts.setdefault(s.node, set()).add(s.cached_len - span.start)
    return cuts
