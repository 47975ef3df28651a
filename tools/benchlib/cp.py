"""tools/bench.py --cp N: prefix reuse at CP=N against stock dense on the same processes.

Stock Megatron runs dense CP only on Transformer Engine's attention, which this CPU machine
lacks (and TE's CP attention cannot serve reuse rows: docs/DESIGN.md "Context parallelism"). So
each rank of the pp*tp*cp processes:
1. builds the reuse model at CP=N, then at CP=1 -- the same processes now form N data-parallel
   replicas -- the stock (local spec) reference and the fused-SDPA dense model (Megatron DDP),
   and runs stock dense over the whole batch (the gradient reference);
2. times reuse at CP=N (its CPGroup counts the bytes every phase moves, per rank) and the
   fused dense step on this rank's share of the rows (place_groups) at CP=1 -- the dense layout
   stock Megatron can run on these processes -- step by step interleaved, Megatron
   re-initialised at each path's CP size before its step;
   and, as a third path, the same reuse at CP=1 on the dense path's shares (`cp_reference`:
   what CP itself costs at equal work per rank);
3. checks gradients: one more reuse step at CP=N against the stock dense reference.
`cp_traffic` gives reuse's measured bytes per phase and collective next to what dense CP
(K/V all-gather per layer per row in forward, reduce-scatter in backward, rows padded to
2*CP) would move for the same rows: the same ring accounting, computed from the dense rows.
"""
from __future__ import annotations

import statistics
from typing import Dict, List

import torch

from benchlib.config import BenchConfig
from benchlib.measure import (LOSS, _progress, _reduce_max, collective_tensor, config_batch,
                              config_plan, selected_backend)
from benchlib.models import model_shape
from benchlib.steps import dense_step, reuse_step
from benchlib.timing import RegionTimer
from prefix_schedule.runtime.cp import ZigzagLayout

__all__ = ["ParallelStates", "measure_cp", "dense_cp_traffic"]


class ParallelStates:
    """Megatron's parallel state at each CP size, initialised once per size: `use(cp)` makes it
    current again by restoring parallel_state's module globals (its groups, ranks, sizes).

    Re-initialising instead (destroy_model_parallel + initialize_model_parallel) forgets the old
    groups without destroying them and creates new ones, each with its gloo threads: re-initialising
    before every step grew each rank from ~550 to ~970 threads over 16 steps here and slowed
    later steps of both paths (up to 2-3x after 45 re-initialisations), so timings drifted with
    the step index."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._saved: Dict[int, dict] = {}

    def use(self, cp: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron_patches.models.tiny import initialize_distributed

        if cp not in self._saved:
            initialize_distributed(seed=self.config.seed, tp=self.config.tp, pp=self.config.pp,
                                   cp=cp)
            self._saved[cp] = {name: value for name, value in vars(ps).items()
                               if name.startswith("_") and name[1:2].isupper()}
        for name, value in self._saved[cp].items():
            setattr(ps, name, value)


def _time_interleaved(config: BenchConfig, states: ParallelStates,
                      paths) -> tuple[dict, dict]:
    """(wall, CPU) seconds per path and timed step; `paths`: name -> (cp, model, run). Steps
    alternate between the paths (reuse, dense, reuse, ...), each with Megatron's parallel state
    at the path's CP size current (`states`), so that machine noise hits both alike. Each model
    keeps the groups it was built with."""
    from megatron_patches.training import zero_grads

    times = {name: [] for name in paths}
    cpu = {name: [] for name in paths}
    with _progress(config) as progress:
        for step in range(config.warmup + config.steps):
            for name, (cp, model, run) in paths.items():
                states.use(cp)
                zero_grads(model)
                device = next(model.parameters()).device
                with RegionTimer(device) as timer:
                    run()
                seconds, cpu_seconds = _reduce_max(timer.seconds), _reduce_max(timer.cpu_seconds)
                if step >= config.warmup:
                    times[name].append(seconds)
                    cpu[name].append(cpu_seconds)
            progress.step("warm-up" if step < config.warmup else "timed")
    return times, cpu


def dense_cp_traffic(config: BenchConfig, batch, bytes_per_element: int = 4) -> Dict[str, int]:
    """Bytes per rank dense CP would move for `batch`'s rows (each padded to 2*CP): K and V of
    every layer all-gathered in forward and reduce-scattered in backward, ring accounting."""
    kv_heads = max(1, config.num_query_groups // config.tp)
    head_dim = config.hidden_size // config.num_attention_heads
    rows = [len(g.prefix) + len(t.suffix) - 1 for g in batch.groups for t in g.trajectories]
    full = sum(ZigzagLayout((n,), config.cp, 0).full_len for n in rows)
    per_direction = (2 * full * kv_heads * head_dim * bytes_per_element
                     * (config.num_layers // config.pp) * (config.cp - 1) // config.cp)
    return {"all_gather": per_direction, "reduce_scatter": per_direction}


def measure_cp(config: BenchConfig, distributed: bool = True) -> dict:
    """Each rank of the pp*tp*cp layout: steps 1-3 of the module docstring."""
    import megatron_patches

    megatron_patches.enable_cpu_support()
    from megatron.core import parallel_state as ps
    from megatron_patches.models.tiny import build_model
    from megatron_patches.training import (max_relative_diff, param_grads, prepare_for_training,
                                           zero_grads)
    from megatron_patches.training import dense_step as stock_dense_step
    from prefix_schedule.runtime.cp import CPGroup

    megatron_patches.install()
    batch = config_batch(config)
    plan = config_plan(config, batch)
    states = ParallelStates(config)
    states.use(config.cp)
    local = prepare_for_training(build_model(model_shape(config), seed=config.seed), ddp=False)
    param = next(local.parameters())
    backend = selected_backend(config, param.device, param.dtype)
    groups: List[CPGroup] = []

    def run_reuse():
        groups.append(CPGroup(ps.get_context_parallel_group()))
        return reuse_step(local, batch, plan, LOSS, cp_group=groups[-1])

    layout = {"pp": config.pp, "tp": config.tp, "dp": 1, "cp": config.cp}

    states.use(1)  # the same processes as DP = cp
    stock = prepare_for_training(build_model(model_shape(config), seed=config.seed), ddp=False)
    dense = stock_dense_step(stock, batch, LOSS)  # the reference: whole batch, CP=1
    reference = param_grads(stock)
    fused = build_model(model_shape(config), fused_attention=True, seed=config.seed)
    fused = prepare_for_training(fused, ddp=True)
    share = config.cp_dense_placement(batch)
    mine = share.ranks[ps.get_data_parallel_rank()].batch
    # the CP overhead at equal work: the same reuse on the dense path's shares, no CP
    reuse_dp = prepare_for_training(build_model(model_shape(config), seed=config.seed), ddp=True)
    plan_dp = config_plan(config, mine)
    times, cpu = _time_interleaved(config, states, {
        "reuse": (config.cp, local, run_reuse),
        "dense": (1, fused, lambda: dense_step(fused, mine, LOSS)),
        "reuse_cp1": (1, reuse_dp, lambda: reuse_step(reuse_dp, mine, plan_dp, LOSS))})
    states.use(config.cp)
    zero_grads(local)
    reuse = run_reuse()
    traffic = groups[-1].traffic
    check = {"loss_dense": dense.loss, "max_grad_rel_diff": _reduce_max(
        max_relative_diff(reference, param_grads(local)))}
    states.use(1)  # as _cp_loss reads
    check["loss_reuse"] = _cp_loss(reuse, config)
    reuse_cp1 = statistics.median(times["reuse_cp1"])
    return {"times": {"dense": times["dense"], "reuse": times["reuse"]},
            "cpu_times": {"dense": cpu["dense"], "reuse": cpu["reuse"]},
            "cp_reference": {
                "layout": f"reuse at CP=1 x DP={config.cp} on the dense path's shares (same "
                          "processes, same work per rank, no CP), timed interleaved",
                "reuse_cp1_seconds": reuse_cp1,
                "reuse_cp1_seconds_all": times["reuse_cp1"],
                "reuse_cp1_cpu_seconds": statistics.median(cpu["reuse_cp1"]),
                "cp_overhead": statistics.median(times["reuse"]) / reuse_cp1,
                "speedup_cp1": statistics.median(times["dense"]) / reuse_cp1},
            "attention_backend": backend, **check, "memory": None, "layout": layout,
            "timing_basis": RegionTimer(param.device).basis,
            "reuse_microbatch_tokens": [m.num_tokens for m in plan.microbatches],
            "dense_layout": f"CP=1 x DP={config.cp} on the same processes (Megatron DDP, "
                            "place_groups shares; stock dense CP needs Transformer Engine)",
            "cp_traffic": {"reuse_bytes_per_rank": traffic,
                           "dense_cp_bytes_per_rank_model": dense_cp_traffic(config, batch),
                           "basis": "bytes each rank sends per step, ring accounting: "
                                    "(CP-1)/CP x the full tensor per all-gather or "
                                    "reduce-scatter; fp32; reuse measured (A: Phase A K/V "
                                    "all-gather, B: suffix K/V, C: Phase C reduce-scatters), "
                                    "dense computed for the same rows"}}


def _cp_loss(result, config: BenchConfig) -> float:
    """Token-mean loss of the whole batch from the CP ranks' parts (the last stage's values),
    all-reduced over the world: ranks off the last stage or off TP rank 0 add nothing."""
    from megatron.core import parallel_state as ps

    totals = collective_tensor([0.0, 0.0])
    # the parallel state is CP=1 now; the reuse result was the last stage's, TP rank 0 counts
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        totals += collective_tensor([result.loss * result.num_tokens, float(result.num_tokens)])
    torch.distributed.all_reduce(totals)
    return float(totals[0] / totals[1])
