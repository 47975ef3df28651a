"""A step's work on one data-parallel rank: the batch, the reuse plan, the dense rows, memory."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model import (ActivationModel, dense_peak_bytes,
                                                   reuse_phase_peaks)
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.planning.policy import ReusePolicy, plan_with_policy
from prefix_schedule.predict.roofline import Layout

__all__ = ["GIB", "dense_rows", "memory_per_rank", "parse_dims", "plan_for", "rank_share",
           "synthetic_batch"]

GIB = 1024 ** 3


def parse_dims(text: str) -> ModelDims:
    """`LAYERSxHIDDENxFFNxHEADSxKV_HEADSxVOCAB` (the sweep CSV's `model` column), SwiGLU."""
    parts = text.split("x")
    if len(parts) != 6 or not all(p.isdigit() for p in parts):
        raise ValueError(f"model {text!r}: give LAYERSxHIDDENxFFNxHEADSxKV_HEADSxVOCAB, e.g. "
                         "4x256x688x8x2x2048")
    L, h, f, a, g, v = map(int, parts)
    return ModelDims(num_layers=L, hidden_size=h, ffn_hidden_size=f, num_attention_heads=a,
                     num_query_groups=g, vocab_size=v, gated_linear_unit=True)


def synthetic_batch(*, prefix_len: int, suffix_len: int, group_size: int,
                    num_groups: int) -> GroupBatch:
    """num_groups groups of group_size trajectories: prefix_len shared, suffix_len each."""
    for name, value, low in (("prefix_len", prefix_len, 1), ("suffix_len", suffix_len, 1),
                             ("group_size", group_size, 1), ("num_groups", num_groups, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}; give an int >= {low}")
    return GroupBatch(groups=[
        Group(prefix=torch.zeros(prefix_len, dtype=torch.int64),
              trajectories=[Trajectory(suffix=torch.zeros(suffix_len, dtype=torch.int64),
                                       advantages=0.0) for _ in range(group_size)])
        for _ in range(num_groups)])


def rank_share(batch: GroupBatch, dp: int) -> GroupBatch:
    """The groups of the busiest DP rank (groups dealt round-robin, the longest first)."""
    if len(batch.groups) <= 1 or dp == 1:
        return batch
    order = sorted(range(len(batch.groups)), key=lambda g: -_group_tokens(batch.groups[g]))
    share = [batch.groups[g] for i, g in enumerate(order) if i % dp == 0]
    return GroupBatch(groups=share)


def _group_tokens(group: Group) -> int:
    return sum(group.context_len(t) + tr.num_tokens for t, tr in enumerate(group.trajectories))


def plan_for(batch: GroupBatch, dims: ModelDims, *, policy: bool = True,
             token_budget: Optional[int] = None, row_multiple: int = 1):
    """The reuse plan: the FLOP-model policy's (planning/policy.py), or without the policy one
    group's suffixes per microbatch (`token_budget` None) or the given budget."""
    max_len = max(g.context_len(t) + tr.num_tokens for g in batch.groups
                  for t, tr in enumerate(g.trajectories))
    if policy:
        return plan_with_policy(batch, policy=ReusePolicy(dims=dims, token_budget=token_budget),
                                max_seq_len=max_len, row_multiple=row_multiple).plan
    budget = token_budget or max(sum(t.num_tokens for t in g.trajectories) for g in batch.groups)
    return plan_microbatches(batch, token_budget=budget, max_seq_len=max_len,
                             row_multiple=row_multiple)


def dense_rows(batch: GroupBatch, rows_per_microbatch: int = 1) -> list:
    """Full-row lengths (context + suffix - 1) per dense microbatch, `rows_per_microbatch` each."""
    if rows_per_microbatch < 1:
        raise ValueError(f"rows_per_microbatch={rows_per_microbatch}; give an int >= 1")
    rows = [g.context_len(t) - 1 + tr.num_tokens for g in batch.groups
            for t, tr in enumerate(g.trajectories)]
    return [rows[i:i + rows_per_microbatch] for i in range(0, len(rows), rows_per_microbatch)]


def memory_per_rank(dims: ModelDims, lay: Layout, plan, rows: Sequence[Sequence[int]], *,
                    static_bytes: float, act_bytes: int = 2, qk_norm: bool = False) -> dict:
    """Peak bytes per rank on the heaviest stage: static (weights, grads, optimizer shard) +
    activations (planning/memory_model.py; CP: dense rows / CP, the reuse cache whole)."""
    stage_layers = dims.num_layers // lay.pp
    first = ActivationModel(dims=dims, act_bytes=act_bytes, qk_norm=qk_norm, tp=lay.tp,
                            stage_layers=stage_layers, head=lay.pp == 1, in_flight=lay.pp)
    models = [first] + ([ActivationModel(dims=dims, act_bytes=act_bytes, qk_norm=qk_norm,
                                         tp=lay.tp, stage_layers=stage_layers, head=True)]
                        if lay.pp > 1 else [])
    tokens = [math.ceil(sum(r) / lay.cp) for r in rows]
    dense = max(dense_peak_bytes(m, tokens) for m in models)
    peaks = [reuse_phase_peaks(m, plan) for m in models]
    reuse = max(p["step"] for p in peaks) / lay.cp
    suffix = max(p["suffix"] for p in peaks) / lay.cp
    return {"static_gib": static_bytes / GIB, "dense_gib": (static_bytes + dense) / GIB,
            "reuse_gib": (static_bytes + reuse) / GIB,
            "dense_activations_gib": dense / GIB, "reuse_activations_gib": reuse / GIB,
            "reuse_suffix_phase_gib": suffix / GIB,
            "suffix_phase_reduction": 1 - suffix / dense if dense else 0.0}
