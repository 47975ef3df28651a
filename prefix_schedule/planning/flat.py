"""One sampled sequence as detection takes it (`FlatTrajectory`) and its split into a
`Trajectory` after a shared context, one at a time or, for a whole batch, checked at once.

[Note: whole-batch checks]
The framework adapter builds thousands of these per step (docs/FRAMEWORKS.md "Measure"). Each
constructor checks its arrays, a few tensor ops per array, which at 8,192 sequences costs
seconds. `checked_flat_trajectories` and `checked_splits` check every array of the batch with
a few whole-batch tensor ops instead; where that passes, the objects are stored exactly as
their constructors store them (the same copies and dtypes) without the per-object checks;
where it does not, each object is built by its checked constructor, so a bad array is refused
with the same message as before (tests/test_adapter_overhead.py holds both to that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, List, Optional

import torch

from prefix_schedule.planning.data import (MAX_ABS_ADVANTAGE, ContextLoss, Trajectory, _as_1d,
                                           _as_tokens)

__all__ = ["FlatTrajectory", "checked_flat_trajectories", "checked_splits", "split_checked",
           "all_within", "all_zero_one"]


@dataclass(kw_only=True)
class FlatTrajectory:
    """One full sequence (prompt + response, every turn) and its per-token RL arrays."""

    tokens: Any
    """Token ids (>= 2)."""
    loss_mask: Any
    """Per token 0/1: entry j says whether predicting tokens[j] counts (entry 0 must be 0)."""
    advantages: Any
    """A float, or one float per token."""
    old_logprobs: Any = None
    """Per-token behaviour log-probs, or None."""
    ref_logprobs: Any = None
    """Per-token reference log-probs, or None."""

    def __post_init__(self) -> None:
        self.tokens = _as_tokens(self.tokens, name="tokens")
        n = self.tokens.numel()
        if n < 2:
            raise ValueError(f"tokens has {n} token(s); a trajectory needs >= 2 (one to predict)")
        self.loss_mask = _as_1d(torch.as_tensor(self.loss_mask), name="loss_mask").float()
        if self.loss_mask.numel() != n:
            raise ValueError(f"loss_mask has {self.loss_mask.numel()} entries for {n} tokens; "
                             "give one per token")
        if self.loss_mask[0] != 0:
            raise ValueError("loss_mask[0] is 1, but nothing predicts the first token; set it to 0")
        for name in ("advantages", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and torch.as_tensor(value).dim() > 0 \
                    and torch.as_tensor(value).numel() != n:
                raise ValueError(f"{name} has {torch.as_tensor(value).numel()} entries for {n} "
                                 "tokens; give one per token (or a float advantage)")

    def shareable(self, cache_loss_tokens: bool = True) -> int:
        """Leading tokens this trajectory may take from a cache (step 1 of the note)."""
        if cache_loss_tokens:
            return self.tokens.numel() - 1
        loss = self.loss_mask.nonzero()
        if not loss.numel():
            return self.tokens.numel() - 1
        return min(int(loss[0, 0]), self.tokens.numel() - 1)

    def split(self, context_len: int, node: int) -> Trajectory:
        """The Trajectory of the tokens after the first `context_len` (per-suffix-token arrays),
        with the loss inside the context as its ContextLoss."""
        def part(values, context):
            if values is None:
                return None
            values = torch.as_tensor(values)
            if values.dim() == 0:
                return values
            return values[:context_len] if context else values[context_len:]
        inside = None
        if self.loss_mask[:context_len].any():
            inside = ContextLoss(loss_mask=self.loss_mask[:context_len],
                                 advantages=part(self.advantages, True),
                                 old_logprobs=part(self.old_logprobs, True),
                                 ref_logprobs=part(self.ref_logprobs, True))
        return Trajectory(suffix=self.tokens[context_len:], loss_mask=self.loss_mask[context_len:],
                          advantages=part(self.advantages, False),
                          old_logprobs=part(self.old_logprobs, False),
                          ref_logprobs=part(self.ref_logprobs, False), node=node,
                          context_loss=inside)


_FLAT_FIELDS = ("tokens", "loss_mask", "advantages", "old_logprobs", "ref_logprobs")
assert tuple(f.name for f in fields(FlatTrajectory)) == _FLAT_FIELDS


def checked_flat_trajectories(tokens, loss_mask, advantages, old_logprobs=None,
                              ref_logprobs=None) -> Optional[List[FlatTrajectory]]:
    """One FlatTrajectory per sequence from per-sequence lists (old/ref may be None), checked
    with whole-batch tensor ops: int64 token rows of >= 2 ids >= 0, and float32 [n] loss masks
    (0 at entry 0), advantages and log-probs. None where any of that does not hold: then build
    each `FlatTrajectory(...)`, whose checks name what is wrong. Stored as __post_init__ stores
    them (tokens copied)."""
    old = old_logprobs or [None] * len(tokens)
    ref = ref_logprobs or [None] * len(tokens)
    lengths = []
    f32, i64 = torch.float32, torch.int64
    for t, m, a, o, r in zip(tokens, loss_mask, advantages, old, ref, strict=True):
        if not (isinstance(t, torch.Tensor) and t.dtype is i64 and t.dim() == 1):
            return None
        n = t.numel()
        if n < 2 or not all(isinstance(x, torch.Tensor) and x.dtype is f32 and x.shape == (n,)
                            for x in (m, a, *(x for x in (o, r) if x is not None))):
            return None
        lengths.append(n)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    lowest = torch.stack([t.min() for t in tokens]).min()  # no copy of every token
    if int(lowest) < 0 or (torch.cat(loss_mask)[starts] != 0).any():
        return None
    flats = []
    for values in zip(tokens, loss_mask, advantages, old, ref):
        flat = FlatTrajectory.__new__(FlatTrajectory)
        flat.__dict__.update(zip(_FLAT_FIELDS, values))
        flat.tokens = flat.tokens.detach().clone()
        flats.append(flat)
    return flats


_STORED = ("suffix", "loss_mask", "advantages", "old_logprobs", "ref_logprobs", "node",
           "context_loss")
assert tuple(f.name for f in fields(Trajectory)) == _STORED, "_split stores every field"


def split_checked(flat: FlatTrajectory, context_len: int, node: int, first_loss) -> Trajectory:
    """`flat.split(context_len, node)`; where `checked_splits` passed the batch (`first_loss`:
    the index of flat's first loss token, else None) the same Trajectory is stored as
    `Trajectory.__post_init__` stores it (int64 / float32 copies) without checking each array
    again."""
    if first_loss is None or context_len >= flat.tokens.numel():
        return flat.split(context_len, node)
    arrays = [flat.old_logprobs, flat.ref_logprobs]
    inside = None
    if first_loss < context_len:
        inside = ContextLoss(loss_mask=flat.loss_mask[:context_len],
                             advantages=flat.advantages[:context_len],
                             **{n: None if a is None else a[:context_len]
                                for n, a in zip(_STORED[3:5], arrays)})
    trajectory = Trajectory.__new__(Trajectory)
    trajectory.__dict__.update(
        suffix=flat.tokens[context_len:].clone(),
        loss_mask=flat.loss_mask[context_len:].detach().clone(),
        advantages=flat.advantages[context_len:].detach().clone(), node=node,
        context_loss=inside,
        **{n: None if a is None else a[context_len:].detach().clone()
           for n, a in zip(_STORED[3:5], arrays)})
    return trajectory


def checked_splits(trajectories: list) -> Optional[List[int]]:
    """Per trajectory the index of its first loss token (its length if none) when every split
    of every trajectory passes Trajectory's checks, found with whole-batch tensor ops:
    per-token float32 arrays, 0/1 loss masks, finite advantages within +-MAX_ABS_ADVANTAGE,
    finite log-probs <= 0. None otherwise: each split then checks itself (the same refusals,
    one trajectory at a time)."""
    masks, advantages, logprobs, lengths = [], [], [], []
    f32 = torch.float32
    for t in trajectories:
        n = t.tokens.numel()
        rows = [a for a in (t.old_logprobs, t.ref_logprobs) if a is not None]
        for a in (t.loss_mask, t.advantages, *rows):
            if not (isinstance(a, torch.Tensor) and a.dtype is f32 and a.shape == (n,)
                    and a.is_cpu):
                return None
        masks.append(t.loss_mask)
        advantages.append(t.advantages)
        logprobs += rows
        lengths.append(n)
    mask, adv = torch.cat(masks), torch.cat(advantages)
    if not (all_within(adv, -MAX_ABS_ADVANTAGE, MAX_ABS_ADVANTAGE)
            and (not logprobs or all_within(torch.cat(logprobs), -math.inf, 0.0))
            and all_within(mask, 0.0, 1.0)):
        return None
    ones = mask.nonzero().reshape(-1)
    if not bool((mask[ones] == 1).all()):  # in [0, 1]: a 0/1 mask iff its nonzeros are 1
        return None
    return _first_loss(ones, lengths)


def all_within(values: torch.Tensor, low: float, high: float) -> bool:
    """Every entry finite and in [low, high] (NaN fails), in one pass (aminmax; isfinite and
    comparisons over millions of entries cost several)."""
    if not values.numel():
        return True
    least, most = torch.aminmax(values)
    return bool(torch.isfinite(least) & torch.isfinite(most) & (least >= low) & (most <= high))


def all_zero_one(values: torch.Tensor) -> bool:
    """Every entry 0 or 1 (what `(values == 0) | (values == 1)` checks), in about two passes."""
    return all_within(values, 0.0, 1.0) and bool((values[values.nonzero(as_tuple=True)] == 1).all())


def _first_loss(ones: torch.Tensor, lengths: List[int]) -> List[int]:
    """Per segment of a mask (concatenated rows of `lengths`; `ones` the sorted indices of its
    nonzeros), the index of its first 1 (the segment's length if none)."""
    ends = torch.tensor(lengths).cumsum(0)
    starts = ends - torch.tensor(lengths)
    first = torch.searchsorted(ones, starts)  # the first 1 at or after each start
    at = ones[first.clamp(max=max(ones.numel() - 1, 0))] if ones.numel() else ends
    found = (first < ones.numel()) & (at < ends)
    return torch.where(found, at - starts, torch.tensor(lengths)).tolist()
