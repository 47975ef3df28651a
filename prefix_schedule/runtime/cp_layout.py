"""Context-parallel row layouts of a reuse step: which rows of a packed row each CP rank holds.

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

Pure index arithmetic (no collectives): prefix_schedule/runtime/cp.py runs the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

import torch

__all__ = ["BALANCE_TOLERANCE", "ZigzagLayout", "balance_owners"]

BALANCE_TOLERANCE = 0.05
"""Largest CP rank load (tokens, attention pairs) over the mean that whole suffixes may leave."""

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
