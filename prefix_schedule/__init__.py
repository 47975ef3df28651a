"""Megatron-free core of prefix reuse: data, planner, schedule, cache, attention, losses, FLOPs.

Nothing in this package imports Megatron (megatron_patches/ does).
"""

from prefix_schedule.planning.data import ContextLoss, Group, GroupBatch, PrefixNode, Trajectory
from prefix_schedule.planning.detect import FlatTrajectory, detect_prefix_trees
from prefix_schedule.planning.auto import TrajectoryPlan, plan_trajectories
from prefix_schedule.losses import PolicyLossConfig, grpo_advantages
from prefix_schedule.planning.planner import StepPlan, plan_microbatches
from prefix_schedule.runtime.step import ReuseStep

__all__ = [
    "Group",
    "GroupBatch",
    "Trajectory",
    "PrefixNode",
    "ContextLoss",
    "FlatTrajectory",
    "detect_prefix_trees",
    "TrajectoryPlan",
    "plan_trajectories",
    "PolicyLossConfig",
    "grpo_advantages",
    "StepPlan",
    "plan_microbatches",
    "ReuseStep",
]
