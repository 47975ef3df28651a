"""Tensor builders of a StepPlan's rows: [1, L] dicts for the suffix microbatches, the prefix
units and the dense baseline (see the split of a trajectory in planner.py, and
[Note: row padding] there for the padding tokens).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from prefix_schedule.planning.batch_checks import check_plan_covers
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.planner import (PrefixChunk, PrefixWork, Segment, SuffixMicrobatch,
                                              _check_int, _padding)

__all__ = ["build_suffix_inputs", "build_prefix_inputs", "build_prefix_loss", "build_dense_inputs",
           "build_dense_microbatch_inputs", "check_plan_rows"]


def _dense_row(batch: GroupBatch, group: int, trajectory: int) -> dict[str, torch.Tensor]:
    """1-D arrays of the full dense row: input (prefix+suffix)[:-1], labels (prefix+suffix)[1:]."""
    _check_trajectory(batch, group, trajectory)
    g = batch.groups[group]
    tr = g.trajectories[trajectory]
    full = torch.cat([g.context(tr.node), tr.suffix])  # [Note: prefix trees] in tree.py
    pad = torch.zeros(g.context_len(trajectory) - 1, dtype=torch.float32)  # no loss on a prefix
    row = {
        "tokens": full[:-1],
        "position_ids": torch.arange(full.numel() - 1, dtype=torch.int64),
        "labels": full[1:],
        "loss_mask": torch.cat([pad, tr.loss_mask]),
        "advantages": torch.cat([pad, tr.advantages]),
    }
    for name in ("old_logprobs", "ref_logprobs"):
        if getattr(tr, name) is not None:
            row[name] = torch.cat([pad, getattr(tr, name)])
    if tr.context_loss is not None:  # loss inside the shared context: entries 1..C-1
        for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
            if name in row:
                row[name][:pad.numel()] = getattr(tr.context_loss, name)[1:]
    return row


def _check_trajectory(batch: GroupBatch, group: int, trajectory: int) -> None:
    if not 0 <= group < len(batch.groups):
        raise ValueError(f"group {group} is not in the batch (it has {len(batch.groups)} groups)")
    g = batch.groups[group]
    if not 0 <= trajectory < len(g.trajectories):
        raise ValueError(f"group {group} has no trajectory {trajectory} (it has {len(g.trajectories)})")


def _check_segment(batch: GroupBatch, segment: Segment) -> None:
    # Every segment is the tail of its dense row: cached_len tokens come from the cache.
    _check_trajectory(batch, segment.group, segment.trajectory)
    g = batch.groups[segment.group]
    total = g.context_len(segment.trajectory) + g.trajectories[segment.trajectory].suffix.numel() - 1
    if segment.cached_len + segment.length != total:
        raise ValueError(f"segment (group {segment.group}, trajectory {segment.trajectory}) has "
                         f"cached_len {segment.cached_len} + length {segment.length} != {total}, the "
                         "dense row length P+n-1; the plan does not belong to this batch")


def _segment_row(batch: GroupBatch, segment: Segment) -> dict[str, torch.Tensor]:
    _check_segment(batch, segment)
    row = _dense_row(batch, segment.group, segment.trajectory)
    return {name: value[segment.cached_len:] for name, value in row.items()}


def check_plan_rows(batch: GroupBatch, plan) -> None:
    """ValueError unless every row of `plan` (a StepPlan) belongs to `batch`: what the builders
    below check when they build a row (mid-step), checked up front without building any; and
    that it runs every trajectory of `batch` exactly once (batch_checks.check_plan_covers)."""
    check_plan_covers(batch, plan)
    for mb in plan.microbatches:
        for segment in mb.segments:
            _check_segment(batch, segment)
    for chunk in plan.prefix_units().values():
        _check_prefix_fits(batch, chunk, whole=False)


def _as_batch_dim(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.unsqueeze(0).contiguous() for name, value in row.items()}


def build_suffix_inputs(batch: GroupBatch, mb: SuffixMicrobatch) -> dict[str, torch.Tensor]:
    """The packed row of a suffix microbatch, [1, L] tensors.

    Keys: tokens, position_ids, labels (int64); loss_mask, advantages, and old_logprobs /
    ref_logprobs when the batch has them (float32).
    """
    batch._check_logprob_presence()
    rows = [_segment_row(batch, segment) for segment in mb.segments]
    row = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    return _as_batch_dim(_pad(row, mb.padding))  # a sequence of its own (the context says so)


def _pad(row: dict[str, torch.Tensor], padding: int) -> dict[str, torch.Tensor]:
    """`row` followed by `padding` inert tokens ([Note: row padding] in planner.py): token /
    label 0, loss mask, advantages and log-probs 0, position ids 0..padding-1."""
    if not padding:
        return row
    pad = {name: value.new_zeros(padding) for name, value in row.items()}
    pad["position_ids"] = torch.arange(padding, dtype=row["position_ids"].dtype)
    return {name: torch.cat([row[name], pad[name]]) for name in row}


def build_prefix_inputs(batch: GroupBatch,
                        work: Union[PrefixWork, PrefixChunk]) -> dict[str, torch.Tensor]:
    """The cached part of a group's prompt: tokens prefix[:-1] at positions 0..P-2, [1, P-1];
    for a PrefixChunk only its tokens prefix[start:start+length] at their positions."""
    whole = isinstance(work, PrefixWork)
    if whole:
        if work.nodes is not None:
            raise ValueError("a prefix tree runs as units: pass plan.prefix_units() entries")
        work = PrefixChunk(group=work.group, chunk=0, start=0, length=work.length)
    _check_prefix_fits(batch, work, whole)
    prefix = batch.groups[work.group].context(work.node)  # [Note: prefix trees]: the chain
    end = work.start + work.length
    row = {"tokens": prefix[work.start:end], "position_ids": torch.arange(work.start, end)}
    return _as_batch_dim(_pad(row, work.padding))


def _check_prefix_fits(batch: GroupBatch, work: PrefixChunk, whole: bool) -> None:
    if not 0 <= work.group < len(batch.groups):
        raise ValueError(f"group {work.group} is not in the batch (it has {len(batch.groups)} groups)")
    group = batch.groups[work.group]
    if not 0 <= work.node < group.num_nodes:
        raise ValueError(f"{work} names node {work.node} of group {work.group}, which has "
                         f"{group.num_nodes}; the plan does not belong to this batch")
    cached = (sum(group.node_tokens(n).numel() for n in group.chain(work.node))
              - (0 if group.has_children(work.node) else 1))
    end = work.start + work.length
    if (end != cached) if whole else (end > cached):
        raise ValueError(f"{work} does not fit group {work.group}, which caches {cached} tokens "
                         "there; the plan does not belong to this batch")


def build_prefix_loss(batch: GroupBatch, chunk: PrefixChunk) -> Optional[dict[str, torch.Tensor]]:
    """The loss entries of a prefix unit ([Note: loss inside shared nodes] in tree.py), [1, E]
    tensors: for every trajectory that reads the unit and trains on a token its rows predict,
    one entry -- `loss_index` (the predicting row), `labels`, `loss_mask` (1), `advantages` and
    old/ref log-probs as the batch has them. None when the unit predicts no loss token."""
    group = batch.groups[chunk.group]
    entries = []
    for t, tr in enumerate(group.trajectories):
        if tr.context_loss is None or chunk.node not in group.chain(tr.node):
            continue
        context, last = group.context(tr.node), group.context_len(t) - 2  # its last cached row
        for p in range(chunk.start, min(chunk.start + chunk.length - 1, last) + 1):
            if tr.context_loss.loss_mask[p + 1] > 0:
                entries.append((p - chunk.start, int(context[p + 1]), tr.context_loss, p + 1))
    if not entries:
        return None
    item = {"loss_index": torch.tensor([e[0] for e in entries]),
            "labels": torch.tensor([e[1] for e in entries])}
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
        if getattr(entries[0][2], name) is not None:
            item[name] = torch.stack([getattr(e[2], name)[e[3]] for e in entries])
    return _as_batch_dim(item)


def build_dense_inputs(batch: GroupBatch, group: int, trajectory: int, *,
                       row_multiple: int = 1) -> dict[str, torch.Tensor]:
    """The full-sequence row of one trajectory, [1, P+n-1]; loss_mask etc. 0 on the first P-1.

    `row_multiple` > 1 right-pads the row to a multiple of it (stock Megatron under sequence
    parallelism needs that too), with the inert tokens of `_pad`. Exact for causal attention: no
    real token attends to a later one, and padding carries no loss."""
    _check_int(row_multiple, "row_multiple", 1)
    row = _dense_row(batch, group, trajectory)
    return _as_batch_dim(_pad(row, _padding(row["tokens"].numel(), row_multiple)))


def build_dense_microbatch_inputs(batch: GroupBatch, mb: SuffixMicrobatch) -> dict[str, torch.Tensor]:
    """The dense microbatch a reuse microbatch equals: one full row per trajectory it holds
    (prefix included), right-padded to the longest, [n, L] tensors plus, when a row is padded,
    `padding_mask` (bool, True at padding: Megatron's MoE routers count no padding). See
    docs/DESIGN.md "MoE": router statistics are per microbatch, so this packing is the dense
    reference of an MoE reuse step."""
    batch._check_logprob_presence()
    rows = [_dense_row(batch, s.group, s.trajectory) for s in mb.segments]
    longest = max(r["tokens"].numel() for r in rows)
    padded = []
    for row in rows:
        padding = longest - row["tokens"].numel()
        row = _pad(row, padding)
        row["padding_mask"] = torch.arange(longest) >= longest - padding
        padded.append(row)
    item = {name: torch.stack([r[name] for r in padded]) for name in padded[0]}
    if not item["padding_mask"].any():  # no padding: no mask (as a stock dense batch)
        del item["padding_mask"]
    return item
