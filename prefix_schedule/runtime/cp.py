"""Context parallelism (CP) of a reuse step: zigzag row layouts and the CP group's collectives.

[Note: zigzag CP layout]
As Megatron shards a packed (THD) row for CP: every sequence of the row is padded at its end to
a multiple of 2*CP and cut into 2*CP equal chunks; rank r holds chunks r and 2*CP-1-r of every
sequence, in that order, sequence after sequence (TE's `thd_get_partitioned_indices`). Causal
work is then balanced. Padding tokens sit at the end of their sequence: causal attention hides
them from every real token, they carry no loss, and the prefix cache never exposes them
(`real_index`), so they change nothing and receive exactly zero gradient.
Phase A runs each prefix unit as one such sequence, Phase B each suffix microbatch as its
packed sequences: each phase has its own balance. Only K/V (forward, all-gather) and their
gradients (backward, reduce-scatter) cross the CP group; never activations.

Megatron-free: the group is a torch.distributed process group.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["ZigzagLayout", "CPGroup", "CPRow"]


@dataclasses.dataclass(frozen=True)
class ZigzagLayout:
    """The zigzag CP layout of one packed row ([Note: zigzag CP layout]); host ints only."""

    lengths: Tuple[int, ...]
    """Real length of each sequence of the row."""
    cp_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.cp_size < 1 or not 0 <= self.rank < self.cp_size:
            raise ValueError(f"CP rank {self.rank} of {self.cp_size}: need 0 <= rank < size")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"every sequence of a CP row needs >= 1 token, got {self.lengths}")

    @property
    def padded(self) -> Tuple[int, ...]:
        """Each sequence's length padded to a multiple of 2*CP."""
        m = 2 * self.cp_size
        return tuple(-(-n // m) * m for n in self.lengths)

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
        return self.full_len // self.cp_size

    def chunks(self, rank: int) -> List[Tuple[int, int, int]]:
        """(sequence, start, end) in sequence coordinates of `rank`'s pieces, in local order."""
        out = []
        for i, p in enumerate(self.padded):
            c = p // (2 * self.cp_size)
            for j in (rank, 2 * self.cp_size - 1 - rank):
                out.append((i, j * c, (j + 1) * c))
        return out

    def local_index(self, rank: int = None) -> torch.Tensor:
        """Indices into the padded full row of `rank`'s local row (default: this rank)."""
        rank = self.rank if rank is None else rank
        starts = self.starts
        return torch.cat([torch.arange(starts[i] + a, starts[i] + b)
                          for i, a, b in self.chunks(rank)])

    def gather_index(self) -> torch.Tensor:
        """Full-row index of each row of the rank-major concatenation of all local rows."""
        return torch.cat([self.local_index(r) for r in range(self.cp_size)])

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


class CPGroup:
    """The CP process group of this rank, its collectives and the bytes they move.

    Byte counts are per rank, as a ring moves them: an all-gather or a reduce-scatter of a
    full tensor of N bytes sends (CP-1)/CP * N (what NCCL's ring sends per rank); recorded per
    phase ("A", "B", "C") and collective: keys like "B.all_gather", "C.reduce_scatter".
    """

    def __init__(self, group, *, size: int = None, rank: int = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        self.traffic: Dict[str, int] = {}
        self._indices: Dict[tuple, torch.Tensor] = {}

    def index(self, layout: ZigzagLayout, kind: str, device) -> torch.Tensor:
        """layout's "local", "gather" or "real" index on `device`, built and copied once per
        (layout, device) for the group's lifetime (a step): no host work or pageable
        host-to-device copy per layer."""
        key = (layout, kind, str(device))
        if key not in self._indices:
            build = {"local": layout.local_index, "gather": layout.gather_index,
                     "real": layout.real_index}[kind]
            self._indices[key] = build().to(device)
        return self._indices[key]

    def layout(self, lengths: Sequence[int]) -> ZigzagLayout:
        return ZigzagLayout(tuple(int(n) for n in lengths), self.size, self.rank)

    def _count(self, phase: str, nbytes: int) -> None:
        self.traffic[phase] = self.traffic.get(phase, 0) + nbytes * (self.size - 1) // self.size

    def all_gather_rows(self, x: torch.Tensor, layout: ZigzagLayout, phase: str,
                        backward_phase: str) -> torch.Tensor:
        """The padded full row [full_len, ...] from every rank's local `x` [local_len, ...],
        differentiable: its backward (counted under `backward_phase`: Phase A's runs in Phase C)
        reduce-scatters the gradient back to the local rows."""
        return _GatherRows.apply(x, layout, self, phase, backward_phase)

    def reduce_scatter_rows(self, fulls: List[torch.Tensor], layout: ZigzagLayout,
                            phase: str) -> List[torch.Tensor]:
        """Sum of every rank's full-row tensors [full_len, ...], each cut to this rank's local
        rows: one collective for the whole list (fp32 in, fp32 out)."""
        flat = torch.cat([f.reshape(f.shape[0], -1) for f in fulls], dim=1)
        local = self._reduce_scatter(flat, layout, phase)
        out, at = [], 0
        for f in fulls:
            width = f[0].numel()
            out.append(local[:, at:at + width].reshape(layout.local_len, *f.shape[1:]))
            at += width
        return out

    # ---- the two collectives (rank-major local rows)
    def _all_gather(self, x: torch.Tensor, layout: ZigzagLayout, phase: str) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self._count(phase + ".all_gather", x.numel() * x.element_size() * self.size)
        full = x.new_empty((layout.full_len, *x.shape[1:]))
        full[self.index(layout, "gather", x.device)] = torch.cat(parts)
        return full

    def _reduce_scatter(self, full: torch.Tensor, layout: ZigzagLayout,
                        phase: str) -> torch.Tensor:
        ranked = full[self.index(layout, "gather", full.device)].contiguous()  # rank-major
        self._count(phase + ".reduce_scatter", ranked.numel() * ranked.element_size())
        if dist.get_backend(self.group) == "nccl":
            out = ranked.new_empty((layout.local_len, *ranked.shape[1:]))
            dist.reduce_scatter_tensor(out, ranked, group=self.group)
            return out
        dist.all_reduce(ranked, group=self.group)  # gloo has no reduce-scatter
        return ranked[self.rank * layout.local_len:(self.rank + 1) * layout.local_len].clone()


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
