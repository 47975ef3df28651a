"""Checks that a batch is still what was validated, and that a plan is exactly its plan.

[Note: checks at step build]
`Trajectory`, `Group` and `GroupBatch` validate their arrays when constructed, but they are
plain mutable objects: a caller can edit an array in place afterwards (`advantages[3] = nan`,
`loss_mask *= 0.5`), append a trajectory or a group, or hand a step a plan made for another
batch. None of that fails later by itself: a NaN advantage trains NaN weights, a 0.5 mask
weights tokens silently, and a plan that misses a trajectory trains on part of the batch. So a
step re-checks the batch when it is built (`check_batch_arrays`: GroupBatch.validate, which the
dense path and the planner call, and ReuseStep) and checks that its plan covers exactly the
batch's trajectories and tokens (`check_plan_covers`). Both are linear in the batch's tokens,
with no copy kept. `check_batch_arrays` first checks every array of the batch at once
(`_arrays_pass`: a few whole-batch tensor ops, the per-trajectory work is attribute reads) and
walks the batch array by array only when that finds something wrong, to raise the per-array
message: the same refusals, at thousands of trajectories per step.
"""
from __future__ import annotations

import math
import zlib


import torch

from prefix_schedule.planning.data import (MAX_ABS_ADVANTAGE, GroupBatch, Group, Trajectory,
                                           _as_floats, _as_tokens, _check_range)
from prefix_schedule.planning.flat import all_within, all_zero_one

__all__ = ["check_batch_arrays", "check_plan_covers", "batch_digest", "validate_batch"]

_EDITED = "(edited after the Trajectory was built?); fix the array or build the batch again"


def validate_batch(batch: GroupBatch, *, max_seq_len: int, vocab_size=None) -> None:
    """Every array re-checked (`check_batch_arrays`), then the batch against the model
    (`GroupBatch.validate`: lengths, token ids, log-prob presence); ValueError if wrong."""
    check_batch_arrays(batch)
    batch.validate(max_seq_len=max_seq_len, vocab_size=vocab_size)


def check_batch_arrays(batch: GroupBatch) -> None:
    """ValueError naming the group, trajectory and entry of an array that no longer passes the
    checks it passed when built ([Note: checks at step build])."""
    if not isinstance(batch, GroupBatch):
        raise ValueError(f"expected a GroupBatch, got {type(batch).__name__}")
    if not batch.groups:
        raise ValueError("GroupBatch has no groups; give at least one Group")
    if _arrays_pass(batch.groups):
        return
    for g, group in enumerate(batch.groups):
        if not isinstance(group, Group):
            raise ValueError(f"group {g}: expected a Group, got {type(group).__name__}")
        try:
            _check_group(group)
        except ValueError as exc:
            raise ValueError(f"group {g}: {exc}") from None


def _is_row(value, dtype, length=None) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype is dtype and value.is_cpu
            and (value.dim() == 1 if length is None else value.shape == (length,)))


def _rows_ok(arrays, shapes, dtype) -> bool:
    return all(isinstance(a, torch.Tensor) and a.dtype is dtype and a.is_cpu and a.shape == n
               for a, n in zip(arrays, shapes))


class _Gathered:
    """The arrays of a batch by check (`_arrays_pass`), gathered a field at a time over all
    trajectories, or `ok = False` when one is not a plain 1-D CPU tensor of its dtype and
    length (then the per-array walk decides)."""

    def __init__(self, groups) -> None:
        self.tokens, self.masks, self.advantages, self.logprobs = [], [], [], []
        self.context_masks, self.context_advantages, self.context_logprobs = [], [], []
        trajectories, contexts = [], []
        for group in groups:
            if not isinstance(group, Group) or not _is_row(group.prefix, torch.int64) \
                    or group.prefix.numel() < 1 or not group.trajectories:
                self.ok = False
                return
            self.tokens.append(group.prefix)
            trajectories += group.trajectories
            contexts += [(group, t) for t, tr in enumerate(group.trajectories)
                         if getattr(tr, "context_loss", None) is not None]
        self.ok = self.add_trajectories(trajectories) and all(
            self.add_context(group, t) for group, t in contexts)

    def add_trajectories(self, trajectories) -> bool:
        if not all(isinstance(tr, Trajectory) for tr in trajectories):
            return False
        suffixes = [tr.suffix for tr in trajectories]
        if not all(_is_row(s, torch.int64) and s.numel() >= 1 for s in suffixes):
            return False
        shapes = [s.shape for s in suffixes]
        self.tokens += suffixes
        self.masks = [tr.loss_mask for tr in trajectories]
        self.advantages = [tr.advantages for tr in trajectories]
        if not (_rows_ok(self.masks, shapes, torch.float32)
                and _rows_ok(self.advantages, shapes, torch.float32)):
            return False
        for name in ("old_logprobs", "ref_logprobs"):
            present = [(a, n) for a, n in zip((getattr(tr, name) for tr in trajectories), shapes)
                       if a is not None]
            if not _rows_ok([a for a, _ in present], [n for _, n in present], torch.float32):
                return False
            self.logprobs += [a for a, _ in present]
        return True

    def add_context(self, group, t: int) -> bool:
        tr = group.trajectories[t]
        loss, node = tr.context_loss, tr.node
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < group.num_nodes:
            return False
        shape = (group.context_len(t),)
        arrays = [a for a in (loss.old_logprobs, loss.ref_logprobs) if a is not None]
        if not _rows_ok((loss.loss_mask, loss.advantages, *arrays), [shape] * (2 + len(arrays)),
                        torch.float32) or loss.loss_mask[0] != 0:
            return False
        self.context_masks.append(loss.loss_mask)
        self.context_advantages.append(loss.advantages)
        self.context_logprobs += arrays
        return True


def _cat(rows) -> torch.Tensor:
    return torch.cat(rows) if rows else torch.zeros(0)


def _arrays_pass(groups) -> bool:
    """True when every array of the batch passes `_check_group`'s checks (whole-batch tensor
    ops, [Note: checks at step build]); False sends the caller to the per-array walk, which
    finds the first failing array and raises its message."""
    g = _Gathered(groups)
    if not g.ok:
        return False
    return (not g.tokens or int(torch.cat(g.tokens).min()) >= 0)\
        and all_zero_one(_cat(g.masks + g.context_masks))\
        and all_within(_cat(g.advantages + g.context_advantages), -MAX_ABS_ADVANTAGE,
                       MAX_ABS_ADVANTAGE)\
        and all_within(_cat(g.logprobs), -math.inf, 0.0)\
        and all_within(_cat(g.context_logprobs), -math.inf, math.inf)


def _check_group(group: Group) -> None:
    if _as_tokens(group.prefix, name="prefix").numel() < 1:
        raise ValueError("prefix is empty")
    if not group.trajectories:
        raise ValueError("group has no trajectories")
    for t, trajectory in enumerate(group.trajectories):
        if not isinstance(trajectory, Trajectory):
            raise ValueError(f"trajectory {t}: expected a Trajectory, got "
                             f"{type(trajectory).__name__}")
        try:
            _check_trajectory(trajectory)
            if trajectory.context_loss is not None:
                _check_context_loss(trajectory.context_loss, _context_len(group, t))
        except ValueError as exc:
            raise ValueError(f"trajectory {t}: {exc}") from None


def _check_trajectory(tr: Trajectory) -> None:
    n = _as_tokens(tr.suffix, name="suffix").numel()
    if n < 1:
        raise ValueError("suffix is empty")
    mask = _as_floats(tr.loss_mask, name="loss_mask", length=n)
    if not ((mask == 0) | (mask == 1)).all():
        bad = int(((mask != 0) & (mask != 1)).nonzero()[0, 0])
        raise ValueError(f"loss_mask[{bad}] is {float(mask[bad])}, not 0 or 1 {_EDITED}")
    advantages = _as_floats(tr.advantages, name="advantages", length=n)
    _check_range(advantages, name="advantages", low=-MAX_ABS_ADVANTAGE, high=MAX_ABS_ADVANTAGE,
                 hint=f"normalise the advantages {_EDITED}")
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(tr, name) is not None:
            values = _as_floats(getattr(tr, name), name=name, length=n)
            _check_range(values, name=name, low=-math.inf, high=0.0,
                         hint=f"a log-probability is <= 0 {_EDITED}")


def _context_len(group: Group, t: int) -> int:
    node = group.trajectories[t].node
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < group.num_nodes:
        raise ValueError(f"node {node!r} is not a node of the group (0..{group.num_nodes - 1})")
    return group.context_len(t)


def _check_context_loss(loss, length: int) -> None:
    """ContextLoss.validate's checks for a context of `length` tokens, converting nothing in
    place."""
    mask = _as_floats(loss.loss_mask, name="context loss_mask", length=length)
    if not ((mask == 0) | (mask == 1)).all() or mask[0] != 0:
        raise ValueError(f"context loss_mask must hold only 0 and 1, and 0 at entry 0 {_EDITED}")
    advantages = _as_floats(loss.advantages, name="context advantages", length=length)
    _check_range(advantages, name="context advantages", low=-MAX_ABS_ADVANTAGE,
                 high=MAX_ABS_ADVANTAGE, hint=f"normalise the advantages {_EDITED}")
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(loss, name) is not None:
            _as_floats(getattr(loss, name), name=f"context {name}", length=length)


def check_plan_covers(batch: GroupBatch, plan) -> None:
    """ValueError unless `plan` (a StepPlan) runs every trajectory of `batch` exactly once, each
    as the whole tail of its dense row (cached part + row = P+n-1 tokens), following its own
    tree node ([Note: checks at step build]): a plan made for another batch, or a batch that
    gained a trajectory or group after planning, would otherwise train on part of it."""
    seen = {}
    for mb in plan.microbatches:
        for s in mb.segments:
            key = (s.group, s.trajectory)
            if key in seen:
                raise ValueError(f"group {s.group}, trajectory {s.trajectory} appears in "
                                 f"microbatches {seen[key]} and {mb.index}; the plan does not "
                                 "belong to this batch: plan it again")
            seen[key] = mb.index
            if not (0 <= s.group < len(batch.groups)
                    and 0 <= s.trajectory < len(batch.groups[s.group].trajectories)):
                raise ValueError(f"the plan runs group {s.group}, trajectory {s.trajectory}, which "
                                 "the batch does not have; plan this batch again")
            group = batch.groups[s.group]
            node = group.trajectories[s.trajectory].node
            if s.node != node or s.cached_len not in (0, group.context_len(s.trajectory) - 1):
                raise ValueError(f"group {s.group}, trajectory {s.trajectory}: the plan reads node "
                                 f"{s.node} with {s.cached_len} cached tokens, the batch has node "
                                 f"{node} after {group.context_len(s.trajectory)} context tokens; "
                                 "plan this batch again")
    total = sum(len(g.trajectories) for g in batch.groups)
    if len(seen) != total:
        missing = next((g, t) for g, group in enumerate(batch.groups)
                       for t in range(len(group.trajectories)) if (g, t) not in seen)
        raise ValueError(f"the plan runs {len(seen)} of the batch's {total} trajectories (group "
                         f"{missing[0]}, trajectory {missing[1]} is in none of its microbatches): "
                         "it was made for another batch, or the batch changed after planning; "
                         "plan this batch again")


def batch_digest(batch: GroupBatch) -> str:
    """A cheap content fingerprint of the batch (crc32 of every token id and per-token array, in
    order, with the shapes): the ranks that run one step together fold it into their agreement,
    so same-shaped but different data on a pipeline or tensor-parallel peer is refused, not
    trained on ([Note: agreed refusal] in megatron_patches/runtime/agreement.py). Linear in the tokens;
    equal batches give equal digests on every rank."""
    crc = 0
    for group in batch.groups:
        arrays = [group.prefix, *(node.tokens for node in group.nodes)]
        for tr in group.trajectories:
            arrays += [tr.suffix, tr.loss_mask, tr.advantages, tr.old_logprobs, tr.ref_logprobs]
            if tr.context_loss is not None:
                arrays += [tr.context_loss.loss_mask, tr.context_loss.advantages]
        for array in arrays:
            if array is None:
                crc = zlib.crc32(b"-", crc)
                continue
            values = array.detach().cpu().contiguous()
            crc = zlib.crc32(repr((str(values.dtype), tuple(values.shape))).encode(), crc)
            crc = zlib.crc32(values.numpy().tobytes(), crc)
    return f"{crc:08x}"
