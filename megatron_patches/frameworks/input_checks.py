"""The checks on what a framework hands the adapter, before any compute (rollout.py calls them).

[Note: adapter inputs are refused, never guessed]
A framework's batch reaches the adapter in three shapes: per sequence (`RolloutBatch(...)`),
padded rows (`from_padded`) and packed THD (`from_packed`). Anything the adapter would have to
guess about is a `ValueError` naming the field and what to pass: token ids that are not
integers (a float id would be truncated, a bool one become 0/1), ids of the wrong rank, group
ids that are not one hashable int/str per sequence (a list of 0-dim tensors hashes by identity:
every sequence its own group, no reuse), an attention mask that is not 0/1 or has a hole inside
a row, a loss mask over padding, per-token arrays of another length than the tokens (a row of
L-1 entries aligned with input_ids[:, 1:] says how to shift), fractional `cu_seqlens`, and a
batch whose loss mask is 0 everywhere (a step that trains nothing). tests/test_adapter_inputs.py
holds one case per refusal and input kind. No Megatron import here.
"""
from __future__ import annotations

import math
from typing import Any, List, Sequence

import torch

__all__ = ["token_row", "group_id_list", "padded_keep", "padded_rows", "packed_offsets", "packed_array", "check_names",
           "check_some_loss"]

_ALIGN_HINT = ("if it is aligned with input_ids[:, 1:] (one entry per predicted token), put a "
               "0 column in front so that entry j is about predicting input_ids[:, j]")


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def token_row(value, i: int) -> torch.Tensor:
    """Sequence i's token ids as a 1-D int64 CPU tensor; refused when not integer or not 1-D."""
    t = torch.as_tensor(value).detach()
    if not _integer(t):
        what = "would become ids 0/1" if t.dtype == torch.bool else "would be truncated"
        raise ValueError(f"tokens[{i}] has dtype {t.dtype} (its ids {what}); give integer token "
                         "ids (torch.int64)")
    if t.dim() != 1:
        raise ValueError(f"tokens[{i}] has shape {tuple(t.shape)}; give one 1-D tensor of token "
                         "ids per sequence (RolloutBatch.from_padded reads [B, L] rows)")
    return t.cpu().to(torch.int64)


def _group_id(value: Any, i: int):
    if torch.is_tensor(value) or hasattr(value, "item") and hasattr(value, "dtype"):
        if getattr(value, "ndim", 0) != 0:
            raise ValueError(f"group_ids[{i}] has shape {tuple(value.shape)}; give one int or "
                             "str group id per sequence")
        value = value.item()
    if isinstance(value, bool):
        raise ValueError(f"group_ids[{i}]={value!r} is a bool; give the int or str group id "
                         "of each sequence (the samples of one prompt share it)")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"group_ids[{i}]={value!r} is not a whole number; give the int or "
                             "str group id of each sequence (the samples of one prompt share it)")
        value = int(value)
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"group_ids[{i}] is an unhashable {type(value).__name__}; give an int "
                         "or str group id per sequence") from None
    return value


def group_id_list(group_ids, num_sequences: int) -> List[Any]:
    """One hashable group id per sequence (0-dim tensors and numpy scalars as Python values)."""
    if torch.is_tensor(group_ids) and group_ids.dim() != 1:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}; give one group id per "
                         "sequence (a 1-D list or tensor)")
    ids = [_group_id(g, i) for i, g in enumerate(group_ids)]
    if len(ids) != num_sequences:
        raise ValueError(f"group_ids has {len(ids)} entries for {num_sequences} sequences; give "
                         "one group id per sequence")
    return ids


def _zero_one(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or bool(((t == 0) | (t == 1)).all())


def padded_keep(input_ids, attention_mask) -> torch.Tensor:
    """The [B, L] bool mask of real tokens, each row one contiguous run of 1s."""
    ids, mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask)
    if ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; give [B, L] rows (one per "
                         "sequence)")
    if not _integer(ids):
        raise ValueError(f"input_ids has dtype {ids.dtype}; give integer token ids (torch.int64)")
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} and input_ids {tuple(ids.shape)} "
                         "differ in shape; give a [B, L] mask with 1 at real tokens")
    if not _zero_one(mask):
        raise ValueError("attention_mask holds values other than 0/1; give 1 at real tokens, "
                         "0 at padding")
    keep = mask.bool()
    count = keep.sum(1)
    pos = torch.arange(keep.shape[1]).expand_as(keep)
    first = torch.where(keep, pos, keep.shape[1]).min(1).values
    last = torch.where(keep, pos, -1).max(1).values
    holes = ((last - first + 1) != count) & (count > 0)
    if bool(holes.any()):
        b = int(holes.nonzero()[0])
        raise ValueError(f"attention_mask row {b} has a hole (0 between real tokens); give each "
                         "row one contiguous run of real tokens (left or right padding), or "
                         "pass the sequences one by one")
    return keep


def padded_rows(name: str, values, keep: torch.Tensor, per_sequence_ok: bool = False):
    """Per row, the real-token entries of the [B, L] array `name` (or, where `per_sequence_ok`,
    its [B] values)."""
    values = torch.as_tensor(values)
    B, L = keep.shape
    if per_sequence_ok and values.shape == (B,):
        return list(values)
    if values.shape != (B, L):
        want = f"[{B}, {L}] (like input_ids)" + (f" or [{B}] (one per sequence)"
                                                  if per_sequence_ok else "")
        hint = f"; {_ALIGN_HINT}" if values.dim() == 2 and values.shape == (B, L - 1) else ""
        raise ValueError(f"{name} has shape {tuple(values.shape)}; give {want}{hint}")
    if name == "loss_mask" and bool((values[~keep] != 0).any()):
        raise ValueError("loss_mask is not 0 at some padding (attention_mask 0); give a loss "
                         "mask that is 0 wherever attention_mask is 0")
    return [values[b][keep[b]] for b in range(B)]


def packed_offsets(cu_seqlens) -> List[int]:
    """`cu_seqlens` as Python ints: integer, increasing, from 0."""
    cu_t = torch.as_tensor(cu_seqlens)
    if cu_t.is_floating_point() and not bool((cu_t == cu_t.round()).all()):
        raise ValueError(f"cu_seqlens={cu_t.reshape(-1)[:8].tolist()}... holds fractions; give "
                         "integer offsets (torch.int32/int64)")
    if not (_integer(cu_t) or cu_t.is_floating_point()) or cu_t.dim() != 1:
        raise ValueError(f"cu_seqlens has dtype {cu_t.dtype} and shape {tuple(cu_t.shape)}; give "
                         "1-D integer offsets")
    cu = [int(c) for c in cu_t]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens={cu[:8]}...: give increasing offsets starting at 0")
    return cu


def packed_array(name: str, values, cu: Sequence[int], per_sequence_ok: bool = False):
    """Per sequence, the entries of the packed 1-D array `name` ([total] or, where allowed,
    one per sequence)."""
    values = torch.as_tensor(values)
    if values.dim() == 2 and values.shape[0] == 1:
        values = values[0]  # Megatron's THD [1, T]
    total, num = cu[-1], len(cu) - 1
    if values.dim() == 1 and per_sequence_ok and values.numel() == num:
        return list(values)
    if values.dim() != 1 or values.numel() != total:
        want = f"[{total}] (cu_seqlens[-1] entries)" + (f" or [{num}] (one per sequence)"
                                                         if per_sequence_ok else "")
        raise ValueError(f"packed {name} has shape {tuple(values.shape)}; give {want}")
    return [values[a:b] for a, b in zip(cu, cu[1:])]


_OPTIONAL = ("advantages", "old_logprobs", "ref_logprobs", "fields")


def check_names(per_token: dict, constructor: str) -> None:
    """`constructor`'s optional keywords (a misspelt one is named, not a TypeError)."""
    unknown = sorted(set(per_token) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"RolloutBatch.{constructor} got {unknown}; its optional arrays are "
                         f"{list(_OPTIONAL)} (a framework's own per-token arrays go in fields)")


def check_some_loss(masks: List[torch.Tensor]) -> None:
    """A batch whose loss mask is 0 everywhere would train (or score) nothing."""
    if not bool(torch.cat(masks).any()):
        raise ValueError("loss_mask is 0 at every token of every sequence: the step would train "
                         "nothing and return no log-probs; set 1 at the tokens to train (the "
                         "response), or leave the batch out")
