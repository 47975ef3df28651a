"""Shared-prefix detection: flat token sequences -> groups with prefix trees, and a report.

[Note: detecting prefix trees]
Input: one `FlatTrajectory` per sampled sequence, its per-token arrays aligned with its tokens
(entry j is about predicting tokens[j]; entry 0 predicts nothing and must be masked out).
1. Each trajectory may share at most `len - 1` leading tokens (a suffix keeps >= 1 token). Loss
   tokens inside a shared span are cached like any other and count once per trajectory with
   its own arrays ([Note: loss inside shared nodes] in tree.py); with
   `cache_loss_tokens=False` sharing stops at a trajectory's first loss token instead, and the
   tokens that could have been shared beyond it are reported as `lost_to_loss_tokens`.
2. A radix trie over those shareable keys: every edge is a maximal span shared by the same set of
   trajectories (`_radix`).
3. Pruning, top down: a span is kept as a tree node when >= 2 trajectories share it, it has at
   least `min_shared_len` tokens and (sharers - 1) x length >= `node_overhead_tokens` (the saving
   must beat a node's fixed cost: its own pass, kernel launches, the chain-read copies). A
   dropped span's tokens move into each of its child spans (so a short span between two long
   ones does not break the sharing below it); trajectories that end inside it follow the
   nearest kept ancestor. A kept root is one Group; trajectories under no kept root are groups
   of one (a 1-token prompt: they run dense).
4. Which groups are worth the cache is the FLOP model's call (policy.py, `min_gain`), made by
   `prefix_schedule.plan_trajectories`, which also reports the expected speedup.
Guarantee (tests/test_detect.py, property-tested): every trajectory's context + suffix is its
sequence, and for every two trajectories the part of their common shareable prefix that they do
not share through common nodes is shorter than `min_shared_len`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy

from prefix_schedule.planning.data import Group, GroupBatch, PrefixNode, _prefixed
from prefix_schedule.planning.flat import (FlatTrajectory, checked_flat_trajectories,
                                           checked_splits, split_checked)

__all__ = ["FlatTrajectory", "Detection", "detect_prefix_trees", "checked_flat_trajectories",
           "DEFAULT_MIN_SHARED_LEN", "DEFAULT_NODE_OVERHEAD_TOKENS"]

DEFAULT_MIN_SHARED_LEN = 16
"""Shorter shared spans are not cached (their tokens run in each child)."""
DEFAULT_NODE_OVERHEAD_TOKENS = 32
"""A node must save at least this many token-rows ((sharers - 1) x length) to be kept."""


@dataclass
class _Span:
    start: int
    end: int
    members: list          # trajectory indices under this span
    ends_here: list        # members whose shareable key ends at `end`
    children: list = field(default_factory=list)


def _radix(keys: list, members: list, start: int) -> list:
    """Maximal spans shared by the same members, from position `start` (step 2); `keys` are
    1-D int64 numpy arrays (whole-array comparisons, no per-token Python loop)."""
    by_token: dict = {}
    for i in members:
        if len(keys[i]) > start:
            by_token.setdefault(int(keys[i][start]), []).append(i)
    spans = []
    for group in by_token.values():
        end = min(len(keys[i]) for i in group)
        first = keys[group[0]]
        for i in group[1:]:  # end = start + 1 + the common run of key and first after start
            differ = numpy.flatnonzero(keys[i][start + 1:end] != first[start + 1:end])
            if differ.size:
                end = start + 1 + int(differ[0])
        span = _Span(start, end, group, [i for i in group if len(keys[i]) == end])
        span.children = _radix(keys, group, end)
        spans.append(span)
    return spans


@dataclass(frozen=True)
class Detection:
    """What `detect_prefix_trees` found."""

    batch: GroupBatch
    """The groups (a prefix tree each; lone trajectories as groups with a 1-token prompt)."""
    sources: tuple
    """Per group, the input index of each of its trajectories."""
    shared_tokens: int
    """Tokens held once in tree nodes that dense training runs once per trajectory."""
    total_tokens: int
    """Tokens of all input sequences."""
    lost_to_loss_tokens: int
    """Shared tokens that cannot be cached because a trajectory trains on one before them."""

    def describe(self) -> str:
        lines = [f"detected {len(self.batch.groups)} groups from {self.total_tokens} tokens: "
                 f"{self.shared_tokens} tokens saved by sharing"
                 + (f", {self.lost_to_loss_tokens} shared tokens after a loss token not cached"
                    if self.lost_to_loss_tokens else "")]
        for g, group in enumerate(self.batch.groups):
            lengths = [group.node_tokens(n).numel() for n in range(group.num_nodes)]
            lines.append(f"  g{g}: {len(group.trajectories)} trajectories, "
                         f"{group.num_nodes} node(s) of {lengths} tokens, depth "
                         f"{max(len(group.chain(t.node)) for t in group.trajectories)}")
        return "\n".join(lines)


def _check_args(min_shared_len: int, node_overhead_tokens: int) -> None:
    if isinstance(min_shared_len, bool) or not isinstance(min_shared_len, int) or min_shared_len < 2:
        raise ValueError(f"min_shared_len={min_shared_len!r}; give an int >= 2")
    if isinstance(node_overhead_tokens, bool) or not isinstance(node_overhead_tokens, int) \
            or node_overhead_tokens < 0:
        raise ValueError(f"node_overhead_tokens={node_overhead_tokens!r}; give an int >= 0")


def detect_prefix_trees(trajectories, *, min_shared_len: int = DEFAULT_MIN_SHARED_LEN,
                        node_overhead_tokens: int = DEFAULT_NODE_OVERHEAD_TOKENS,
                        cache_loss_tokens: bool = True) -> Detection:
    """Find the shared prefixes of `trajectories` (FlatTrajectory list) as prefix trees; see
    [Note: detecting prefix trees]. ValueError (naming the trajectory) on bad input."""
    _check_args(min_shared_len, node_overhead_tokens)
    trajectories = list(trajectories)
    if not trajectories:
        raise ValueError("no trajectories; give at least one FlatTrajectory")
    for i, t in enumerate(trajectories):
        if not isinstance(t, FlatTrajectory):
            raise ValueError(f"trajectory {i}: expected a FlatTrajectory, got {type(t).__name__}")
    keys = [t.tokens[:t.shareable(cache_loss_tokens)].numpy() for t in trajectories]
    roots = _radix(keys, list(range(len(trajectories))), 0)
    keep = _Pruner(min_shared_len, node_overhead_tokens)
    kept_roots = keep.roots(roots)
    firsts = checked_splits(trajectories)
    groups, sources = [], []
    for root in kept_roots:
        group, members = _build_group(root, trajectories, firsts)
        groups.append(group)
        sources.append(members)
    for i in sorted(keep.alone):
        try:
            groups.append(Group(prefix=trajectories[i].tokens[:1],
                                trajectories=[split_checked(trajectories[i], 1, 0,
                                                     None if firsts is None else firsts[i])]))
        except ValueError as exc:
            raise _prefixed(f"trajectory {i}", exc) from None
        sources.append((i,))
    order = sorted(range(len(groups)), key=lambda g: min(sources[g]))  # input order
    batch = GroupBatch(groups=[groups[g] for g in order])
    shared = sum(_saved(group) for group in batch.groups)
    lost = 0 if cache_loss_tokens else _lost_to_loss(trajectories)
    return Detection(batch=batch, sources=tuple(tuple(sources[g]) for g in order),
                     shared_tokens=shared, total_tokens=sum(t.tokens.numel() for t in trajectories),
                     lost_to_loss_tokens=lost)


class _Pruner:
    """Step 3 of the note: which spans become nodes."""

    def __init__(self, min_len: int, overhead: int) -> None:
        self.min_len, self.overhead = min_len, overhead
        self.alone: set = set()  # trajectories under no kept root

    def worth(self, span: _Span, start: int) -> bool:
        length, sharers = span.end - start, len(span.members)
        return sharers >= 2 and length >= self.min_len and (sharers - 1) * length >= self.overhead

    def roots(self, spans: list) -> list:
        kept = []
        for span in spans:
            kept += self._place(span, span.start, None)
        return kept

    def _place(self, span: _Span, start: int, parent: Optional[_Span]) -> list:
        """Kept spans for `span` whose tokens begin at `start` (earlier, when its parent was
        dropped); trajectories ending in a dropped span go to `parent` (or stand alone)."""
        if self.worth(span, start):
            node = _Span(start, span.end, span.members, list(span.ends_here))
            for child in span.children:
                node.children += self._place(child, child.start, node)
            return [node]
        if parent is None:
            self.alone.update(span.ends_here)
        else:
            parent.ends_here += span.ends_here
        kept = []
        for child in span.children:
            kept += self._place(child, start, parent)
        if parent is None and not span.children:
            self.alone.update(span.members)
        return kept


def _build_group(root: _Span, trajectories: list, firsts: Optional[List[int]]) -> tuple:
    tokens = trajectories[root.members[0]].tokens
    nodes, order, attach = [], [(root, 0)], {}
    while order:  # parents first
        span, index = order.pop(0)
        for i in span.ends_here:
            attach[i] = (index, span.end)
        for child in span.children:
            first = trajectories[child.members[0]].tokens
            nodes.append(PrefixNode(parent=index, tokens=first[child.start:child.end]))
            order.append((child, len(nodes)))
    members = sorted(attach)
    split = []
    for i in members:
        node, context_len = attach[i]
        try:
            first = None if firsts is None else firsts[i]
            split.append(split_checked(trajectories[i], context_len, node, first))
        except ValueError as exc:
            raise _prefixed(f"trajectory {i}", exc) from None
    return Group(prefix=tokens[root.start:root.end], nodes=nodes, trajectories=split), members


def _saved(group: Group) -> int:
    """Tokens dense training runs more often than the tree holds them."""
    repeated = sum(group.context_len(t) for t in range(len(group.trajectories)))
    held = sum(group.node_tokens(n).numel() for n in range(group.num_nodes))
    return repeated - held if group.nodes or group.prefix_len > 1 else 0


def _lost_to_loss(trajectories: list) -> int:
    """Tokens a trajectory shares with another beyond its shareable limit (a loss token before
    them), summed over trajectories."""
    full = [t.tokens.tolist() for t in trajectories]
    keys = [f[:t.shareable(False)] for f, t in zip(full, trajectories)]
    best_full, best_key = _longest_common(full), _longest_common(keys)
    return sum(max(0, min(best_full[i], len(full[i]) - 1) - best_key[i]) for i in range(len(full)))


def _longest_common(seqs: list) -> list:
    """Per sequence, its longest common prefix with any other (lexicographic neighbours)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    best = [0] * len(seqs)
    for a, b in zip(order, order[1:]):
        common = _common(seqs[a], seqs[b])
        best[a], best[b] = max(best[a], common), max(best[b], common)
    return best


def _common(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
