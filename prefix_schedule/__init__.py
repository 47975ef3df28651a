"""Megatron-free core of prefix reuse: data, planner, schedule, cache, attention, losses, FLOPs.

Nothing in this package imports Megatron (megatron_patches/ does).
"""

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.losses import PolicyLossConfig, grpo_advantages
from prefix_schedule.planning.planner import StepPlan, plan_microbatches
from prefix_schedule.runtime.step import ReuseStep

__all__ = [
    "Group",
    "GroupBatch",
    "Trajectory",
    "PolicyLossConfig",
    "grpo_advantages",
    "StepPlan",
    "plan_microbatches",
    "ReuseStep",
]
