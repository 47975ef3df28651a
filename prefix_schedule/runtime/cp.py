"""Context parallelism (CP) of a reuse step: zigzag row layouts and the CP group's collectives.

[Note: zigzag CP layout] and [Note: whole suffixes per CP rank]: cp_layout.py (the row
layouts and `balance_owners`, pure index arithmetic).

[Note: CP Phase C memory]
Before a CP prefix chunk's Phase C, each rank holds the fp32 gK/gV its queries gave every token
of the chunk (every layer: at a 32k-token prefix, GiBs). `reduce_scatter_real` writes them
straight into the collective's one rank-major send buffer (padding rows zeroed, no padded or
concatenated intermediate), dropping each accumulator once packed, and frees the buffer as
soon as this rank's rows are out: at most the accumulators plus that buffer (2 copies) are live,
then the buffer plus the 1/CP result.

[Note: packed CP prefix rows]
Run one unit per group, a CP rank holds half of each short prefix: per group and layer a pass
of Megatron over few tokens, a zigzag three-part attention and a blocking K/V all-gather (a
sync point), and per group a gK/gV reduce-scatter. So without pipelining (PP = V = 1), a CP step
packs every whole (unchunked, loss-free) prefix into ONE Phase A row (ReuseStep._pack_rows):
its sequences are laid out like a suffix row's (`balance_owners` on the prefix lengths), so
prefixes that balance run whole on one rank each -- plain causal attention, nothing gathered
for it -- and only the longest are zigzag-split when they do not. The cache still needs every
prefix's whole K/V on every rank for Phase B: `gather_all` all-gathers each layer's local K/V
rows asynchronously (detached: reads need the values, gradients come back through Phase C)
and the first read waits for it. Each member group keeps its own cache entries (reads by group
are unchanged); they share the row's local K/V as their graph and one `to_local`, and Phase C
runs the row once: one reduce-scatter of every member's gK/gV over all rows
(`reduce_scatter_real(..., spans=)`: whole prefixes reduce to their owner), one
autograd call. Phase A then moves the same K/V bytes, with no blocking collective when every
prefix runs whole, and Phase C one gK/gV reduce-scatter per row instead of one per group (split
members keep their attention's per-layer all-gather and its reduce-scatter).

Megatron-free: the group is a torch.distributed process group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from prefix_schedule.runtime.cp_layout import BALANCE_TOLERANCE, ZigzagLayout, balance_owners

__all__ = ["BALANCE_TOLERANCE", "ZigzagLayout", "CPGroup", "CPRow", "balance_owners"]
# ZigzagLayout, balance_owners and BALANCE_TOLERANCE live in cp_layout.py (re-exported here)


# single-tensor collectives (NCCL and gloo): the newer torch names where they exist (the
# older ones then warn as deprecated), else the older ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CPGroup:
    """The CP process group of this rank, its collectives and the bytes they move.

    Byte counts are per rank, as a ring moves them: an all-gather or a reduce-scatter of a
    full tensor of N bytes sends (CP-1)/CP * N (what NCCL's ring sends per rank); recorded per
    phase ("A", "B", "C") and collective: keys like "B.all_gather", "C.reduce_scatter".
    """

    def __init__(self, group, *, size: int = None, rank: int = None,
                 row_multiple: int = 1) -> None:
        self.group = group
        self.row_multiple = row_multiple
        """Every local row a multiple of this: the TP size under sequence parallelism."""
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        self.traffic: Dict[str, int] = {}
        self._indices: Dict[tuple, torch.Tensor] = {}

    def index(self, layout: ZigzagLayout, kind: str, device) -> torch.Tensor:
        """layout's "gather", "real", "split", "ranked_real" or "ranked_padding" index on
        `device`, built and copied once per (layout, device) for the group's lifetime (a step):
        no host work or pageable host-to-device copy per layer."""
        key = (layout, kind, str(device))
        if key not in self._indices:
            build = {"gather": layout.gather_index, "real": layout.real_index,
                     "split": layout.split_rows, "all": layout.all_index,
                     "ranked_real": layout.ranked_real_index,
                     "ranked_padding": layout.ranked_padding_index,
                     "ranked_real_all": lambda: layout.ranked_real_index(every_row=True),
                     "ranked_padding_all": lambda: layout.ranked_padding_index(every_row=True),
                     }[kind]
            self._indices[key] = build().to(device)
        return self._indices[key]

    def layout(self, lengths: Sequence[int], owners: Sequence[int] = ()) -> ZigzagLayout:
        return ZigzagLayout(tuple(int(n) for n in lengths), self.size, self.rank,
                            tuple(int(o) for o in owners), self.row_multiple)

    def _count(self, phase: str, nbytes: int) -> None:
        self.traffic[phase] = self.traffic.get(phase, 0) + nbytes * (self.size - 1) // self.size

    def all_gather_rows(self, x: torch.Tensor, layout: ZigzagLayout, phase: str,
                        backward_phase: str) -> torch.Tensor:
        """The padded full row [full_len, ...] from every rank's local `x` [local_len, ...],
        differentiable: its backward (counted under `backward_phase`: Phase A's runs in Phase C)
        reduce-scatters the gradient back to the local rows. Only split sequences move; the
        rows of whole ones ([Note: whole suffixes per CP rank]) are zero in the result."""
        if layout.owners:
            x = x[self.index(layout, "split", x.device)]
        return _GatherRows.apply(x, layout, self, phase, backward_phase)

    def gather_all(self, x: torch.Tensor, layout: ZigzagLayout, phase: str) -> Callable:
        """Start the all-gather of every rank's whole local row `x` [local_len, ...] (detached;
        split and whole sequences alike) into the padded full row; returns `finish()`, which
        waits for it and gives [full_len, ...] ([Note: packed CP prefix rows]): nothing
        waits for the other ranks until a reader needs the rows."""
        width = max(layout.local_len_of(r) for r in range(self.size))
        padded = x.detach().new_zeros((width, *x.shape[1:]))
        padded[:x.shape[0]] = x.detach()
        ranked = padded.new_empty((self.size * width, *x.shape[1:]))
        work = _ALL_GATHER(ranked, padded, group=self.group, async_op=True)
        self._count(phase + ".all_gather", ranked.numel() * ranked.element_size())
        index = self.index(layout, "all", x.device)

        def finish() -> torch.Tensor:
            work.wait()
            full = ranked.new_zeros((layout.full_len + 1, *ranked.shape[1:]))
            full[index] = ranked  # the padding entries all land in the extra last row
            return full[:layout.full_len]

        return finish

    def gradient_to_local(self, layout: ZigzagLayout, device, spans=None) -> Callable:
        """A CP prefix row's `to_local` for the prefix cache ([Note: CP prefix cache]): Phase
        C's reduce-scatter of the whole-prefix gK/gV. `spans`: a packed row's members' real
        token ranges ([Note: packed CP prefix rows]): their gradients come member after member
        and the whole local row's gradients go to the first member (None to the others: they
        share its graph)."""
        if spans is None:
            return lambda grads, shapes: self.reduce_scatter_real(grads, shapes, layout, "C",
                                                                  device)

        def packed(grads, shapes):
            local = self.reduce_scatter_real(grads, shapes, layout, "C", device, spans=spans)
            return local + [None] * (len(grads) - len(local))

        return packed

    def reduce_scatter_real(self, grads: List[Optional[torch.Tensor]],
                            shapes: Sequence[torch.Size], layout: ZigzagLayout, phase: str,
                            device, spans=None) -> List[torch.Tensor]:
        """Sum over the CP group of every rank's whole-sequence tensors [real tokens, ...] (fp32
        on `device`; None: zeros of `shapes[i]`), each cut to this rank's local rows (padding
        rows zero): one collective for the list ([Note: CP Phase C memory]). Consumes `grads`:
        each entry is written straight into the one rank-major send buffer, then dropped from
        the list, so a caller that passes the only references frees each as it is packed.
        `spans` ([Note: packed CP prefix rows]): the row's real tokens come in parts, [start,
        end) each, given member after member (len(grads) = parts x tensors per part); every
        rank's whole local row is then scattered (whole sequences reduce to their owner) and
        one tensor per part position returns."""
        parts = [(0, sum(layout.lengths))] if spans is None else list(spans)
        count = len(grads) // len(parts)
        if len(grads) != len(shapes) or count * len(parts) != len(grads):
            raise ValueError(f"{len(grads)} gradients for {len(shapes)} shapes in "
                             f"{len(parts)} parts")
        widths = [math.prod(shape[1:]) for shape in shapes[:count]]
        every = spans is not None
        rows = self.index(layout, "ranked_real_all" if every else "ranked_real", device)
        padding = self.index(layout, "ranked_padding_all" if every else "ranked_padding", device)
        ranked = torch.empty((rows.numel() + padding.numel(), sum(widths)), dtype=torch.float32,
                             device=device)
        ranked.index_fill_(0, padding, 0)  # no gradient
        for j, (start, end) in enumerate(parts):
            at = 0
            for t, width in enumerate(widths):
                i, columns = j * count + t, ranked[:, at:at + width]
                if grads[i] is None:
                    columns.index_fill_(0, rows[start:end], 0)
                else:
                    columns.index_copy_(0, rows[start:end], grads[i].reshape(end - start, width))
                grads[i] = None  # packed: free it now
                at += width
        local = self._reduce_scatter_ranked(ranked, phase)
        del ranked
        if every:
            local = local[:layout.local_len]
        out, at = [], 0
        for shape, width in zip(shapes, widths):
            out.append(local[:, at:at + width].reshape(local.shape[0], *shape[1:]))
            at += width
        return out

    # ---- the two collectives (rank-major local rows)
    def _all_gather(self, x: torch.Tensor, layout: ZigzagLayout, phase: str) -> torch.Tensor:
        x = x.contiguous()
        ranked = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # rank-major
        _ALL_GATHER(ranked, x, group=self.group)
        self._count(phase + ".all_gather", ranked.numel() * ranked.element_size())
        full = (x.new_zeros if layout.owners else x.new_empty)((layout.full_len, *x.shape[1:]))
        full[self.index(layout, "gather", x.device)] = ranked
        return full

    def _reduce_scatter(self, full: torch.Tensor, layout: ZigzagLayout,
                        phase: str) -> torch.Tensor:
        ranked = full[self.index(layout, "gather", full.device)].contiguous()  # rank-major
        return self._reduce_scatter_ranked(ranked, phase)

    def _reduce_scatter_ranked(self, ranked: torch.Tensor, phase: str) -> torch.Tensor:
        """This rank's rows of the sum of every rank's contiguous rank-major `ranked`."""
        self._count(phase + ".reduce_scatter", ranked.numel() * ranked.element_size())
        rows = ranked.shape[0] // self.size  # local_len when every sequence is split
        out = ranked.new_empty((rows, *ranked.shape[1:]))
        _REDUCE_SCATTER(out, ranked, group=self.group)  # NCCL and gloo alike (one code path)
        return out


class _GatherRows(torch.autograd.Function):
    """All-gather of zigzag local rows; backward: reduce-scatter (every CP rank runs the same
    graph, so the collectives of a backward pair up in order)."""

    @staticmethod
    def forward(ctx, x, layout, cp, phase, backward_phase):
        ctx.layout, ctx.cp, ctx.phase = layout, cp, backward_phase
        return cp._all_gather(x, layout, phase)

    @staticmethod
    def backward(ctx, grad):
        local = ctx.cp._reduce_scatter(grad.contiguous(), ctx.layout, ctx.phase)
        return local, None, None, None, None


@dataclasses.dataclass(frozen=True, eq=False)
class CPRow:
    """What the hooks need to run one row context-parallel: the group, the row's layout and this
    rank's local positions (RoPE)."""

    group: CPGroup
    layout: ZigzagLayout
    position_ids: torch.Tensor
    """[local_len] position of each local token (suffixes continue at their prefix length)."""
    max_position: int
    """Largest entry of position_ids over the whole row (host int)."""
