"""Groups of trajectories that share a prompt: tokens, loss masks, advantages, log-probs.

The user-facing data model of prefix reuse. A `Group` is one shared prompt (`prefix`, P tokens)
and its trajectories; each `Trajectory` holds only the tokens after the prompt (`suffix`) and
per-suffix-token arrays. See DESIGN.md "[Note: the split of a trajectory]": entry i of every
per-token array is about predicting `suffix[i]`; prefix positions never carry loss.

Everything is validated when constructed (ValueError naming what is wrong and how to fix it) and
stored as 1-D CPU tensors: tokens as int64, masks / advantages / log-probs as float32.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from prefix_schedule.planning._checks import (_as_1d, _as_floats, _as_tokens,  # noqa: F401
                                           _check_range, _prefixed)

__all__ = ["Trajectory", "ContextLoss", "PrefixNode", "Group", "GroupBatch", "check_tree"]


MAX_ABS_ADVANTAGE = 1e6
"""Larger advantages are refused: the fp32 loss sums ratio * advantage over the global batch
(up to millions of tokens), so such values overflow to inf or swamp every other token; GRPO's
normalised advantages are O(1) and PPO's GAE advantages are bounded by the return scale."""


@dataclass(kw_only=True)
class ContextLoss:
    """Loss on tokens of a trajectory's shared context (a trained-on turn inside a prefix-tree
    node): per context token, entry j about predicting context[j]; entry 0 predicts nothing and
    must be 0. Each trajectory counts them with its own arrays, as dense training does
    ([Note: loss inside shared nodes] in planning/tree.py)."""

    loss_mask: Any
    """0/1 per context token."""
    advantages: Any
    """A float or one per context token."""
    old_logprobs: Any = None
    """Per context token, or None; present exactly when the trajectory has old_logprobs."""
    ref_logprobs: Any = None
    """Per context token, or None; present exactly when the trajectory has ref_logprobs."""

    def validate(self, length: int) -> None:
        """Convert and check the arrays for a context of `length` tokens (ValueError)."""
        self.loss_mask = _as_floats(self.loss_mask, name="context loss_mask", length=length)
        if not ((self.loss_mask == 0) | (self.loss_mask == 1)).all() or self.loss_mask[0] != 0:
            raise ValueError("context loss_mask must hold only 0 and 1, and 0 at entry 0 "
                             "(nothing predicts the first token)")
        self.advantages = _as_floats(self.advantages, name="context advantages", length=length,
                                     allow_scalar=True)
        for name in ("old_logprobs", "ref_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _as_floats(getattr(self, name), name=f"context {name}",
                                               length=length))


@dataclass(kw_only=True)
class Trajectory:
    """One sampled response of a group: the tokens after the shared prompt and their arrays."""

    suffix: Any
    """Token ids after the shared prefix (n >= 1); stored as an int64 tensor [n]."""
    loss_mask: Any = None
    """Per suffix token 0/1: entry i says whether predicting suffix[i] counts. None = all ones."""
    advantages: Any
    """A float (broadcast to every suffix token) or one float per suffix token. Required."""
    old_logprobs: Any = None
    """Per-suffix-token log-probs of the behaviour policy, or None (on-policy: ratio 1)."""
    ref_logprobs: Any = None
    """Per-suffix-token log-probs of the reference policy, or None (needed only for a KL term)."""
    node: int = 0
    """The prefix-tree node the suffix follows ([Note: prefix trees] in planning/tree.py): 0 is the
    group's `prefix`; i >= 1 is `Group.nodes[i-1]`. The trajectory's context is the token chain
    root -> ... -> node."""
    context_loss: Optional[ContextLoss] = None
    """Loss tokens inside the context (see ContextLoss); None: the context carries no loss."""

    def __post_init__(self) -> None:
        if isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0:
            raise ValueError(f"node={self.node!r}; give the index of a prefix-tree node (int >= 0)")
        self.suffix = _as_tokens(self.suffix, name="suffix")
        n = self.suffix.numel()
        if n < 1:
            raise ValueError("suffix is empty; a trajectory needs at least one token after the prefix")
        mask = torch.ones(n) if self.loss_mask is None else self.loss_mask
        self.loss_mask = _as_floats(mask, name="loss_mask", length=n)
        if not ((self.loss_mask == 0) | (self.loss_mask == 1)).all():
            raise ValueError("loss_mask must hold only 0 and 1; convert weights to a 0/1 mask")
        self.advantages = _as_floats(self.advantages, name="advantages", length=n, allow_scalar=True)
        _check_range(self.advantages, name="advantages", low=-MAX_ABS_ADVANTAGE,
                     high=MAX_ABS_ADVANTAGE, hint="normalise the advantages (rewards minus a "
                     "baseline, divided by their std) before training")
        for name in ("old_logprobs", "ref_logprobs"):
            if getattr(self, name) is not None:
                values = _as_floats(getattr(self, name), name=name, length=n)
                _check_range(values, name=name, low=-math.inf, high=0.0,
                             hint="a log-probability is <= 0; pass log p, not p or -log p")
                setattr(self, name, values)

    @property
    def num_tokens(self) -> int:
        """n, the number of suffix tokens (= the length of its suffix-microbatch row)."""
        return self.suffix.numel()

    @property
    def num_loss_tokens(self) -> int:
        inside = 0 if self.context_loss is None else int(self.context_loss.loss_mask.sum())
        return int(self.loss_mask.sum()) + inside


@dataclass(kw_only=True)
class PrefixNode:
    """A shared segment below another one in a group's prefix tree ([Note: prefix trees])."""

    parent: int
    """The node this one continues: 0 is the group's `prefix`, i >= 1 is `Group.nodes[i-1]`;
    it must come earlier (parent < this node's index)."""
    tokens: Any
    """Token ids of the segment (>= 1); stored as an int64 tensor."""

    def __post_init__(self) -> None:
        if isinstance(self.parent, bool) or not isinstance(self.parent, int) or self.parent < 0:
            raise ValueError(f"PrefixNode.parent={self.parent!r}; give a node index (int >= 0)")
        self.tokens = _as_tokens(self.tokens, name="PrefixNode.tokens")
        if self.tokens.numel() < 1:
            raise ValueError("PrefixNode.tokens is empty; a tree node holds at least one token")


@dataclass(kw_only=True)
class Group:
    """A shared prompt and the trajectories sampled from it; with `nodes`, a prefix tree."""

    prefix: Any
    """Token ids of the shared prompt (P >= 1); stored as an int64 tensor [P]. The tree's root."""
    trajectories: list[Trajectory] = field(default_factory=list)
    """The group's trajectories (at least one), in order."""
    nodes: list[PrefixNode] = field(default_factory=list)
    """Shared segments below the prompt (node i >= 1 is nodes[i-1]); empty: a one-level prefix.
    See [Note: prefix trees] in planning/tree.py."""

    def __post_init__(self) -> None:
        self.prefix = _as_tokens(self.prefix, name="prefix")
        if self.prefix.numel() < 1:
            raise ValueError("prefix is empty; a group needs at least one prompt token")
        self.trajectories = list(self.trajectories)
        if not self.trajectories:
            raise ValueError("group has no trajectories; give at least one Trajectory")
        for t, trajectory in enumerate(self.trajectories):
            if not isinstance(trajectory, Trajectory):
                raise ValueError(f"trajectory {t}: expected a Trajectory, got {type(trajectory).__name__}")
        self.nodes = list(self.nodes)
        check_tree(self)

    @property
    def prefix_len(self) -> int:
        """P, the number of shared prompt tokens (the root's; see `context_len` for a tree)."""
        return self.prefix.numel()

    @property
    def num_nodes(self) -> int:
        """Nodes of the prefix tree, the root (`prefix`) included."""
        return 1 + len(self.nodes)

    def parent(self, node: int) -> Optional[int]:
        """The parent of `node`, None for the root."""
        return None if node == 0 else self.nodes[node - 1].parent

    def node_tokens(self, node: int) -> torch.Tensor:
        return self.prefix if node == 0 else self.nodes[node - 1].tokens

    def chain(self, node: int) -> tuple[int, ...]:
        """Nodes root -> ... -> `node`."""
        path = [node]
        while path[-1] != 0:
            path.append(self.nodes[path[-1] - 1].parent)
        return tuple(reversed(path))

    def context(self, node: int) -> torch.Tensor:
        """The tokens of the chain root -> ... -> `node`, concatenated."""
        return torch.cat([self.node_tokens(n) for n in self.chain(node)])

    def context_len(self, trajectory: int) -> int:
        """Tokens before trajectory `trajectory`'s suffix (P for a one-level group)."""
        node = self.trajectories[trajectory].node
        if node == 0:  # the root's chain is the prompt alone (planning asks this per trajectory)
            return self.prefix.numel()
        return sum(self.node_tokens(n).numel() for n in self.chain(node))

    def has_children(self, node: int) -> bool:
        return any(n.parent == node for n in self.nodes)

    @classmethod
    def from_full_sequences(
        cls,
        *,
        sequences: Sequence[Any],
        prefix_len: int,
        loss_masks: Sequence[Any] | None = None,
        advantages: Sequence[Any],
        old_logprobs: Sequence[Any] | None = None,
        ref_logprobs: Sequence[Any] | None = None,
    ) -> Group:
        """Split full token sequences (prompt + response) that share their first `prefix_len` tokens.

        Per-token arrays are over the suffix part, `sequence[prefix_len:]`; `advantages` has one
        entry per sequence (a float or per-suffix-token floats).
        """
        sequences = [_as_tokens(s, name=f"trajectory {i}: sequence") for i, s in enumerate(sequences)]
        if not sequences:
            raise ValueError("sequences is empty; give at least one full sequence")
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 1:
            raise ValueError(f"prefix_len={prefix_len!r}; give the shared prompt length as an int >= 1")
        arrays = {"loss_masks": loss_masks, "advantages": advantages,
                  "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
        for name, values in arrays.items():
            if values is not None and len(values) != len(sequences):
                raise ValueError(f"{name} has {len(values)} entries for {len(sequences)} sequences; "
                                 "give one entry per sequence")
        prefix = sequences[0][:prefix_len]
        trajectories = []
        for i, sequence in enumerate(sequences):
            _check_starts_with(sequence, prefix, index=i)
            try:
                trajectories.append(Trajectory(
                    suffix=sequence[prefix_len:],
                    loss_mask=None if loss_masks is None else loss_masks[i],
                    advantages=advantages[i],
                    old_logprobs=None if old_logprobs is None else old_logprobs[i],
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[i],
                ))
            except ValueError as exc:
                raise _prefixed(f"trajectory {i}", exc) from None
        return cls(prefix=prefix, trajectories=trajectories)


def check_tree(group: Group) -> None:
    """The prefix tree's rules ([Note: prefix trees] in planning/tree.py; Group construction
    calls it); ValueError naming what to fix."""
    for i, node in enumerate(group.nodes, start=1):
        if not isinstance(node, PrefixNode):
            raise ValueError(f"node {i}: expected a PrefixNode, got {type(node).__name__}")
        if node.parent >= i:
            raise ValueError(f"node {i} has parent {node.parent}; list parents before their "
                             "children (parent < node index)")
    used = {0}
    for t, trajectory in enumerate(group.trajectories):
        if trajectory.node >= group.num_nodes:
            raise ValueError(f"trajectory {t} follows node {trajectory.node} but the group has "
                             f"nodes 0..{group.num_nodes - 1}; add the node or fix the index")
        used.update(group.chain(trajectory.node))
        if trajectory.context_loss is not None:
            _check_context_loss(trajectory, group.context_len(t), where=f"trajectory {t}")
    unused = sorted(set(range(group.num_nodes)) - used)
    if unused:
        raise ValueError(f"prefix-tree nodes {unused} lead to no trajectory; drop them")
    for i in range(1, group.num_nodes):
        if not group.has_children(i) and group.node_tokens(i).numel() < 2:
            raise ValueError(f"node {i} is a 1-token leaf: it would cache nothing (its last token "
                             "runs with each suffix); move the token into its trajectories' "
                             "suffixes")


def _check_context_loss(trajectory: Trajectory, length: int, *, where: str) -> None:
    context = trajectory.context_loss
    if not isinstance(context, ContextLoss):
        raise ValueError(f"{where}: context_loss must be a ContextLoss, got {type(context).__name__}")
    try:
        context.validate(length)
    except ValueError as exc:
        raise _prefixed(where, exc) from None
    for name in ("old_logprobs", "ref_logprobs"):
        if (getattr(context, name) is None) != (getattr(trajectory, name) is None):
            raise ValueError(f"{where}: give context_loss.{name} exactly when the trajectory has "
                             f"{name}")


def _check_starts_with(sequence: torch.Tensor, prefix: torch.Tensor, *, index: int) -> None:
    p = prefix.numel()
    if sequence.numel() <= p:
        raise ValueError(
            f"trajectory {index}: the sequence has {sequence.numel()} tokens, so nothing follows the "
            f"{p}-token prefix; every sequence needs at least one token after prefix_len (drop it or "
            "lower prefix_len)"
        )
    if not torch.equal(sequence[:p], prefix):
        first = int((sequence[:p] != prefix).nonzero()[0, 0])
        raise ValueError(
            f"trajectory {index}: token {first} is {int(sequence[first])} but sequence 0 has "
            f"{int(prefix[first])} there, so it does not start with the shared {p}-token prefix; "
            "group only sequences with the same prompt, or lower prefix_len"
        )


@dataclass(kw_only=True)
class GroupBatch:
    """The groups of one optimizer step, in order."""

    groups: list[Group]
    """The groups (at least one); group indices in plans and errors are positions in this list."""

    def __post_init__(self) -> None:
        self.groups = list(self.groups)
        if not self.groups:
            raise ValueError("GroupBatch has no groups; give at least one Group")
        for g, group in enumerate(self.groups):
            if not isinstance(group, Group):
                raise ValueError(f"group {g}: expected a Group, got {type(group).__name__}")

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry loss over the whole batch (the global normaliser of a token mean)."""
        return sum(t.num_loss_tokens for group in self.groups for t in group.trajectories)

    @property
    def has_old_logprobs(self) -> bool:
        """Whether the trajectories carry old log-probs (uniform across the batch once validated)."""
        return self.groups[0].trajectories[0].old_logprobs is not None

    @property
    def has_ref_logprobs(self) -> bool:
        """Whether the trajectories carry reference log-probs (uniform once validated)."""
        return self.groups[0].trajectories[0].ref_logprobs is not None

    def validate(self, *, max_seq_len: int, vocab_size: int | None = None) -> None:
        """Check lengths, token ids and log-prob presence against the model; ValueError if wrong.
        `batch_checks.validate_batch` also re-checks every array first ([Note: checks at step
        build] in batch_checks.py): the planner, the policy and the executor call that."""
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len!r}; give the model's maximum length as an int >= 2")
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size={vocab_size!r}; give the model's vocabulary size as an int >= 1")
        vocab_checked = vocab_size is None or _all_in_vocab(self.groups, vocab_size)
        for g, group in enumerate(self.groups):
            if not vocab_checked:
                _check_vocab(group.prefix, vocab_size, where=f"group {g}, prefix")
                for i, node in enumerate(group.nodes, start=1):
                    _check_vocab(node.tokens, vocab_size, where=f"group {g}, node {i}")
            for t, trajectory in enumerate(group.trajectories):
                where = f"group {g}, trajectory {t}"
                total = group.context_len(t) + trajectory.num_tokens
                if total > max_seq_len:
                    raise ValueError(
                        f"{where}: prefix ({group.context_len(t)} tokens) + suffix ({trajectory.num_tokens} "
                        f"tokens) = {total} tokens is longer than max_seq_len={max_seq_len}; truncate "
                        f"the trajectory or use a model with max_seq_len >= {total}"
                    )
                if not vocab_checked:
                    _check_vocab(trajectory.suffix, vocab_size, where=f"{where}, suffix")
        self._check_logprob_presence()

    def _check_logprob_presence(self) -> None:
        for name in ("old_logprobs", "ref_logprobs"):
            first = getattr(self.groups[0].trajectories[0], name) is not None
            for g, group in enumerate(self.groups):
                for t, trajectory in enumerate(group.trajectories):
                    if (getattr(trajectory, name) is not None) != first:
                        has, lacks = ((f"group {g}, trajectory {t}", "group 0, trajectory 0") if not first
                                      else ("group 0, trajectory 0", f"group {g}, trajectory {t}"))
                        raise ValueError(
                            f"{has} has {name} but {lacks} does not; give {name} for every "
                            "trajectory of the batch or for none"
                        )


def _all_in_vocab(groups, vocab_size: int) -> bool:
    """Every token id of the batch in [0, vocab_size), checked at once (False: `validate` walks
    the arrays to name the first bad one)."""
    arrays = [a for g in groups for a in (g.prefix, *(n.tokens for n in g.nodes),
                                          *(t.suffix for t in g.trajectories))]
    if not all(isinstance(a, torch.Tensor) and a.dim() == 1 for a in arrays):
        return False
    tokens = torch.cat(arrays)
    return bool(((tokens >= 0) & (tokens < vocab_size)).all())


def _check_vocab(tokens: torch.Tensor, vocab_size: int, *, where: str) -> None:
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{where}: token {index} has id {int(tokens[index])}, outside [0, {vocab_size}); "
            "use the model's tokenizer or a larger vocab_size"
        )
