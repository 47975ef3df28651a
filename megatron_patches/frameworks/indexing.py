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
from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.detect import Detection, FlatTrajectory
from prefix_schedule.planning.inputs import build_prefix_loss, build_suffix_inputs
from prefix_schedule.runtime.step import ReuseStep

__all__ = ["shadow_batch", "IndexedReuseStep", "SEQ_INDEX", "SEQ_POSITION"]

SEQ_INDEX = "seq_index"
SEQ_POSITION = "seq_position"
_EXACT = 2 ** 24


def shadow_batch(detection: Detection, flats: List[FlatTrajectory]) -> GroupBatch:
    """The batch of [Note: shadow index batch] for `detection` of `flats`: each trajectory a
    copy of the detected one (the same token, loss-mask and node objects) with the index arrays
    in place of advantages / old log-probs (no ref log-probs), split where it was split."""
    if max(f.tokens.numel() for f in flats) >= _EXACT or len(flats) >= 10 ** 6:
        raise ValueError("the adapter indexes rows in float32: give sequences shorter than "
                         f"{_EXACT} tokens and fewer than 10^6 sequences per step")
    longest = max(f.tokens.numel() for f in flats)
    positions = -torch.arange(longest, dtype=torch.float32)  # shared: the rows only read it
    sequences = torch.arange(1, len(flats) + 1, dtype=torch.float32)
    groups = []
    for group, sources in zip(detection.batch.groups, detection.sources):
        context = {}  # node -> context length, once per node
        split = []
        for tr, i in zip(group.trajectories, sources):
            if tr.node not in context:
                context[tr.node] = sum(group.node_tokens(n).numel() for n in group.chain(tr.node))
            n = flats[i].tokens.numel()
            split.append(_shadow(tr, sequences[i].expand(n), positions[:n], context[tr.node]))
        groups.append(Group(prefix=group.prefix, nodes=list(group.nodes), trajectories=split))
    return GroupBatch(groups=groups)


def _shadow(trajectory: Trajectory, seq: torch.Tensor, pos: torch.Tensor,
            context_len: int) -> Trajectory:
    """`trajectory` with advantages `seq` (its sequence index + 1) and old log-probs `pos`
    (-position), its suffix's and its context loss's part."""
    shadow = _copy(trajectory)  # validated arrays, replaced below by the same checked kinds
    shadow.advantages, shadow.old_logprobs = seq[context_len:], pos[context_len:]
    shadow.ref_logprobs = None
    if trajectory.context_loss is not None:
        inside = _copy(trajectory.context_loss)
        inside.advantages, inside.old_logprobs = seq[:context_len], pos[:context_len]
        inside.ref_logprobs = None
        shadow.context_loss = inside
    return shadow


def _copy(record):
    """A shallow copy of a dataclass record (its fields, no __post_init__; copy.copy is ~15x
    slower)."""
    twin = type(record).__new__(type(record))
    twin.__dict__.update(record.__dict__)
    return twin


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
                 global_loss_contract: bool = False, data_digest: str = "", **kwargs) -> None:
        super().__init__(batch, plan, **kwargs)
        self.global_loss_contract = global_loss_contract
        self.data_digest = data_digest
        """A digest of data the loss reads beyond the batch (the rollout's `fields`)."""
        if self.cp is not None:
            raise ValueError("the framework adapter runs context_parallel_size=1 only (its row "
                             "index is not sharded over CP ranks yet); use CP=1 or ReuseStep")
        self._shadow = shadow

    def signature(self) -> str:
        """ReuseStep's, plus the digest of the framework's per-token fields: peers of one step
        with different fields are refused at the agreement point, not trained on."""
        return repr((super().signature(), self.data_digest))

    def prepare(self, action) -> None:
        super().prepare(action)
        item = self._pending
        if action.kind is ActionKind.SUFFIX_FORWARD:
            item.update(_index(build_suffix_inputs(self._shadow, self.plan.microbatches[action.index])))
        elif "loss_index" in item:
            unit = self._units[self._rows[action.index][0]]
            item.update(_index(build_prefix_loss(self._shadow, unit)))
