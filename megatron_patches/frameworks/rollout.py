"""What RL frameworks hand Megatron, framework-neutral: one entry per sampled sequence.

`RolloutBatch` holds per-sequence token ids and per-token RL arrays, all aligned with the tokens
(entry j is about PREDICTING tokens[j]; entry 0 predicts nothing and must be masked out), plus a
group id per sequence (verl's `uid`, slime's `group_index`, Megatron-LM RL's group). The
constructors `from_padded` (rows [B, L] with an attention mask, left or right padding) and
`from_packed` (THD: one 1-D row and `cu_seqlens`) read the two layouts frameworks use.
`TokenBatch` is what the framework's loss function sees for one Megatron microbatch.
No Megatron import here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from prefix_schedule.planning.flat import all_within, all_zero_one

from megatron_patches.frameworks.input_checks import (check_names, check_some_loss,
                                                      group_id_list, packed_array,
                                                      packed_offsets, padded_keep, padded_rows,
                                                      token_row)

__all__ = ["RolloutBatch", "TokenBatch"]

_PER_TOKEN = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs")


def _float_rows(values, lengths: Sequence[int], name: str, scalar_ok: bool = False) -> List[torch.Tensor]:
    if values is None:
        return None
    values = list(values)
    if len(values) != len(lengths):
        raise ValueError(f"{name} has {len(values)} entries for {len(lengths)} sequences; "
                         "give one per sequence")
    rows = _float_rows_at_once(values, lengths, scalar_ok)
    return rows if rows is not None else _float_rows_walk(values, lengths, name, scalar_ok)


def _float_rows_at_once(values, lengths: Sequence[int], scalar_ok: bool) -> Optional[List[torch.Tensor]]:
    """`_float_rows_walk`'s rows when every row passes, with one finiteness check over the whole
    batch; None when one fails (or cannot be converted): the walk then names the first."""
    try:
        rows = [torch.as_tensor(v, dtype=torch.float32).detach().cpu() for v in values]
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None
    for i, n in enumerate(lengths):
        if scalar_ok and rows[i].dim() == 0:
            rows[i] = rows[i].expand(n).clone()
        elif rows[i].shape != (n,):
            return None
    return rows if all_within(torch.cat(rows), -math.inf, math.inf) else None


def _float_rows_walk(values, lengths: Sequence[int], name: str, scalar_ok: bool) -> List[torch.Tensor]:
    rows = []
    for i, (value, n) in enumerate(zip(values, lengths)):
        row = torch.as_tensor(value, dtype=torch.float32).detach().cpu()
        if scalar_ok and row.dim() == 0:
            row = row.expand(n).clone()
        if row.dim() != 1 or row.numel() != n:
            raise ValueError(f"{name}[{i}] has shape {tuple(row.shape)} for a sequence of {n} "
                             f"tokens; give one value per token{' (or a float)' if scalar_ok else ''}")
        if not torch.isfinite(row).all():
            raise ValueError(f"{name}[{i}] holds NaN or inf; put a finite value (e.g. 0) where "
                             "the loss mask is 0")
        rows.append(row)
    return rows


def _bad_masks(masks: List[torch.Tensor], lengths: Sequence[int]):
    """Indices to check one by one: none when every mask is 0/1 with 0 at entry 0 (checked at
    once), else all of them, in order (the first bad one is named)."""
    flat = torch.cat(masks)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    if all_zero_one(flat) and not bool(flat[starts].any()):
        return range(0)
    return range(len(masks))


@dataclass(kw_only=True)
class RolloutBatch:
    """One training step's sequences on this data-parallel rank, in the framework's order."""

    tokens: List[torch.Tensor]
    """Per sequence, its token ids (prompt + response, every turn), unpadded, int64 [n_i]."""
    loss_mask: List[torch.Tensor]
    """Per sequence, 0/1 per token: entry j says whether predicting tokens[j] counts (entry 0: 0)."""
    group_ids: Sequence[Any]
    """Per sequence, its group (the samples of one prompt). Groups are where prefixes are
    looked for; a group whose members share too little runs dense."""
    advantages: Optional[List[Any]] = None
    """Per sequence, a float or one float per token (None: zeros, e.g. a log-prob pass)."""
    old_logprobs: Optional[List[torch.Tensor]] = None
    """Per sequence, behaviour-policy log-probs per token, or None."""
    ref_logprobs: Optional[List[torch.Tensor]] = None
    """Per sequence, reference-policy log-probs per token, or None."""
    fields: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    """Further per-token arrays the framework's loss reads (e.g. verl's rollout_is_weights)."""

    def __post_init__(self) -> None:
        self.tokens = [token_row(t, i) for i, t in enumerate(self.tokens)]
        if not self.tokens:
            raise ValueError("RolloutBatch has no sequences; give at least one")
        lengths = self.lengths
        for i, n in enumerate(lengths):
            if n < 2:
                raise ValueError(f"sequence {i} has {n} token(s); a sequence needs >= 2")
        self.group_ids = group_id_list(self.group_ids, len(lengths))
        self.loss_mask = _float_rows(self.loss_mask, lengths, "loss_mask")
        for i in _bad_masks(self.loss_mask, lengths):
            mask = self.loss_mask[i]
            if not ((mask == 0) | (mask == 1)).all() or mask[0] != 0:
                raise ValueError(f"loss_mask[{i}] must hold only 0/1 and 0 at entry 0 (nothing "
                                 "predicts the first token); shift a response mask by one if it "
                                 "is aligned with the predicting position")
        check_some_loss(self.loss_mask)
        advantages = self.advantages if self.advantages is not None else [0.0] * len(lengths)
        self.advantages = _float_rows(advantages, lengths, "advantages", scalar_ok=True)
        self.old_logprobs = _float_rows(self.old_logprobs, lengths, "old_logprobs")
        self.ref_logprobs = _float_rows(self.ref_logprobs, lengths, "ref_logprobs")
        self.fields = {name: _float_rows(v, lengths, f"fields[{name!r}]")
                       for name, v in self.fields.items()}
        clash = set(self.fields) & set(_PER_TOKEN + ("logprobs", "entropy"))
        if clash:
            raise ValueError(f"fields {sorted(clash)} clash with TokenBatch's own names; rename them")

    @property
    def lengths(self) -> List[int]:
        return [t.numel() for t in self.tokens]

    def fields_digest(self) -> str:
        """crc32 of every `fields` array (names, dtypes, shapes, values, in order): the step's
        agreement folds it in beside the batch's digest (prefix_schedule batch_digest covers
        tokens, masks, advantages and log-probs, not these), so tensor- or pipeline-parallel
        peers holding different per-token fields are refused, not trained on."""
        import zlib

        crc = 0
        for name in sorted(self.fields):
            crc = zlib.crc32(name.encode(), crc)
            for row in self.fields[name]:
                values = row.detach().cpu().contiguous()
                crc = zlib.crc32(repr((str(values.dtype), tuple(values.shape))).encode(), crc)
                crc = zlib.crc32(values.numpy().tobytes(), crc)
        return f"{crc:08x}"

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(m.sum() for m in self.loss_mask))

    def flat(self, name: str) -> Optional[torch.Tensor]:
        """The per-token array `name` of all sequences, concatenated (None if absent)."""
        rows = self.fields[name] if name in self.fields else getattr(self, name)
        return None if rows is None else torch.cat(rows)

    @classmethod
    def from_padded(cls, *, input_ids, attention_mask, loss_mask, group_ids, **per_token):
        """Rows [B, L] (left or right padding, or both) with attention_mask 1 at real tokens;
        loss_mask / advantages / old_logprobs / ref_logprobs / fields entries are [B, L] aligned
        with input_ids (advantages may be [B]). Keeps each row's real tokens."""
        check_names(per_token, "from_padded")
        keep = padded_keep(input_ids, attention_mask)
        extra = {k: (None if v is None else padded_rows(k, v, keep, k == "advantages"))
                 for k, v in per_token.items() if k != "fields"}
        fields = {k: padded_rows(f"fields[{k!r}]", v, keep)
                  for k, v in (per_token.get("fields") or {}).items()}
        return cls(tokens=padded_rows("input_ids", input_ids, keep),
                   loss_mask=padded_rows("loss_mask", loss_mask, keep), group_ids=group_ids,
                   fields=fields, **extra)

    @classmethod
    def from_packed(cls, *, tokens, cu_seqlens, loss_mask, group_ids, **per_token):
        """THD: all sequences in one 1-D row, sequence i at cu_seqlens[i]:cu_seqlens[i+1];
        per-token arrays are 1-D the same way (advantages may be one per sequence)."""
        check_names(per_token, "from_packed")
        cu = packed_offsets(cu_seqlens)
        extra = {k: (None if v is None else packed_array(k, v, cu, k == "advantages"))
                 for k, v in per_token.items() if k != "fields"}
        fields = {k: packed_array(f"fields[{k!r}]", v, cu)
                  for k, v in (per_token.get("fields") or {}).items()}
        return cls(tokens=packed_array("tokens", tokens, cu),
                   loss_mask=packed_array("loss_mask", loss_mask, cu), group_ids=group_ids,
                   fields=fields, **extra)


@dataclass(kw_only=True)
class TokenBatch:
    """The tokens of ONE Megatron microbatch as the framework's loss function sees them: flat
    [n] tensors over the positions this microbatch predicts (any order), on the model's device."""

    logprobs: torch.Tensor
    """log p(token) under the model being trained (carries the gradient)."""
    entropy: Optional[torch.Tensor]
    """Entropy of the predictive distribution (with gradient), when asked for."""
    sequence_index: torch.Tensor
    """The RolloutBatch index of each position's sequence."""
    position: torch.Tensor
    """The index j of the predicted token in its sequence."""
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    fields: Dict[str, torch.Tensor]
    num_microbatches: int
    """The number of microbatches Megatron divides a 2-tuple loss by IN THIS STEP: a framework
    that multiplies its loss by its microbatch count must use this one (reuse changes it)."""
    rollout: RolloutBatch
    """The whole batch (per-sequence facts such as a sequence's loss-token count)."""

    @property
    def num_tokens(self) -> torch.Tensor:
        """The microbatch's loss-token count, an integer tensor (torch.int, Megatron's dtype):
        what the (loss_sum, num_tokens, report) contract returns."""
        return self.loss_mask.sum().to(torch.int)

    def sequence_loss_tokens(self) -> torch.Tensor:
        """Per position, the loss-token count of its whole sequence (per-sample means)."""
        counts = torch.tensor([float(m.sum()) for m in self.rollout.loss_mask],
                              device=self.loss_mask.device)
        return counts[self.sequence_index]
