"""Context parallelism (CP) of a reuse step: zigzag row layouts and the CP group's collectives.

[Note: zigzag CP layout]
As Megatron shards a packed (THD) row for CP: every sequence of the row is padded at its end to
a multiple of 2*CP and cut into 2*CP equal chunks; rank r holds chunks r and 2*CP-1-r of every
sequence, in that order, sequence after sequence (TE's `thd_get_partitioned_indices`). Causal
work is then balanced. Padding tokens sit at the end of their sequence: causal attention hides
them from every real token, they carry no loss, and the prefix cache never exposes them
(`real_index`), so they change nothing and receive exactly zero gradient.
Phase A runs each prefix unit as one such sequence: each phase has its own balance. Only K/V
(forward, all-gather) and their gradients (backward, reduce-scatter) cross the CP group; never
activations.

[Note: whole suffixes per CP rank]
A suffix microbatch packs many short sequences that all read a prefix every rank already holds
whole (the cache keeps Phase A's gathered K/V). So Phase B first tries to give each CP rank
whole sequences (`balance_owners`: largest first onto the least-loaded rank, balancing both
tokens and attention pairs within `BALANCE_TOLERANCE`): such a sequence needs no K/V from any
other rank -- its attention is exactly the non-CP two-part attention -- and a microbatch of
them moves no bytes at all. Only when whole sequences cannot be balanced (too few, or a long
one) are the longest ones zigzag-split (owner -1) until the rest balance; the all-gather then
carries just the split sequences' rows. Measured at prefix 1024 / suffix 64 / G=8 (CP=2):
per-piece zigzag of every suffix cost each rank ~3x the attention time of the same queries as
whole sequences (a prefix copy per piece, 16-query kernel calls) plus two collectives per layer
(docs/BENCHMARKS.md).

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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["BALANCE_TOLERANCE", "ZigzagLayout", "CPGroup", "CPRow", "balance_owners"]

BALANCE_TOLERANCE = 0.05
"""Largest CP rank load (tokens, attention pairs) over the mean that whole suffixes may leave."""

# single-tensor collectives (NCCL and gloo): the newer torch names where they exist (the
# older ones then warn as deprecated), else the older ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class ZigzagLayout:
    """The CP layout of one packed row ([Note: zigzag CP layout], [Note: whole suffixes per CP
    rank]); host ints only."""

    lengths: Tuple[int, ...]
    """Real length of each sequence of the row."""
    cp_size: int
    rank: int
    owners: Tuple[int, ...] = ()
    """Per sequence: the CP rank that holds it whole, or -1 for zigzag-split; () = all split."""
    multiple: int = 1
    """Every local row is a multiple of this (TP under sequence parallelism) and even."""

    def __post_init__(self) -> None:
        if self.cp_size < 1 or not 0 <= self.rank < self.cp_size:
            raise ValueError(f"CP rank {self.rank} of {self.cp_size}: need 0 <= rank < size")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"every sequence of a CP row needs >= 1 token, got {self.lengths}")
        if self.multiple < 1:
            raise ValueError(f"row multiple {self.multiple}: need >= 1")
        if self.owners and (len(self.owners) != len(self.lengths)
                            or not all(-1 <= o < self.cp_size for o in self.owners)):
            raise ValueError(f"owners {self.owners}: one per sequence, each -1 (split) or a CP "
                             f"rank < {self.cp_size}")

    def owner(self, sequence: int) -> int:
        return self.owners[sequence] if self.owners else -1

    @property
    def split(self) -> bool:
        """Whether some sequence is zigzag-split (its K/V must be all-gathered)."""
        return not self.owners or -1 in self.owners

    @property
    def padded(self) -> Tuple[int, ...]:
        """Each sequence's length padded at its end: with u = lcm(2, multiple), a split one to
        a multiple of CP*u (2*CP at multiple 1, as Megatron pads), a whole one to a multiple of
        u. Every local row is then a multiple of u: even, as Megatron's RoPE table sharding
        (`get_pos_emb_on_this_cp_rank`, run before the reuse hook replaces the table) needs,
        and a multiple of TP for sequence parallelism."""
        u = math.lcm(2, self.multiple)
        return tuple(-(-n // m) * m for n, m in zip(
            self.lengths, (self.cp_size * u if self.owner(i) < 0 else u
                           for i in range(len(self.lengths)))))

    @property
    def starts(self) -> Tuple[int, ...]:
        """Start of each sequence in the padded full row."""
        out, at = [], 0
        for p in self.padded:
            out.append(at)
            at += p
        return tuple(out)

    @property
    def full_len(self) -> int:
        return sum(self.padded)

    @property
    def local_len(self) -> int:
        return sum(b - a for _, a, b in self.chunks(self.rank))

    def chunks(self, rank: int) -> List[Tuple[int, int, int]]:
        """(sequence, start, end) in sequence coordinates of `rank`'s pieces, in local order."""
        out = []
        for i, p in enumerate(self.padded):
            owner = self.owner(i)
            if owner == rank:
                out.append((i, 0, p))
            elif owner < 0:
                c = p // (2 * self.cp_size)
                for j in (rank, 2 * self.cp_size - 1 - rank):
                    out.append((i, j * c, (j + 1) * c))
        return out

    def local_len_of(self, rank: int) -> int:
        return sum(b - a for _, a, b in self.chunks(rank))

    def all_index(self) -> torch.Tensor:
        """Rank-major index of every rank's whole local row, each padded to the longest one
        with `full_len` (a zero row appended to the full row): the layout of the all-gather of
        packed prefix rows ([Note: packed CP prefix rows])."""
        width = max(self.local_len_of(r) for r in range(self.cp_size))
        parts = []
        for r in range(self.cp_size):
            index = self.local_index(r)
            parts += [index, torch.full((width - index.numel(),), self.full_len)]
        return torch.cat(parts)

    def local_index(self, rank: int = None) -> torch.Tensor:
        """Indices into the padded full row of `rank`'s local row (default: this rank)."""
        rank = self.rank if rank is None else rank
        return self._index(self.chunks(rank))

    def _index(self, pieces) -> torch.Tensor:
        starts = self.starts
        return torch.cat([torch.arange(starts[i] + a, starts[i] + b) for i, a, b in pieces]
                         or [torch.zeros(0, dtype=torch.long)])

    def split_rows(self) -> torch.Tensor:
        """Positions in this rank's local row of its split sequences' pieces (what the
        all-gather sends; every rank sends as many)."""
        at, rows = 0, []
        for i, a, b in self.chunks(self.rank):
            if self.owner(i) < 0:
                rows.append(torch.arange(at, at + b - a))
            at += b - a
        return torch.cat(rows or [torch.zeros(0, dtype=torch.long)])

    def gather_index(self) -> torch.Tensor:
        """Full-row index of each row of the rank-major concatenation of all ranks' split
        pieces (all of every local row when every sequence is split)."""
        return torch.cat([self._index([c for c in self.chunks(r) if self.owner(c[0]) < 0])
                          for r in range(self.cp_size)])

    def ranked_real_index(self, every_row: bool = False) -> torch.Tensor:
        """Row of each real token (in row order) in the rank-major concatenation of all ranks'
        local rows (every sequence split: the order a reduce-scatter cuts); `every_row`: of
        every rank's whole local row padded to the longest (`all_index`, packed prefix rows)."""
        if self.owners and not every_row:
            raise ValueError("ranked_real_index needs every sequence zigzag-split (no owners)")
        order = self.all_index() if every_row else self.gather_index()
        ranked = torch.empty(self.full_len + 1, dtype=torch.long)
        ranked[order] = torch.arange(order.numel())  # all_index's padding: the extra entry
        return ranked[self.real_index()]

    def ranked_padding_index(self, every_row: bool = False) -> torch.Tensor:
        """Rows of the padding tokens in that concatenation."""
        size = self.all_index().numel() if every_row else self.full_len
        real = torch.zeros(size, dtype=torch.bool)
        real[self.ranked_real_index(every_row)] = True
        return (~real).nonzero().flatten()

    def real_index(self) -> torch.Tensor:
        """Indices of the real (non-padding) tokens in the padded full row, in row order."""
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths)])

    def shard(self, row: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's local row of an unpadded 1-D `row` (sum(lengths) entries), padding with
        `fill`."""
        if row.dim() != 1 or row.numel() != sum(self.lengths):
            raise ValueError(f"a CP row needs {sum(self.lengths)} entries, got {tuple(row.shape)}")
        full = row.new_full((self.full_len,), fill)
        full[self.real_index()] = row
        return full[self.local_index()]

    def positions(self, offsets: Sequence[int]) -> torch.Tensor:
        """Local position ids: sequence i's token t is at offsets[i] + t; its padding repeats
        the last real position (no real token sees padding, and no position passes the real
        ones: a learned position table need not be longer)."""
        full = torch.cat([o + torch.arange(p).clamp(max=n - 1)
                          for o, p, n in zip(offsets, self.padded, self.lengths)])
        return full[self.local_index()]


def balance_owners(lengths: Sequence[int], cached: Sequence[int], cp_size: int,
                   tolerance: float = BALANCE_TOLERANCE) -> Tuple[int, ...]:
    """Owners for ZigzagLayout ([Note: whole suffixes per CP rank]): whole sequences, largest
    first onto the least-loaded rank, after zigzag-splitting the k longest for the smallest k
    that leaves every rank >= 1 token and tokens and attention pairs (n*cached + n*(n+1)/2)
    each within (1 + tolerance) x their mean. k = all is Megatron's zigzag (always balanced).
    Deterministic: every rank computes the same owners."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    work = [(lengths[i], lengths[i] * cached[i] + lengths[i] * (lengths[i] + 1) // 2)
            for i in range(n)]
    total = [sum(w[j] for w in work) for j in range(2)]
    for k in range(n):
        owners = [-1] * n
        loads = [[0.0, 0.0] for _ in range(cp_size)]
        for i in order[:k]:
            for load in loads:
                load[0] += work[i][0] / cp_size
                load[1] += work[i][1] / cp_size
        for i in order[k:]:
            r = min(range(cp_size), key=lambda r: (loads[r][0], loads[r][1], r))
            owners[i] = r
            loads[r][0] += work[i][0]
            loads[r][1] += work[i][1]
        if all(any(o == r for o in owners) or k for r in range(cp_size)) and all(
                max(load[j] for load in loads) <= (1 + tolerance) * total[j] / cp_size
                for j in range(2)):
            return tuple(owners)
    return ()


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
