"""The attention contexts a ReuseStep hands the hooks: one per prefix unit forward (Phase A, or its
recompute in Phase C) and one per suffix microbatch (its forward and backward). Functions of the
step (runtime/step.py keeps thin methods that call them): which cache slots a row reads, the
tree chains and ancestors ([Note: prefix trees] in planning/tree.py), positions, row padding
([Note: row padding] in planner.py) and the CP row of each.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional

import torch

from prefix_schedule.attention import PackedMeta
from prefix_schedule.planning.planner import PrefixChunk
from prefix_schedule.runtime.context import PrefixForwardContext, SuffixForwardContext

__all__ = ["prefix_context", "suffix_context"]


def prefix_context(step, unit: int, *, stop_after_layer: Optional[int],
                   recomputing: bool = False, replay: bool = False,
                   inject: bool = False, model_chunk: int = 0,
                   stop_in_router: bool = False,
                   full_recompute: bool = False) -> PrefixForwardContext:
    """Context of prefix unit `unit`'s forward (or of its recompute in Phase C) on model
    chunk `model_chunk` of this rank."""
    chunk = step.prefix_unit(unit)
    reads = None
    if chunk.group in step._trees and chunk.chunk > 0:  # its ancestors ([Note: prefix trees])
        reads = _ancestors(step, chunk)
    members = step.prefix_members(unit)
    cp = (None if step.cp is None
          else step._cp_row(step.prefix_layout(unit), [c.start for c in members]))
    packed = ()
    if len(members) > 1:  # [Note: packed CP prefix rows]: each member's real rows
        real = [0, *accumulate(c.length for c in members)]
        packed = tuple((c.group, real[i], real[i + 1]) for i, c in enumerate(members))
    return PrefixForwardContext(group=chunk.group, chunk=chunk.chunk,
                                position_offset=chunk.start, cache=step.caches[model_chunk],
                                stop_after_layer=stop_after_layer, recomputing=recomputing,
                                padding=chunk.padding, reads=reads,
                                multiplicity=step.prefix_multiplicity(chunk.group),
                                stop_in_router=stop_in_router, cp=cp,
                                replay=replay, inject=inject, packed=packed,
                                full_recompute=full_recompute)


def _chain(step, group: int, node: int) -> tuple:
    """The chunks a reader after tree node `node` attends to (memoised per step)."""
    key = (group, node)
    if key not in step._chains:
        step._chains[key] = step.plan.chain_chunks(group, node)
    return step._chains[key]


def _ancestors(step, chunk: PrefixChunk) -> tuple:
    by_chunk = {c.chunk: c for c in step._units.values() if c.group == chunk.group}
    chain, parent = [], chunk.parent_chunk
    while parent is not None:
        chain.append(parent)
        parent = by_chunk[parent].parent_chunk
    return tuple(reversed(chain))


def suffix_context(step, microbatch: int, model_chunk: int) -> SuffixForwardContext:
    """Context of suffix microbatch `microbatch` on model chunk `model_chunk` (uncached:
    ReuseStep.suffix_context memoises it)."""
    mb = step.plan.microbatches[microbatch]
    # (group, cached_len, length, node) of each sequence; padding: one more, no prefix
    sequences = [(s.group, s.cached_len, s.length, s.node) for s in mb.segments]
    if mb.padding:  # [Note: row padding] in planner.py
        sequences.append((None, 0, mb.padding, 0))
    slot_groups, slot_keys, slot_reads, slots, lengths, positions = [], [], [], [], [], []
    sequence_groups = []
    for group, cached_len, length, node in sequences:
        group = group if cached_len > 0 else None
        sequence_groups.append(group)
        tree = group in step._trees
        key = (group, node, cached_len) if tree else group
        # consecutive sequences reading one cache slot (a group; in a tree: one node's chain,
        # same length) share a slot; a dense row has its own
        if group is None or not slot_keys or slot_keys[-1] != key:
            slot_groups.append(group)
            slot_keys.append(key)
            slot_reads.append((_chain(step, group, node), cached_len) if tree
                              else None)
        slots.append(len(slot_groups) - 1)
        lengths.append(length)
        positions.append(torch.arange(cached_len, cached_len + length))
    return SuffixForwardContext(
        microbatch=microbatch,
        cache=step.caches[model_chunk],
        slot_groups=tuple(slot_groups),
        meta=PackedMeta.from_lengths(lengths, slots),
        position_ids=torch.cat(positions),
        max_position=max(cached_len + length - 1 for _, cached_len, length, _ in sequences),
        slot_reads=tuple(slot_reads) if step._trees else None,
        sequence_groups=tuple(sequence_groups),
        num_padding=mb.padding,
        cp=(None if step.cp is None else step._cp_row(
            step.microbatch_layout(microbatch), [s.cached_len for s in mb.segments])),
    )
