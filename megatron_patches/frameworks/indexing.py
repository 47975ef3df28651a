"""Which sequence and position each row entry of a reuse step is about, without touching the
row builders.

[Note: shadow index batch]
The adapter must hand the framework's loss (and its returned log-probs) per-token data in the
framework's own order, so every entry of every row needs (sequence, position). The builders in
prefix_schedule.planning.inputs slice per-token arrays from the GroupBatch; a SHADOW batch with
the same structure (same tokens, loss masks, splits and nodes) whose `advantages` hold
sequence index + 1 and whose `old_logprobs` hold -position is sliced by the very same code, so
its arrays ARE the index of the real rows: no second description of the row layout to drift.
Padding and unmasked shared-context entries read 0 there: sequence -1, skipped. Both values are
small integers, exact in float32 (positions < 2^24; checked).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from prefix_schedule.pipeline import ActionKind
from prefix_schedule.planning.data import Group, GroupBatch
from prefix_schedule.planning.detect import Detection, FlatTrajectory
from prefix_schedule.planning.inputs import build_prefix_loss, build_suffix_inputs
from prefix_schedule.runtime.step import ReuseStep

__all__ = ["shadow_batch", "IndexedReuseStep", "SEQ_INDEX", "SEQ_POSITION"]

SEQ_INDEX = "seq_index"
SEQ_POSITION = "seq_position"
_EXACT = 2 ** 24


def shadow_batch(detection: Detection, flats: List[FlatTrajectory]) -> GroupBatch:
    """The batch of [Note: shadow index batch] for `detection` of `flats`."""
    if max(f.tokens.numel() for f in flats) >= _EXACT or len(flats) >= 10 ** 6:
        raise ValueError("the adapter indexes rows in float32: give sequences shorter than "
                         f"{_EXACT} tokens and fewer than 10^6 sequences per step")
    groups = []
    for group, sources in zip(detection.batch.groups, detection.sources):
        split = []
        for t, i in enumerate(sources):
            n = flats[i].tokens.numel()
            shadow = FlatTrajectory(tokens=flats[i].tokens, loss_mask=flats[i].loss_mask,
                                    advantages=torch.full((n,), float(i + 1)),
                                    old_logprobs=-torch.arange(n, dtype=torch.float32))
            split.append(shadow.split(group.context_len(t), group.trajectories[t].node))
        groups.append(Group(prefix=group.prefix, nodes=list(group.nodes), trajectories=split))
    return GroupBatch(groups=groups)


def _index(arrays: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {SEQ_INDEX: arrays["advantages"].round().to(torch.int64) - 1,
            SEQ_POSITION: (-arrays["old_logprobs"]).round().to(torch.int64)}


class IndexedReuseStep(ReuseStep):
    """A ReuseStep whose items also carry `seq_index` / `seq_position` per row entry (for the
    loss entries of a prefix-tree unit: per entry), read from the shadow batch."""

    global_loss_contract = False
    """True when the loss returns Megatron's 2-tuple, normalised over the global batch and
    multiplied by the step's microbatch count (calculate_per_token_loss=False is exact then)."""

    def __init__(self, batch: GroupBatch, plan, *, shadow: GroupBatch,
                 global_loss_contract: bool = False, **kwargs) -> None:
        super().__init__(batch, plan, **kwargs)
        self.global_loss_contract = global_loss_contract
        if self.cp is not None:
            raise ValueError("the framework adapter runs context_parallel_size=1 only (its row "
                             "index is not sharded over CP ranks yet); use CP=1 or ReuseStep")
        self._shadow = shadow

    def prepare(self, action) -> None:
        super().prepare(action)
        item = self._pending
        if action.kind is ActionKind.SUFFIX_FORWARD:
            item.update(_index(build_suffix_inputs(self._shadow, self.plan.microbatches[action.index])))
        elif "loss_index" in item:
            unit = self._units[self._rows[action.index][0]]
            item.update(_index(build_prefix_loss(self._shadow, unit)))
