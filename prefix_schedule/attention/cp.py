"""Attention of a CP rank's zigzag local row ([Note: zigzag CP layout] in runtime/cp.py).

[Note: CP attention as two parts per piece]
The local row is a list of pieces (sequence i, chunk [a, b) of it). A piece's queries see, in
order: the sequence's cached prefix (its group's whole prefix, or a prefix unit's earlier
chunks; gathered, no mask), the sequence's own tokens [0, a) (gathered from every CP rank, no
mask) and the piece itself, causally. That is exactly shared_prefix_attention with one slot per
piece whose "prefix" is [cached prefix ; sequence[:a]] and whose "suffix" is the piece: part P
and part S merged by log-sum-exp ([Note: two-part attention merged by log-sum-exp] in core.py).
Gradients reach the local K/V directly (part S), the gathered sequence K/V through the
all-gather's reduce-scatter, and the cached prefix through the cache's accumulators.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from prefix_schedule.attention.core import PackedMeta, shared_prefix_attention

__all__ = ["zigzag_attention", "all_ranks_attention"]


def zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_full: torch.Tensor, v_full: torch.Tensor, layout,
                     prefix_k: Sequence[Optional[torch.Tensor]],
                     prefix_v: Sequence[Optional[torch.Tensor]], *,
                     scale: float, backend=None) -> torch.Tensor:
    """Local queries q [local_len, Hq, D] of `layout` (a ZigzagLayout) over their sequences.

    k, v: the local [local_len, Hkv, D]; k_full, v_full: the padded full row (all-gathered);
    prefix_k/prefix_v: per sequence of the row, its cached prefix [P, Hkv, D] or None.
    Returns [local_len, Hq, D]."""
    if len(prefix_k) != len(layout.lengths) or len(prefix_v) != len(layout.lengths):
        raise ValueError(f"one cached prefix (or None) per sequence: the row has "
                         f"{len(layout.lengths)}, got {len(prefix_k)} / {len(prefix_v)}")
    if q.shape[0] != layout.local_len or k_full.shape[0] != layout.full_len:
        raise ValueError(f"local row of {layout.local_len} and full row of {layout.full_len} "
                         f"tokens expected, got q {tuple(q.shape)} and k_full "
                         f"{tuple(k_full.shape)}")
    empty = k.new_zeros((0, *k.shape[1:]))
    starts = layout.starts
    keys: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    lengths: List[int] = []
    for i, a, b in layout.chunks(layout.rank):
        parts_k = [t for t in (prefix_k[i], k_full[starts[i]:starts[i] + a]) if t is not None]
        parts_v = [t for t in (prefix_v[i], v_full[starts[i]:starts[i] + a]) if t is not None]
        keys.append(_joined(parts_k, empty))
        values.append(_joined(parts_v, empty))
        lengths.append(b - a)
    meta = PackedMeta.from_lengths(lengths, range(len(lengths)))
    return shared_prefix_attention(q, k, v, keys, values, meta, scale=scale, backend=backend)


def _joined(parts, empty):
    """One key block (no copy for a single part: a slice of the gathered row, or the cache's)."""
    if not parts:
        return empty
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def all_ranks_attention(q, k, v, prefix_k, prefix_v, meta, *, cp: int, scale=None,
                        backend=None) -> torch.Tensor:
    """Every CP rank's zigzag_attention in one process, put back together: the inputs and output
    of shared_prefix_attention (whole packed row, one cached prefix per group slot of `meta`).

    The all-gather is emulated by padding the whole row (differentiable), so this checks the
    layout and the per-rank kernel calls against the oracle on any device (tests, gpu_check)."""
    from prefix_schedule.runtime.cp import ZigzagLayout

    lengths = [b - a for a, b in zip(meta.cu_seqlens, meta.cu_seqlens[1:])]
    layouts = [ZigzagLayout(tuple(lengths), cp, r) for r in range(cp)]
    real = layouts[0].real_index().to(q.device)

    def padded(t):
        return t.new_zeros((layouts[0].full_len, *t.shape[1:])).index_put((real,), t)

    q_full, k_full, v_full = padded(q), padded(k), padded(v)
    cached_k = [prefix_k[s] for s in meta.seq_slot]  # an empty prefix stays in the graph
    cached_v = [prefix_v[s] for s in meta.seq_slot]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros(q_full.shape)
    for layout in layouts:
        local = layout.local_index().to(q.device)
        out = out.index_put((local,), zigzag_attention(
            q_full[local], k_full[local], v_full[local], k_full, v_full, layout, cached_k,
            cached_v, scale=scale, backend=backend))
    return out[real]
