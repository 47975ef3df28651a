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
prefix layout (flash-attn needs a contiguous K block per sequence) stays as it is. The copy is
(chain length x layers) K/V rows per reading row group, the same as chunked prefixes today; an
LSE merge over one part per ancestor would avoid it at the price of one kernel call per part.

[Note: loss inside shared nodes]
A trajectory may train on tokens of its shared context (`Trajectory.context_loss`: a trained-on
first turn shared by its branches). Dense training counts such a token once per trajectory, each
with that trajectory's mask, advantage and log-probs. The node's row predicts it once, so the
unit's loss item lists one entry per (trajectory, token): `loss_index` (the predicting row),
label, mask, advantage, old/ref log-probs (planning.inputs.build_prefix_loss); the loss gathers
the logits at `loss_index` and sums the ordinary per-token loss over the entries -- the dense
sum term by term, entropy included. On the last pipeline stage such a unit runs the whole model
(no early stop after the last K/V) and reports its loss and token count like a suffix; its
Phase C backward starts from that loss plus the accumulated gK/gV in one autograd call. A
node's last cached row predicts a different token per child branch, which the entries carry.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from prefix_schedule.planning.data import ContextLoss, Group, PrefixNode, Trajectory, check_tree

__all__ = ["NodeSpan", "cached_spans", "is_tree", "check_tree", "subgroup"]


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


def subgroup(group: Group, trajectories) -> Group:
    """The group with only `trajectories` (indices): the nodes they lead through, renumbered
    parents first (data-parallel placement splitting a tree). A node left as a 1-token leaf
    would cache nothing: its token moves into its trajectories' suffixes (the same dense row)."""
    chosen = [group.trajectories[t] for t in trajectories]
    while True:
        used = {n for tr in chosen for n in group.chain(tr.node)}
        leaves = {n for n in used if n > 0 and group.node_tokens(n).numel() == 1
                  and not any(group.parent(c) == n for c in used)}
        if not leaves:
            break
        chosen = [_lift(group, tr) if tr.node in leaves else tr for tr in chosen]
    if len(used) == group.num_nodes:
        return Group(prefix=group.prefix, nodes=group.nodes, trajectories=chosen)
    renumber = {old: new for new, old in enumerate(sorted(used))}
    nodes = [PrefixNode(parent=renumber[group.parent(n)], tokens=group.node_tokens(n))
             for n in sorted(used)[1:]]
    return Group(prefix=group.prefix, nodes=nodes,
                 trajectories=[dataclasses.replace(tr, node=renumber[tr.node]) for tr in chosen])


def _lift(group: Group, tr: Trajectory) -> Trajectory:
    """`tr` following its node's parent: the node's one token leads its suffix."""
    context = group.context(tr.node)
    last = context.numel() - 1
    inside = tr.context_loss

    def lead(name: str, values):
        if values is None:
            return None
        first = getattr(inside, name)[last:] if inside is not None else values.new_zeros(1)
        return torch.cat([first, values])
    kept = None
    if inside is not None and inside.loss_mask[:last].any():
        kept = ContextLoss(**{name: (None if getattr(inside, name) is None
                                     else getattr(inside, name)[:last])
                              for name in ("loss_mask", "advantages", "old_logprobs",
                                           "ref_logprobs")})
    return Trajectory(suffix=torch.cat([context[last:], tr.suffix]),
                      loss_mask=lead("loss_mask", tr.loss_mask),
                      advantages=lead("advantages", tr.advantages),
                      old_logprobs=lead("old_logprobs", tr.old_logprobs),
                      ref_logprobs=lead("ref_logprobs", tr.ref_logprobs),
                      node=group.parent(tr.node), context_loss=kept)
