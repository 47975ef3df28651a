"""Data-parallel placement: assign whole groups to DP ranks, balancing their estimated cost.

A group placed whole on one rank runs its prefix once in the whole step; a group split over k
ranks runs its prefix once on each of them (k times), so groups are split only when they must be:
when there are more ranks than groups, or when one group alone costs more than `split_above` x the
mean per-rank cost and splitting it lowers the cost of the most loaded rank.

Cost of a piece (a group, or a subset of its trajectories) = what that piece costs when planned
alone with `planner.plan_microbatches`: `flops.reuse_flops` with model dims, else the tokens the
plan runs (cached prefix tokens once + every suffix row token). Pieces go to ranks by
longest-processing-time greedy (most expensive first, onto the least loaded rank; ties by index),
never two pieces of one group on one rank. Deterministic: every DP rank computes the same
placement from the same batch, so no communication is needed to agree on it.

Loss normalisation does not depend on the placement: with `calculate_per_token_loss=True`
Megatron's `finalize_model_grads` all-reduces the loss-token count over DP ranks (exactness.md,
"Loss normalisation").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefix_schedule.planning.data import Group, GroupBatch
from prefix_schedule.planning.flops import ModelDims, reuse_flops
from prefix_schedule.planning.planner import StepPlan, plan_microbatches
from prefix_schedule.planning.tree import subgroup

__all__ = ["GroupShare", "RankShard", "Placement", "place_groups"]


@dataclass(frozen=True, kw_only=True)
class GroupShare:
    """The trajectories of one batch group that run on one rank."""

    group: int
    """Index of the group in the global batch."""
    trajectories: tuple[int, ...]
    """Indices (in the group) of the trajectories on this rank, ascending, non-empty."""
    cost: float
    """Estimated cost of this share planned alone (same unit as Placement.cost_unit)."""

    def __post_init__(self) -> None:
        if self.group < 0 or not self.trajectories or list(self.trajectories) != sorted(set(self.trajectories)):
            raise ValueError(f"GroupShare(group={self.group}, trajectories={self.trajectories}): give a "
                             "group index >= 0 and distinct ascending trajectory indices")


@dataclass(frozen=True, kw_only=True)
class RankShard:
    """What one data-parallel rank runs in the step."""

    rank: int
    """Data-parallel rank."""
    batch: GroupBatch
    """This rank's groups in global group order: the batch's own Group object when placed whole,
    else a new Group with the same prefix and a subset of the same Trajectory objects."""
    shares: tuple[GroupShare, ...]
    """shares[i] says which global group (and which of its trajectories) is batch.groups[i]."""
    cost: float
    """Sum of the shares' estimated costs."""

    def __post_init__(self) -> None:
        if len(self.shares) != len(self.batch.groups):
            raise ValueError(f"rank {self.rank}: {len(self.shares)} shares for "
                             f"{len(self.batch.groups)} groups; give one share per group")

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens on this rank (the global normaliser is the sum over ranks)."""
        return self.batch.num_loss_tokens


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Per-rank batches of one step and how balanced they are."""

    ranks: tuple[RankShard, ...]
    """One shard per data-parallel rank, rank r at position r."""
    cost_unit: str
    """"flops" (flops.reuse_flops with model dims) or "tokens" (tokens run, no dims given)."""
    split_groups: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Global group index -> the ranks it is split over (only groups on more than one rank)."""

    def __post_init__(self) -> None:
        if [s.rank for s in self.ranks] != list(range(len(self.ranks))) or not self.ranks:
            raise ValueError("Placement.ranks must hold ranks 0, 1, ... in order")
        if self.cost_unit not in ("flops", "tokens"):
            raise ValueError(f"cost_unit={self.cost_unit!r}; use 'flops' or 'tokens'")

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens of the global batch (what finalize_model_grads divides by)."""
        return sum(r.num_loss_tokens for r in self.ranks)

    @property
    def imbalance(self) -> float:
        """Cost of the most loaded rank / mean cost per rank (1.0 = perfectly balanced)."""
        costs = [r.cost for r in self.ranks]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        """Per-rank cost and groups, the imbalance, and every split group."""
        total = sum(r.cost for r in self.ranks) or 1.0
        lines = [f"Placement over {self.dp_size} data-parallel ranks (cost in {self.cost_unit}), "
                 f"imbalance {self.imbalance:.3f} (max / mean rank cost)"]
        for shard in self.ranks:
            parts = [_share_label(s, self.split_groups) for s in shard.shares]
            lines.append(f"  rank {shard.rank}: cost {shard.cost:.4g} ({100 * shard.cost / total:.1f}%), "
                         f"{shard.num_loss_tokens} loss tokens: " + " ".join(parts))
        for group, ranks in sorted(self.split_groups.items()):
            lines.append(f"  group {group} split over ranks {','.join(map(str, ranks))}: "
                         "its prefix runs once per rank")
        return "\n".join(lines)


def _share_label(share: GroupShare, split_groups: dict[int, tuple[int, ...]]) -> str:
    if share.group not in split_groups:
        return f"g{share.group}"
    return f"g{share.group}[t{','.join(map(str, share.trajectories))}]"


class _Costs:
    """Cost of (group, trajectory subset) planned alone, memoised."""

    def __init__(self, batch: GroupBatch, dims: ModelDims | None, token_budget: int, max_seq_len: int,
                 row_multiple: int = 1):
        self._batch, self._dims = batch, dims
        self._budget, self._max_seq_len, self._row_multiple = token_budget, max_seq_len, row_multiple
        self._memo: dict[tuple[int, tuple[int, ...]], float] = {}

    def __call__(self, group: int, trajectories: tuple[int, ...]) -> float:
        key = (group, trajectories)
        if key not in self._memo:
            plan = plan_microbatches(GroupBatch(groups=[_subgroup(self._batch, group, trajectories)]),
                                     token_budget=self._budget, max_seq_len=self._max_seq_len,
                                     row_multiple=self._row_multiple)
            self._memo[key] = reuse_flops(self._dims, plan) if self._dims else float(_tokens_run(plan))
        return self._memo[key]


def _tokens_run(plan: StepPlan) -> int:
    return (sum(c.row_length for c in plan.prefix_units().values())
            + sum(mb.row_length for mb in plan.microbatches))


def _subgroup(batch: GroupBatch, group: int, trajectories: tuple[int, ...]) -> Group:
    source = batch.groups[group]
    if len(trajectories) == len(source.trajectories):
        return source
    if source.nodes:  # a prefix tree: only the nodes these trajectories read
        return subgroup(source, trajectories)
    return Group(prefix=source.prefix, trajectories=[source.trajectories[t] for t in trajectories])


def _chunks(lengths: list[int], k: int) -> list[tuple[int, ...]]:
    """k contiguous non-empty runs of indices (k <= len), cut where the running length passes
    i/k of the total, or earlier when the items left are just enough for one per remaining run."""
    total, cuts, cumulative = sum(lengths), [0], 0
    for j in range(len(lengths) - 1):
        cumulative += lengths[j]
        if len(cuts) == k:
            break
        items_left, runs_left = len(lengths) - (j + 1), k - len(cuts)
        if cumulative * k >= total * len(cuts) or items_left == runs_left:
            cuts.append(j + 1)
    cuts.append(len(lengths))
    return [tuple(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def _pieces(batch: GroupBatch, num_parts: list[int], costs: _Costs) -> list[GroupShare]:
    pieces = []
    for g, k in enumerate(num_parts):
        lengths = [t.num_tokens for t in batch.groups[g].trajectories]
        for part in _chunks(lengths, k):
            pieces.append(GroupShare(group=g, trajectories=part, cost=costs(g, part)))
    return pieces


def _assign(pieces: list[GroupShare], dp_size: int) -> list[list[GroupShare]]:
    """Longest-processing-time greedy; a rank never gets two pieces of one group."""
    ranks: list[list[GroupShare]] = [[] for _ in range(dp_size)]
    loads = [0.0] * dp_size
    for piece in sorted(pieces, key=lambda p: (-p.cost, p.group, p.trajectories)):
        free = [r for r in range(dp_size) if all(s.group != piece.group for s in ranks[r])]
        rank = min(free, key=lambda r: (loads[r], r))
        ranks[rank].append(piece)
        loads[rank] += piece.cost
    return ranks


def _makespan(ranks: list[list[GroupShare]]) -> float:
    return max(sum(p.cost for p in shares) for shares in ranks)


def _num_parts(batch: GroupBatch, dp_size: int, costs: _Costs, split_above: float) -> list[int]:
    sizes = [len(g.trajectories) for g in batch.groups]
    whole = [costs(g, tuple(range(n))) for g, n in enumerate(sizes)]
    parts = [1] * len(sizes)

    def per_part(g: int) -> float:
        return whole[g] / parts[g]

    def splittable(g: int) -> bool:
        return parts[g] < min(sizes[g], dp_size)

    while sum(parts) < dp_size:  # more ranks than pieces: every rank needs work
        g = max((g for g in range(len(sizes)) if splittable(g)), key=lambda g: (per_part(g), -g))
        parts[g] += 1
    mean = sum(whole) / dp_size
    best = _makespan(_assign(_pieces(batch, parts, costs), dp_size))
    while True:  # a group far above the mean: split it further while that lowers the makespan
        candidates = [g for g in range(len(sizes)) if splittable(g) and per_part(g) > split_above * mean]
        if not candidates:
            return parts
        g = max(candidates, key=lambda g: (per_part(g), -g))
        trial = parts[:g] + [parts[g] + 1] + parts[g + 1:]
        makespan = _makespan(_assign(_pieces(batch, trial, costs), dp_size))
        if makespan >= best:
            return parts
        parts, best = trial, makespan


def _check_args(batch, dp_size, dims, split_above) -> None:
    if not isinstance(batch, GroupBatch) or not batch.groups:
        raise ValueError("place_groups needs a non-empty GroupBatch; give at least one group")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size={dp_size!r}; give the data-parallel world size as an int >= 1")
    if dims is not None and not isinstance(dims, ModelDims):
        raise ValueError(f"dims must be a flops.ModelDims or None, got {type(dims).__name__}")
    if isinstance(split_above, bool) or not isinstance(split_above, (int, float)) or \
            not math.isfinite(split_above) or split_above <= 0:
        raise ValueError(f"split_above={split_above!r}; give a finite float > 0 (1.0: split a group "
                         "only when it alone costs more than a rank's mean share)")
    num_trajectories = sum(len(g.trajectories) for g in batch.groups)
    if num_trajectories < dp_size:
        raise ValueError(f"the batch has {num_trajectories} trajectories, fewer than dp_size={dp_size}: "
                         "some data-parallel rank would get no work; give more trajectories or use "
                         f"dp_size <= {num_trajectories}")


def place_groups(batch: GroupBatch, *, dp_size: int, dims: ModelDims | None = None,
                 token_budget: int, max_seq_len: int, split_above: float = 1.0,
                 row_multiple: int = 1) -> Placement:
    """Place the batch's groups on `dp_size` data-parallel ranks; see the module docstring.

    `token_budget` / `max_seq_len` / `row_multiple` are those each rank will plan its own batch
    with (row_multiple: the TP size under sequence parallelism, see planner.py). Raises
    ValueError (before any work) for dp_size < 1, an empty batch, fewer trajectories than ranks,
    or anything `plan_microbatches` refuses for this batch.
    """
    _check_args(batch, dp_size, dims, split_above)
    plan_microbatches(batch, token_budget=token_budget, max_seq_len=max_seq_len,  # errors name
                      row_multiple=row_multiple)                                 # global groups
    costs = _Costs(batch, dims, token_budget, max_seq_len, row_multiple)
    parts = _num_parts(batch, dp_size, costs, float(split_above))
    assigned = _assign(_pieces(batch, parts, costs), dp_size)
    shards = []
    for rank, pieces in enumerate(assigned):
        shares = tuple(sorted(pieces, key=lambda p: p.group))
        groups = [_subgroup(batch, s.group, s.trajectories) for s in shares]
        shards.append(RankShard(rank=rank, batch=GroupBatch(groups=groups), shares=shares,
                                cost=sum(s.cost for s in shares)))
    split = {g: tuple(r for r, pieces in enumerate(assigned) if any(p.group == g for p in pieces))
             for g, k in enumerate(parts) if k > 1}
    return Placement(ranks=tuple(shards), cost_unit="flops" if dims else "tokens", split_groups=split)
