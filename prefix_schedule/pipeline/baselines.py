"""Costs for the dry run and the dense baselines the reuse plan is compared with.

`build_dense_1f1b` is Megatron's 1F1B, `build_dense_interleaved` Megatron's interleaved 1F1B
(virtual stages; [Note: Megatron's interleaved order] in orders.py): the same trajectories run
dense, every row recomputing its prompt. `compare_with_dense` lowers both with the same pass and
simulates both under the same p2p model (NCCL by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from prefix_schedule.pipeline.generate import build_schedule
from prefix_schedule.pipeline.ir import Action, ActionKind, Schedule, check_count
from prefix_schedule.pipeline.lowering import lower
from prefix_schedule.pipeline.orders import check_megatron_interleaving, interleaved_order
from prefix_schedule.pipeline.simulate import SimResult, simulate

__all__ = ["Comparison", "TokenCostModel", "build_dense_1f1b", "build_dense_interleaved",
           "compare_with_dense"]


@dataclass(frozen=True, kw_only=True)
class TokenCostModel:
    """Costs and memory proportional to tokens, for the reuse plan and its dense baseline.
    With virtual stages every action runs 1/V of the layers; the costs here are per action, so
    only their ratios matter (both plans use the same model)."""

    prefix_tokens: Mapping[int, int]
    """Cached prefix tokens of each group that has one."""
    microbatch_rows: Sequence[Mapping[int, int]]
    """Per suffix microbatch: trajectory rows of each group it holds."""
    suffix_tokens: Sequence[int]
    """Tokens of each suffix microbatch (its packed rows)."""
    backward_ratio: float = 2.0
    """Backward cost / forward cost."""
    kv_units_per_token: float = 1.0
    """Memory of a prefix token's cached K/V plus gK/gV buffer, in token-activation units."""
    unit_tokens: Optional[Mapping[int, int]] = None
    """Tokens of each prefix unit (PF/PB index) when prefixes are chunked ([Note: prefix chunks]
    in units.py); None: PF/PB indices are groups and cost their whole `prefix_tokens`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_tokens", dict(self.prefix_tokens))
        if self.unit_tokens is not None:
            object.__setattr__(self, "unit_tokens", dict(self.unit_tokens))
            if sum(self.unit_tokens.values()) != sum(self.prefix_tokens.values()):
                raise ValueError(f"unit_tokens sum to {sum(self.unit_tokens.values())} but "
                                 f"prefix_tokens to {sum(self.prefix_tokens.values())}; the chunks "
                                 "of every group must add up to its prefix")
        object.__setattr__(self, "microbatch_rows", tuple(dict(r) for r in self.microbatch_rows))
        object.__setattr__(self, "suffix_tokens", tuple(self.suffix_tokens))
        if len(self.microbatch_rows) != len(self.suffix_tokens):
            raise ValueError(f"{len(self.microbatch_rows)} microbatch_rows entries but "
                             f"{len(self.suffix_tokens)} suffix_tokens; give one per microbatch")
        counts = [*self.prefix_tokens.values(), *self.suffix_tokens,
                  *(self.unit_tokens or {}).values()]
        if any(c <= 0 for c in counts) or self.backward_ratio <= 0 or self.kv_units_per_token < 0:
            raise ValueError("token counts and backward_ratio must be > 0, kv_units_per_token >= 0")

    def cost(self, action: Action) -> float:
        """Reuse plan: PF/PB scale with the prefix, SF/SB with the suffix microbatch."""
        return self._scaled(action, self._tokens(action))

    def memory(self, action: Action) -> float:
        if action.kind is ActionKind.PREFIX_FORWARD:
            return self._tokens(action) * (1.0 + self.kv_units_per_token)
        return float(self.suffix_tokens[action.index]) if action.kind.is_compute else 0.0

    def dense_tokens(self, m: int) -> float:
        """Microbatch m run dense: every row also carries its group's prefix."""
        extra = sum(n * self.prefix_tokens.get(g, 0) for g, n in self.microbatch_rows[m].items())
        return float(self.suffix_tokens[m] + extra)

    def dense_cost(self, action: Action) -> float:
        return self._scaled(action, self.dense_tokens(action.index))

    def dense_memory(self, action: Action) -> float:
        is_sf = action.kind is ActionKind.SUFFIX_FORWARD
        return self.dense_tokens(action.index) if is_sf else 0.0

    def _tokens(self, action: Action) -> float:
        if action.kind.compute in (ActionKind.PREFIX_FORWARD, ActionKind.PREFIX_BACKWARD):
            per_unit = self.prefix_tokens if self.unit_tokens is None else self.unit_tokens
            return float(per_unit[action.index])
        return float(self.suffix_tokens[action.index])

    def _scaled(self, action: Action, tokens: float) -> float:
        if not action.kind.is_compute:
            return 0.0
        return tokens if action.kind.is_forward else tokens * self.backward_ratio


def build_dense_1f1b(*, num_stages: int, num_microbatches: int) -> Schedule:
    """Plain 1F1B over `num_microbatches` dense microbatches (no prefix work): the baseline."""
    return build_schedule(num_stages=num_stages, microbatch_groups=[()] * num_microbatches,
                          prefix_groups=())


def build_dense_interleaved(*, num_ranks: int, num_model_chunks: int, num_microbatches: int,
                            microbatch_group_size: Optional[int] = None) -> Schedule:
    """Megatron's interleaved 1F1B over dense microbatches, in its exact per-rank order;
    ValueError for the microbatch counts Megatron 0.19.2 refuses (orders.py)."""
    check_count("num_ranks", num_ranks, 2)
    check_count("num_model_chunks", num_model_chunks, 2)
    group = check_megatron_interleaving(num_ranks, num_microbatches, microbatch_group_size)
    rows = []
    for r in range(num_ranks):
        order = interleaved_order(r, num_ranks, num_model_chunks, num_microbatches, group)
        rows.append([Action(stage=s, kind=kind, index=m) for kind, m, s in order.actions()])
    return Schedule(num_stages=num_ranks * num_model_chunks, actions=rows,
                    num_model_chunks=num_model_chunks)


def dense_baseline(schedule: Schedule, num_microbatches: int) -> Schedule:
    """The dense plan on `schedule`'s layout: 1F1B, or interleaved with model chunks."""
    if schedule.num_model_chunks == 1:
        return build_dense_1f1b(num_stages=schedule.num_stages, num_microbatches=num_microbatches)
    return build_dense_interleaved(num_ranks=schedule.num_ranks,
                                   num_model_chunks=schedule.num_model_chunks,
                                   num_microbatches=num_microbatches)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """The reuse plan and the dense baseline, simulated on the same trajectories."""

    plan: SimResult
    """The prefix-reuse plan."""
    dense: SimResult
    """Dense (interleaved) 1F1B: same microbatches, every row recomputing its prefix (unit
    costs: same costs)."""


def compare_with_dense(schedule: Schedule, *, num_microbatches: int,
                       costs: Optional[TokenCostModel] = None, p2p: str = "nccl") -> Comparison:
    """Lower and simulate `schedule` (compute-only) and the dense baseline of the same
    microbatches on the same layout, both under `p2p` (simulate's modes).

    With `costs=None` both use `unit_cost`/`unit_memory` (the dense microbatches then cost as
    much as the suffix ones: a pure bubble comparison); with a TokenCostModel the dense
    microbatches pay for the recomputed prefixes."""
    dense = dense_baseline(schedule, num_microbatches)
    if costs is None:
        return Comparison(plan=simulate(lower(schedule), p2p=p2p),
                          dense=simulate(lower(dense), p2p=p2p))
    return Comparison(
        plan=simulate(lower(schedule, cost=costs.cost), cost=costs.cost, memory=costs.memory,
                      p2p=p2p),
        dense=simulate(lower(dense, cost=costs.dense_cost), cost=costs.dense_cost,
                       memory=costs.dense_memory, p2p=p2p))
