"""Prefix trees: a group whose shared prefix branches (multi-turn, agents, shared system prompts).

[Note: prefix trees]
A `Group` may carry `nodes` below its `prefix` (the root): node i >= 1 continues node
`parent(i) < i`, and each trajectory follows one node (`Trajectory.node`); its context is the
token chain root -> ... -> node and its dense row is `(context + suffix)[:-1]`. The split of a
trajectory (DESIGN.md) is unchanged: the last context token runs in the trajectory's suffix row,
the rest comes from the cache. So a node caches all its tokens when other nodes continue it and
all but its last token when it is a leaf of the node tree (a one-level group: P-1, as always);
a trajectory that follows a node with children reads its chain's cached K/V minus the last row.
Each cached node is a prefix unit (or several: prefix chunks split nodes, a chunk's parent being
the previous chunk of its node or the last chunk of the parent node), so the units of a group
form a tree numbered parents first:
    PF u after PF parent(u)        (a node's forward reads its ancestors' cached K/V)
    PB u after PB of every child   (children's backwards add to their ancestors' gK/gV)
Suffixes read the chain of their node; the schedule rules keep the group-level ones (PF of every
unit of a group before its first SF, PB after its last SB), which a chain read satisfies.
The attention of a node or suffix over its chain is the two-part attention over ONE cached
segment, the chain's K/V concatenated (the cache's read): each part's gradient slice lands in the
fp32 buffer of the node it came from (the concat's backward), and every backend's one-block
prefix layout (flash-attn needs a contiguous K block per sequence) stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefix_schedule.planning.data import Group

__all__ = ["NodeSpan", "cached_spans", "is_tree"]


@dataclass(frozen=True, kw_only=True)
class NodeSpan:
    """The cached part of one tree node."""

    node: int
    """Node index in its group (0 = the prompt)."""
    parent: Optional[int]
    """Parent node, None for the root."""
    start: int
    """Position of the node's first token (the length of its ancestors' chain)."""
    length: int
    """Cached tokens of the node (>= 1)."""


def is_tree(group: Group) -> bool:
    """True when the group has nodes below its prompt."""
    return bool(group.nodes)


def cached_spans(group: Group) -> tuple[NodeSpan, ...]:
    """The cached part of every node of `group`, parents first ([Note: prefix trees]); a node
    that caches nothing (a 1-token root without children) is left out."""
    starts, spans = {}, []
    for node in range(group.num_nodes):
        parent = group.parent(node)
        start = 0 if parent is None else starts[parent] + group.node_tokens(parent).numel()
        starts[node] = start
        length = group.node_tokens(node).numel() - (0 if group.has_children(node) else 1)
        if length > 0:
            spans.append(NodeSpan(node=node, parent=parent, start=start, length=length))
    return tuple(spans)
