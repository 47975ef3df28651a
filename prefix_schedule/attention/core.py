"""Shared-prefix attention: suffix tokens attend to their group's cached prefix K/V and causally
to their own suffix, with gradients for the prefix K/V (see docs/DESIGN.md, Phase B).

[Note: two-part attention merged by log-sum-exp]
Part P: one varlen call whose batch is the group slots: the slot's suffix queries against the
slot's prefix keys, not causal. Part S: one varlen call over the suffix sequences, queries = keys
= the suffix, causal (square, so top-left equals bottom-right). Merge: lse = logaddexp(lse_P,
lse_S), out = exp(lse_P - lse) out_P + exp(lse_S - lse) out_S. Backward calls each part's kernel
backward with the MERGED out and MERGED lse and sums dq (the rule ring attention uses). A kernel's
returned LSE is not differentiable; backpropagating through the merge with a detached LSE gives
wrong dq/dk/prefix dK. Only q/k/v/out/lse are saved besides the cache's own K/V; with several
non-empty prefixes in one row, part P packs them into one transient key buffer per call.
The kernels come from prefix_schedule.attention.backends (TE, flash-attn, torch CPU, math).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral
from typing import Optional, Sequence

import torch

from prefix_schedule.attention.backends import select_backend, two_part_attention
from prefix_schedule.attention.backends.two_part import causal_attention as backend_causal_attention

__all__ = [
    "MODES",
    "PackedMeta",
    "causal_attention",
    "reference_attention",
    "shared_prefix_attention",
]

MODES = ("two_part", "copy")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _int_tuple(name: str, values) -> tuple[int, ...]:
    # Python ints only: a tensor entry would mean a device sync on every read.
    if isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a sequence of python ints built on the host, not a tensor")
    out = []
    for x in values:
        if isinstance(x, bool) or not isinstance(x, Integral):
            raise ValueError(f"{name} must hold python ints, got {type(x).__name__} ({x!r})")
        out.append(int(x))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class PackedMeta:
    """Layout of one packed (THD) row of suffix tokens; host-side python ints only."""

    cu_seqlens: tuple[int, ...]
    """Suffix boundaries in the packed row: starts with 0, strictly increasing, ends with T."""
    seq_slot: tuple[int, ...]
    """For each suffix sequence, the index of its group slot (into prefix_k / prefix_v). A slot's
    sequences are contiguous in the row and slots appear in order 0, 1, ..., num_slots - 1."""
    num_seqs: int = field(init=False)
    """Number of suffix sequences (derived)."""
    num_slots: int = field(init=False)
    """Number of group slots, i.e. prefix entries the call expects (derived)."""
    total_len: int = field(init=False)
    """T, the number of tokens in the row (derived)."""
    max_seqlen: int = field(init=False)
    """Longest suffix (derived)."""
    slot_ranges: tuple[tuple[int, int], ...] = field(init=False)
    """Per slot, the query range (start, end) of its suffix tokens in the row (derived)."""
    equal_runs: tuple[tuple[int, int, int], ...] = field(init=False)
    """(start, length, count) of each run of adjacent suffixes of equal length (derived): part S
    makes one copy-free kernel call per run, so sort suffixes by length to get fewer calls."""

    def __post_init__(self):
        cu = _int_tuple("cu_seqlens", self.cu_seqlens)
        slots = _int_tuple("seq_slot", self.seq_slot)
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start with 0 and hold at least one sequence, got {cu}")
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        if min(lengths) < 1:
            raise ValueError(f"cu_seqlens must be strictly increasing (every suffix >= 1 token), got {cu}")
        if len(slots) != len(lengths):
            raise ValueError(f"seq_slot has {len(slots)} entries but cu_seqlens describes "
                             f"{len(lengths)} sequences; give one slot per sequence")
        steps = [b - a for a, b in zip((0,) + slots, slots)]
        if slots[0] != 0 or any(s not in (0, 1) for s in steps[1:]):
            raise ValueError(f"seq_slot must be 0, 1, 2, ... with each slot's sequences contiguous "
                             f"and no slot skipped, got {slots}; reorder the packed row")
        ranges = [[cu[-1], 0] for _ in range(slots[-1] + 1)]
        runs: list[list[int]] = []
        for start, n, slot in zip(cu, lengths, slots):
            ranges[slot] = [min(ranges[slot][0], start), max(ranges[slot][1], start + n)]
            if runs and runs[-1][1] == n:
                runs[-1][2] += 1
            else:
                runs.append([start, n, 1])
        derived = dict(cu_seqlens=cu, seq_slot=slots, num_seqs=len(lengths), num_slots=len(ranges),
                       total_len=cu[-1], max_seqlen=max(lengths),
                       slot_ranges=tuple(tuple(r) for r in ranges),
                       equal_runs=tuple(tuple(r) for r in runs))
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], slots: Sequence[int]) -> "PackedMeta":
        """Meta for suffixes of the given lengths, packed in order, with their group slots."""
        cu = [0]
        for n in _int_tuple("lengths", lengths):
            cu.append(cu[-1] + n)
        return cls(cu_seqlens=tuple(cu), seq_slot=tuple(slots))


def _validate(q, k, v, prefix_k, prefix_v, meta, scale) -> float:
    """Raise ValueError on any user error before compute; return the softmax scale."""
    if not isinstance(meta, PackedMeta):
        raise ValueError(f"meta must be a PackedMeta, got {type(meta).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, hq, d = q.shape
    if T != meta.total_len:
        raise ValueError(f"q has {T} tokens but meta.cu_seqlens ends with {meta.total_len}")
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != d:
        raise ValueError(f"k and v must both be [{T}, kv_heads, {d}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if len(prefix_k) != meta.num_slots or len(prefix_v) != meta.num_slots:
        raise ValueError(f"meta has {meta.num_slots} group slots but got {len(prefix_k)} prefix_k and "
                         f"{len(prefix_v)} prefix_v entries; pass one (possibly empty) entry per slot")
    for g, (pk, pv) in enumerate(zip(prefix_k, prefix_v)):
        if pk.dim() != 3 or pk.shape[1:] != (hkv, d) or pk.shape != pv.shape:
            raise ValueError(f"prefix_k[{g}] and prefix_v[{g}] must both be [P, {hkv}, {d}], got "
                             f"{tuple(pk.shape)} and {tuple(pv.shape)}")
    tensors = (q, k, v, *prefix_k, *prefix_v)
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in tensors):
        raise ValueError(f"q, k, v and every prefix entry must share one dtype among {_DTYPES}, "
                         f"got {sorted({str(t.dtype) for t in tensors})}")
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite python float, got {scale!r}")
    return float(scale)


def _select(backend: Optional[str], q: torch.Tensor, window: Optional[int] = None):
    impl = select_backend(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1])
    if window is not None and not impl.supports_window:
        raise ValueError(
            f"attention backend {impl.name!r} does not run sliding windows in the prefix-reuse "
            "two-part path (its windowed part P needs one entry per suffix with a per-entry "
            "window offset, see [Note: sliding windows] in backends/two_part.py); use the 'torch' "
            "or 'math' backend (--attention-backend) for window_size models")
    return impl


def _check_extras(q, sink, window, mode) -> None:
    """ValueError for a bad sink / window before compute (see two_part.py's notes)."""
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.dim() != 1 or sink.shape[0] != q.shape[1]:
            raise ValueError(f"sink must be a [{q.shape[1]}] tensor (one logit per query head), "
                             f"got {getattr(sink, 'shape', sink)!r}")
        if sink.device != q.device or not sink.dtype.is_floating_point:
            raise ValueError(f"sink must be a floating tensor on {q.device}, got {sink.dtype} on "
                             f"{sink.device}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, Integral)
                               or window < 0):
        raise ValueError(f"window must be None or a python int >= 0 (Megatron's window_size[0]), "
                         f"got {window!r}")
    if mode == "copy" and (sink is not None or window is not None):
        raise ValueError("copy mode implements neither attention sinks nor sliding windows; use "
                         "mode='two_part'")


def shared_prefix_attention(q, k, v, prefix_k, prefix_v, meta, *, scale=None, mode="two_part",
                            backend=None, sink=None, window=None):
    """Suffix tokens attend to their group's cached prefix and causally to their own suffix.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (packed THD row of suffix tokens; Hq % Hkv == 0, GQA).
    prefix_k, prefix_v: one [P_g, Hkv, D] tensor per group slot of `meta`; P_g may be 0.
    meta: PackedMeta. Returns out [T, Hq, D]. Differentiable w.r.t. q, k, v and every prefix
    entry by ordinary autograd (their grads are returned, never accumulated here).
    mode: "two_part" (default; two varlen kernel calls merged by LSE, no prefix copy) or "copy"
    (prefix gathered per suffix, one bottom-right causal call; the public-API fallback).
    backend: a name of prefix_schedule.attention.backends.BACKEND_NAMES or "auto"; None uses
    the process default (set_default_backend). Errors are raised before any compute.
    sink: [Hq] learnable softmax offsets (Megatron softmax_type='learnable'), counted once per
    query ([Note: attention sinks] in backends/two_part.py); window: W of Megatron's
    window_size (W, 0): a token at position p sees positions p - W ... p, where a suffix token's
    position continues after its prefix ([Note: sliding windows]).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    v, prefix_v, v_dim = _pad_values(q, v, list(prefix_v))
    scale = _validate(q, k, v, prefix_k, prefix_v, meta, scale)
    _check_extras(q, sink, window, mode)
    impl = _select(backend, q, window)
    if mode == "copy":
        out = impl.copy_attention(q, k, v, list(prefix_k), prefix_v, meta, scale)
    else:
        out = two_part_attention(impl, q, k, v, list(prefix_k), prefix_v, meta.cu_seqlens,
                                 meta.slot_ranges, scale, sink=sink,
                                 window=None if window is None else int(window))
    return out if v_dim is None else out[..., :v_dim]


def _pad_values(q, v, prefix_v):
    """[Note: unequal V head dim] MLA's values are narrower than its queries and keys
    (DeepSeek-V3: 128 vs 192). The CPU flash kernel and flash-attn 2 need one head dim, so V
    (and each prefix V) is zero-padded to q's head dim and the output trimmed back: the zero
    columns add nothing to any output column, and the padding's gradient is dropped by autograd,
    so the result is exact (the same workaround Megatron's MLA uses for TE's THD path,
    `_prepare_mla_core_attention_value`). Cost: a padded copy of the V entries per call (the
    prefix V is held once more for backward while the call's graph lives). Returns (v,
    prefix_v, the original width or None when nothing was padded); V wider than Q/K is refused."""
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or not isinstance(q, torch.Tensor) \
            or q.dim() != 3 or v.shape[-1] == q.shape[-1]:
        return v, prefix_v, None
    v_dim, d = v.shape[-1], q.shape[-1]
    if v_dim > d:
        raise ValueError(f"value head dim {v_dim} is larger than the query/key head dim {d}; "
                         "only a narrower V (MLA) is supported")
    pad = lambda t: torch.nn.functional.pad(t, (0, d - v_dim))  # noqa: E731
    return pad(v), [pad(p) if p.dim() == 3 and p.shape[-1] == v_dim else p for p in prefix_v], v_dim


def causal_attention(q, k, v, *, scale=None, backend=None, sink=None, window=None):
    """Square causal self-attention on [L, Hq, D] / [L, Hkv, D]. Differentiable.
    backend, sink, window: as for shared_prefix_attention."""
    if q.dim() != 3 or q.shape[0] < 1:
        raise ValueError(f"q must be [L >= 1, heads, head_dim], got {tuple(q.shape)}")
    meta = PackedMeta(cu_seqlens=(0, q.shape[0]), seq_slot=(0,))
    no_prefix = k.new_empty((0, *k.shape[1:]))  # reuse the shared checks with P = 0
    v, _, v_dim = _pad_values(q, v, [])  # [Note: unequal V head dim]
    scale = _validate(q, k, v, [no_prefix], [no_prefix], meta, scale)
    _check_extras(q, sink, window, "two_part")
    out = backend_causal_attention(_select(backend, q, window), q, k, v, scale, sink=sink,
                                   window=None if window is None else int(window))
    return out if v_dim is None else out[..., :v_dim]


def _reference_mask(meta: PackedMeta, prefix_lens: list[int], device) -> torch.Tensor:
    """[T, sum(P) + T] boolean mask over keys [prefix_0; ...; prefix_G-1; packed suffix keys]:
    each sequence sees [its prefix ; itself], bottom-right aligned (query i of an n-token suffix
    over P + n keys sees key c iff c <= i + P)."""
    offsets = [0]
    for p in prefix_lens:
        offsets.append(offsets[-1] + p)
    mask = torch.zeros(meta.total_len, offsets[-1] + meta.total_len, dtype=torch.bool)
    for a, b, slot in zip(meta.cu_seqlens, meta.cu_seqlens[1:], meta.seq_slot):
        cols = torch.cat([torch.arange(offsets[slot], offsets[slot + 1]),
                          offsets[-1] + torch.arange(a, b)])
        n, num_keys = b - a, cols.numel()
        mask[a:b, cols] = torch.arange(num_keys)[None, :] <= torch.arange(n)[:, None] + (num_keys - n)
    return mask.to(device)


def reference_attention(q, k, v, prefix_k, prefix_v, meta, *, scale=None):
    """float64 dense-mask oracle with the inputs and output of shared_prefix_attention.
    Computes in float64, returns q's dtype. For tests only (memory T x (sum P + T)); differentiable.
    V may be narrower than Q/K (MLA): its own width is used throughout (no padding)."""
    padded_v, padded_prefix_v, _ = _pad_values(q, v, list(prefix_v))
    scale = _validate(q, k, padded_v, prefix_k, padded_prefix_v, meta, scale)
    rep = q.shape[1] // k.shape[1]
    keys = torch.cat([*prefix_k, k]).to(torch.float64).repeat_interleave(rep, 1)
    values = torch.cat([*prefix_v, v]).to(torch.float64).repeat_interleave(rep, 1)
    mask = _reference_mask(meta, [p.shape[0] for p in prefix_k], q.device)
    scores = torch.einsum("thd,khd->htk", q.to(torch.float64), keys) * scale
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("htk,khd->thd", probs, values).to(q.dtype)
