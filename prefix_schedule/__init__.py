"""Megatron-free core of prefix reuse: data, planner, schedule, cache, attention, losses, FLOPs.

Nothing in this package imports Megatron (megatron_patches/ does).
"""

from prefix_schedule.data import Group, GroupBatch, Trajectory
from prefix_schedule.losses import PolicyLossConfig, grpo_advantages
from prefix_schedule.planner import StepPlan, plan_microbatches
from prefix_schedule.step import ReuseStep

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
