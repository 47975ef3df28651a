"""Predicted step time of dense and of prefix reuse: roofline costs per action, played through
the lowered schedule by the NCCL dry run (pipeline/simulate.py).

Reuse runs the plan's schedule (pipeline/generate.py, as ReuseStep builds it); dense runs
Megatron's (interleaved) 1F1B over `dense_rows` -- one list of full-row lengths per
microbatch. Both are costed by roofline.py on the same device and layout, and both pay the same
step constant (data-parallel gradient reduce-scatter + parameter all-gather of the distributed
optimizer, and the optimizer update, by bytes; `optimizer=False` leaves it out, as the CPU
benchmarks time no optimizer). PP p2p time is added to the compute action that sends (the dry
run's p2p takes no time), so pipeline bubbles include it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Sequence, Tuple

from prefix_schedule.pipeline import ActionKind
from prefix_schedule.pipeline.baselines import dense_baseline
from prefix_schedule.pipeline.generate import build_schedule
from prefix_schedule.pipeline.lowering import lower
from prefix_schedule.pipeline.simulate import simulate
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.predict.devices import DeviceSpec
from prefix_schedule.predict.roofline import (Cost, Layout, collective_cost, embedding_cost,
                                              head_cost, layer_cost, memory_cost, p2p_cost,
                                              sum_costs)

__all__ = ["PathPrediction", "StepPrediction", "dense_costs", "params_per_rank", "predict_step",
           "reuse_costs", "step_constant"]

_PF, _SF, _SB, _PB = (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD,
                      ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD)
Key = Tuple[ActionKind, int, int]  # (kind, index, virtual stage)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PathPrediction:
    """One path's predicted step on one data-parallel rank."""

    step_s: float
    """Predicted seconds per step: the dry run's makespan + the step constant."""
    phases: Dict[str, float]
    """Compute seconds per action kind on the busiest rank (PF, SF, SB, PB; dense: SF, SB)."""
    bubble_fraction: float
    """Idle share of the pipeline ranks' time (SimResult.bubble_fraction)."""
    comm_share: float
    """Communication seconds on the busiest rank (TP/CP/EP/PP/DP) / step_s."""
    cost: Cost
    """Seconds per roofline category, summed over the busiest rank's actions and the constant."""

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "phases": self.phases, "bubble_fraction":
                self.bubble_fraction, "comm_share": self.comm_share, "cost": self.cost.as_dict()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPrediction:
    dense: PathPrediction
    reuse: PathPrediction

    @property
    def speedup(self) -> float:
        return self.dense.step_s / self.reuse.step_s


def _stage_layers(dims: ModelDims, lay: Layout) -> int:
    lay.check_model(dims)
    return dims.num_layers // (lay.pp * lay.vpp)


def _row_pass(dev, dims, lay, rows, stage, *, backward, prefix=False, cache_reads=0,
              calls=1, memo=None) -> Cost:
    """One action: a microbatch (or prefix unit) through one virtual stage's layers (`memo`:
    a dict caching equal actions: a step repeats the same row shapes many times)."""
    if memo is not None:
        key = (tuple(rows), stage, backward, prefix, cache_reads, calls)
        if key not in memo:
            memo[key] = _row_pass(dev, dims, lay, rows, stage, backward=backward, prefix=prefix,
                                  cache_reads=cache_reads, calls=calls)
        return memo[key]
    stages, layers = lay.pp * lay.vpp, _stage_layers(dims, lay)
    last = stage == stages - 1
    kv_only = 1 if prefix and last else 0
    whole = sum(length for length, _ in rows)
    split = prefix or not cache_reads  # suffixes of a reuse step stay whole per CP rank
    one = layer_cost(dev, dims, lay, rows, backward=backward, cp_split=split,
                     attention_calls=calls, cache_reads=cache_reads)
    cost = one.scaled((layers - kv_only) if split else (layers - kv_only) / lay.cp)
    if kv_only:
        cost = cost + layer_cost(dev, dims, lay, rows, backward=backward, kv_only=True,
                                 cp_split=True)
    tokens = whole / lay.cp
    if stage == 0:
        cost = cost + embedding_cost(dev, dims, tokens)
    if last and not prefix:
        cost = cost + head_cost(dev, dims, lay, tokens, backward=backward)
    sends = (not last) if not backward else stage > 0
    if sends and lay.pp > 1:
        span = lay.tp * lay.cp * lay.dp + 1
        cost = cost + p2p_cost(dev, tokens * dims.hidden_size * dev.dtype_bytes / lay.tp, span)
    return cost


def reuse_costs(dev: DeviceSpec, dims: ModelDims, lay: Layout, plan) -> Dict[Key, Cost]:
    """Roofline cost of every compute action of the plan's schedule, per virtual stage."""
    stages, out, memo = lay.pp * lay.vpp, {}, {}
    for unit, chunk in plan.prefix_units().items():
        rows = [(chunk.length + chunk.padding, chunk.start)]
        for s in range(stages):
            for kind, backward in ((_PF, False), (_PB, True)):
                out[kind, unit, s] = _row_pass(dev, dims, lay, rows, s, backward=backward,
                                               prefix=True, memo=memo)
    for mb in plan.microbatches:
        rows = [(seg.length, seg.cached_len) for seg in mb.segments]
        rows += [(mb.padding, 0)] if mb.padding else []
        reads = sum(seg.cached_len for seg in mb.segments)
        calls = 2 if reads else 1  # two-part attention: the cached part and the causal part
        for s in range(stages):
            for kind, backward in ((_SF, False), (_SB, True)):
                out[kind, mb.index, s] = _row_pass(dev, dims, lay, rows, s, backward=backward,
                                                   cache_reads=reads, calls=calls, memo=memo)
    return out


def dense_costs(dev: DeviceSpec, dims: ModelDims, lay: Layout,
                dense_rows: Sequence[Sequence[int]]) -> Dict[Key, Cost]:
    """Roofline cost of every dense microbatch (full rows, causal) per virtual stage."""
    out, memo = {}, {}
    for m, lengths in enumerate(dense_rows):
        rows = [(length, 0) for length in lengths]
        for s in range(lay.pp * lay.vpp):
            out[_SF, m, s] = _row_pass(dev, dims, lay, rows, s, backward=False, memo=memo)
            out[_SB, m, s] = _row_pass(dev, dims, lay, rows, s, backward=True, memo=memo)
    return out


def params_per_rank(dims: ModelDims, lay: Layout) -> float:
    """Parameters on one rank of the heaviest stage: its layers (experts / EP) + an embedding
    or output layer, / TP."""
    h, d = dims.hidden_size, dims.kv_channels
    q, kv = dims.num_attention_heads * d, dims.num_query_groups * d
    glu = 3 if dims.gated_linear_unit else 2
    layer = h * (q + 2 * kv) + q * h
    if dims.num_experts:
        layer += h * dims.num_experts + dims.num_experts / lay.ep * glu * h * dims.moe_ffn_hidden_size
    else:
        layer += glu * h * dims.ffn_hidden_size
    stage = dims.num_layers / lay.pp * layer + dims.vocab_size * h  # embedding or output layer
    return stage / lay.tp


def step_constant(dev: DeviceSpec, dims: ModelDims, lay: Layout) -> Cost:
    """Both paths' per-step cost: the distributed optimizer's fp32 gradient reduce-scatter and
    bf16 parameter all-gather over DP x CP, and the Adam update over its shard (memory-bound:
    ~30 bytes per parameter: fp32 grad, master weight and two moments read, three written,
    bf16 weight written)."""
    params, group = params_per_rank(dims, lay), lay.dp * lay.cp
    span = lay.tp * lay.cp * lay.dp
    comm = collective_cost(dev, params * 4, group, span) + collective_cost(dev, params * 2, group, span)
    return comm + memory_cost(dev, 30 * params / group, ops=10)


def _path(dev, dims, lay, schedule, costs: Dict[Key, Cost], constant: Cost) -> PathPrediction:
    totals = {key: cost.total for key, cost in costs.items()}

    def seconds(action) -> float:
        return totals.get((action.kind, action.index, action.stage), 0.0)

    result = simulate(lower(schedule, cost=seconds), cost=seconds)
    busiest = max(range(len(result.busy)), key=result.busy.__getitem__)
    mine = [costs[key] for key in costs if key[2] % lay.pp == busiest]
    phases: Dict[str, float] = {}
    for (kind, _, stage), cost in costs.items():
        if stage % lay.pp == busiest:
            phases[kind.value] = phases.get(kind.value, 0.0) + cost.total
    total = sum_costs(mine) + constant
    step = result.makespan + constant.total
    return PathPrediction(step_s=step, phases=phases, bubble_fraction=result.bubble_fraction,
                          comm_share=total.comm / step if step else 0.0, cost=total)


def predict_step(dev: DeviceSpec, dims: ModelDims, lay: Layout, plan,
                 dense_rows: Sequence[Sequence[int]], *, optimizer: bool = True) -> StepPrediction:
    """Dense and reuse step time on one DP rank: `plan` (a StepPlan of this rank's groups) and
    `dense_rows` (the same trajectories' full-row lengths, one list per dense microbatch)."""
    if not dense_rows or any(not rows for rows in dense_rows):
        raise ValueError("dense_rows: give at least one microbatch, each with at least one row")
    stages = lay.pp * lay.vpp
    units = plan.prefix_units()
    schedule = build_schedule(num_stages=stages, num_model_chunks=lay.vpp,
                              microbatch_groups=plan.microbatch_groups(),
                              prefix_groups=[w.group for w in plan.prefixes],
                              prefix_units={u: (c.group, c.chunk) for u, c in units.items()})
    constant = step_constant(dev, dims, lay) if optimizer else Cost()
    reuse = _path(dev, dims, lay, schedule, reuse_costs(dev, dims, lay, plan), constant)
    dense_schedule = dense_baseline(schedule, len(dense_rows))
    dense = _path(dev, dims, lay, dense_schedule, dense_costs(dev, dims, lay, dense_rows), constant)
    return StepPrediction(dense=dense, reuse=reuse)


