"""From flat trajectories to a reuse plan and a report: the user-facing entry for prefix trees.

`plan_trajectories(trajectories, dims=..., max_seq_len=...)` detects the shared prefixes
([Note: detecting prefix trees] in detect.py), lets the FLOP policy (policy.py) decide which
groups use the cache and which run dense, plans the microbatches and reports, before anything
runs, what was shared and the expected (FLOP-ideal) speedup. `ReuseStep(result.batch,
result.plan, ...)` runs it; every plan is exact like any plan (tests/test_auto.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefix_schedule.planning.detect import (DEFAULT_MIN_SHARED_LEN, DEFAULT_NODE_OVERHEAD_TOKENS,
                                             Detection, detect_prefix_trees)
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, dense_flops, reuse_flops
from prefix_schedule.planning.planner import StepPlan
from prefix_schedule.planning.policy import DEFAULT_MIN_GAIN, PolicyPlan, ReusePolicy, plan_with_policy

__all__ = ["TrajectoryPlan", "plan_trajectories"]


@dataclass(frozen=True)
class TrajectoryPlan:
    """What `plan_trajectories` decided, and why."""

    detection: Detection
    """The groups found (prefix trees) and the input index of every trajectory."""
    policy: PolicyPlan
    """The plan and the per-group reuse / dense decisions."""
    dense_flops: float
    """Forward + backward FLOPs of stock dense training on the trajectories."""
    reuse_flops: float
    """The same for the plan (flops.py)."""

    @property
    def batch(self) -> GroupBatch:
        return self.detection.batch

    @property
    def plan(self) -> StepPlan:
        return self.policy.plan

    @property
    def ideal_speedup(self) -> float:
        """dense / reuse FLOPs: the speedup if every FLOP cost the same time."""
        return self.dense_flops / self.reuse_flops

    def describe(self) -> str:
        """The report: groups, trees, what is shared, what runs dense, expected speedup."""
        return "\n".join([self.detection.describe(), self.policy.describe(),
                          f"expected speedup (FLOP-ideal): {self.ideal_speedup:.2f}x "
                          f"({self.dense_flops:.3g} dense / {self.reuse_flops:.3g} reuse FLOPs)"])


def plan_trajectories(trajectories, *, dims: ModelDims, max_seq_len: int,
                      token_budget: Optional[int] = None,
                      min_shared_len: int = DEFAULT_MIN_SHARED_LEN,
                      node_overhead_tokens: int = DEFAULT_NODE_OVERHEAD_TOKENS,
                      min_gain: float = DEFAULT_MIN_GAIN, cache_loss_tokens: bool = True,
                      prefix_chunk_tokens: Optional[int] = None, row_multiple: int = 1,
                      vocab_size: Optional[int] = None) -> TrajectoryPlan:
    """Detect, decide and plan (module docstring). `trajectories`: detect.FlatTrajectory list;
    the other arguments are those of detect_prefix_trees, ReusePolicy and plan_microbatches.
    ValueError on bad input, before any compute."""
    detection = detect_prefix_trees(trajectories, min_shared_len=min_shared_len,
                                    node_overhead_tokens=node_overhead_tokens,
                                    cache_loss_tokens=cache_loss_tokens)
    policy = ReusePolicy(dims=dims, min_gain=min_gain, token_budget=token_budget)
    planned = plan_with_policy(detection.batch, policy=policy, max_seq_len=max_seq_len,
                               row_multiple=row_multiple, prefix_chunk_tokens=prefix_chunk_tokens,
                               vocab_size=vocab_size)
    batch = detection.batch
    dense = dense_flops(dims, [g.context_len(t) - 1 + tr.num_tokens for g in batch.groups
                               for t, tr in enumerate(g.trajectories)])
    return TrajectoryPlan(detection=detection, policy=planned, dense_flops=dense,
                          reuse_flops=reuse_flops(dims, planned.plan))
