"""Attention of a CP rank's local row ([Note: zigzag CP layout] in runtime/cp.py).

[Note: CP attention as three parts]
The local row is a list of pieces (sequence i, chunk [a, b) of it; a whole sequence is one piece
with a = 0). A piece's queries see: the sequence's cached prefix (its group's whole prefix, or a
prefix unit's earlier chunks; no mask), the sequence's own tokens [0, a) (gathered from every CP
rank; no mask) and the piece itself, causally. Three varlen calls, merged by log-sum-exp
(attention/backends/multi_part.py): S, every piece over itself (causal, square; equal pieces
batch into one kernel call); P, one entry per run of adjacent pieces reading the same cached
prefix -- all of a group's local queries against its prefix at once, the prefix never copied;
E, each piece with a > 0 against its earlier tokens, entries sorted by shape (one kernel call
per shape), keys taken from the gathered row by one index_select. Gradients reach the local K/V
(S), the gathered row through the all-gather's reduce-scatter (E) and the cached prefix through
the cache's accumulators (P). (Earlier this was one slot per piece with [prefix ; sequence[:a]]
concatenated: a prefix copy and a kernel call per piece, ~3x the attention time per rank.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from prefix_schedule.attention.backends import select_backend
from prefix_schedule.attention.backends._base import VarlenCall
from prefix_schedule.attention.backends.multi_part import Part, multi_part_attention
from prefix_schedule.attention.backends.two_part import suffix_call

__all__ = ["zigzag_attention", "all_ranks_attention"]


@dataclass(frozen=True)
class _Plan:
    """The three parts of one layout, built on the host once per (layout, prefix pattern)."""

    parts: Tuple[Part, ...]
    prefix_of_entry: Tuple[int, ...]
    """Part P: the sequence whose cached prefix each entry reads."""
    earlier: Optional[torch.Tensor]
    """Part E: full-row index of its keys (host), or None without part E."""
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def earlier_index(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.earlier.to(device)
        return self._on_device[key]


@functools.lru_cache(maxsize=1024)
def _plan(layout, prefix_ids: Tuple[int, ...], prefix_lens: Tuple[int, ...]) -> _Plan:
    """prefix_ids: per sequence, an id of its cached prefix tensor (-1: none or empty)."""
    pieces = layout.chunks(layout.rank)
    starts = layout.starts
    lengths = [b - a for _, a, b in pieces]
    total = sum(lengths)
    parts = [Part(suffix_call(tuple([0] + list(_cumsum(lengths)))), None, 1)]
    runs: List[list] = []  # [row start, row end, sequence]
    at = 0
    for (i, a, b), n in zip(pieces, lengths):
        if prefix_ids[i] >= 0:
            if runs and runs[-1][1] == at and prefix_ids[runs[-1][2]] == prefix_ids[i]:
                runs[-1][1] = at + n
            else:
                runs.append([at, at + n, i])
        at += n
    if runs:
        rows = tuple((r0, r1) for r0, r1, _ in runs)
        call = VarlenCall(cu_q=(0, *_cumsum([r1 - r0 for r0, r1 in rows])),
                          cu_k=(0, *_cumsum([prefix_lens[i] for _, _, i in runs])), causal=False)
        parts.append(Part(call, None if rows == ((0, total),) else rows, len(runs)))
    offsets = list(_cumsum([0] + lengths))[:-1]
    earlier = sorted(((b - a, a, off, i) for (i, a, b), off in zip(pieces, offsets) if a > 0))
    index = None
    if earlier:
        call = VarlenCall(cu_q=(0, *_cumsum([n for n, _, _, _ in earlier])),
                          cu_k=(0, *_cumsum([a for _, a, _, _ in earlier])), causal=False)
        parts.append(Part(call, tuple((off, off + n) for n, _, off, _ in earlier), 1))
        index = torch.cat([torch.arange(starts[i], starts[i] + a) for _, a, _, i in earlier])
    return _Plan(tuple(parts), tuple(i for _, _, i in runs), index)


def _cumsum(values):
    total = 0
    for x in values:
        total += x
        yield total


def zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_full: Optional[torch.Tensor], v_full: Optional[torch.Tensor], layout,
                     prefix_k: Sequence[Optional[torch.Tensor]],
                     prefix_v: Sequence[Optional[torch.Tensor]], *,
                     scale: float, backend=None) -> torch.Tensor:
    """Local queries q [local_len, Hq, D] of `layout` (a ZigzagLayout) over their sequences.

    k, v: the local [local_len, Hkv, D]; k_full, v_full: the padded full row (all-gathered;
    None when no sequence is split: then nothing is read from it);
    prefix_k/prefix_v: per sequence of the row, its cached prefix [P, Hkv, D] or None.
    Returns [local_len, Hq, D]."""
    if len(prefix_k) != len(layout.lengths) or len(prefix_v) != len(layout.lengths):
        raise ValueError(f"one cached prefix (or None) per sequence: the row has "
                         f"{len(layout.lengths)}, got {len(prefix_k)} / {len(prefix_v)}")
    if q.shape[0] != layout.local_len or (layout.split and (
            k_full is None or k_full.shape[0] != layout.full_len)):
        raise ValueError(f"local row of {layout.local_len} and full row of {layout.full_len} "
                         f"tokens expected, got q {tuple(q.shape)} and k_full "
                         f"{None if k_full is None else tuple(k_full.shape)}")
    ids, lens, seen = [], [], {}
    for pk in prefix_k:
        if pk is None or pk.shape[0] == 0:
            ids.append(-1)
        else:
            ids.append(seen.setdefault(id(pk), len(seen)))
        lens.append(0 if pk is None else int(pk.shape[0]))
    plan = _plan(layout, tuple(ids), tuple(lens))
    keys, values = [[k]], [[v]]
    if plan.prefix_of_entry:
        keys.append([prefix_k[i] for i in plan.prefix_of_entry])
        values.append([prefix_v[i] for i in plan.prefix_of_entry])
    if plan.earlier is not None:
        index = plan.earlier_index(k_full.device)
        keys.append([k_full.index_select(0, index)])
        values.append([v_full.index_select(0, index)])
    impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
    return multi_part_attention(impl, q, plan.parts, keys, values, scale)


def all_ranks_attention(q, k, v, prefix_k, prefix_v, meta, *, cp: int, scale=None,
                        backend=None, owners=()) -> torch.Tensor:
    """Every CP rank's zigzag_attention in one process, put back together: the inputs and output
    of shared_prefix_attention (whole packed row, one cached prefix per group slot of `meta`).

    The all-gather is emulated by padding the whole row (differentiable), so this checks the
    layout and the per-rank kernel calls against the oracle on any device (tests, gpu_check).
    `owners`: as ZigzagLayout's (sequences held whole by one rank; () = all zigzag-split)."""
    from prefix_schedule.runtime.cp import ZigzagLayout

    lengths = [b - a for a, b in zip(meta.cu_seqlens, meta.cu_seqlens[1:])]
    layouts = [ZigzagLayout(tuple(lengths), cp, r, tuple(owners)) for r in range(cp)]
    real = layouts[0].real_index().to(q.device)

    def padded(t):
        return t.new_zeros((layouts[0].full_len, *t.shape[1:])).index_put((real,), t)

    q_full, k_full, v_full = padded(q), padded(k), padded(v)
    cached_k = [prefix_k[s] for s in meta.seq_slot]  # an empty prefix stays in the graph
    cached_v = [prefix_v[s] for s in meta.seq_slot]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros(q_full.shape)
    for layout in layouts:
        if layout.local_len == 0:  # owners that leave a rank nothing (balance_owners never does)
            continue
        local = layout.local_index().to(q.device)
        out = out.index_put((local,), zigzag_attention(
            q_full[local], k_full[local], v_full[local], k_full, v_full, layout, cached_k,
            cached_v, scale=scale, backend=backend))
    # a slot with an empty prefix reads nothing; keep it in the graph (zero gradient) as
    # shared_prefix_attention does, so callers may differentiate w.r.t. every prefix entry
    keep = [p.sum() * 0 for p in (*prefix_k, *prefix_v) if p.shape[0] == 0 and p.requires_grad]
    return out[real] + sum(keep) if keep else out[real]
