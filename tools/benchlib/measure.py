"""Inside the process (or each rank of a layout) that runs the models: build, time, check, measure.

Timed paths, all on the same weights and data, one forward+backward step each (gradients
cleared before, no optimizer), interleaved step by step (dense, dense_batched, stock_dense,
reuse, dense, ...) after the same number of untimed warm-up steps per path:
- dense: stock Megatron dense schedule, one [prefix; suffix] row per microbatch, fused-SDPA core
  attention (the kernel family the reuse path uses);
- dense_batched: the same with `micro_batch_size` rows per microbatch (up to the reuse path's
  token budget, or --dense-micro-batch-size); not timed at 1 row (it would be `dense`). With MoE
  it is the dense packing the reuse plan equals (microbatch b = the full rows of reuse
  microbatch b's trajectories: the aux-loss reference, docs/DESIGN.md "MoE"), always timed;
  `dense` stays one row per microbatch (the same FLOPs; its aux loss is another packing's);
- stock_dense: Megatron's local spec as shipped (unfused attention; --skip-stock drops it;
  with MoE in the plan's packing: the gradient reference);
- reuse: the prefix-reuse schedule (its hooks replace the local spec's core attention).
Each step is timed with benchlib.timing.RegionTimer (CUDA events and synchronisation on a GPU);
with several ranks a step's time is the slowest rank's. The gradient check runs after timing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch

import memory_probe
from benchlib.config import BenchConfig
from benchlib.models import build_models, first_param, grads, zero
from benchlib.progress import Progress
from benchlib.steps import dense_step, reuse_step
from benchlib.timing import RegionTimer
from benchlib.workload import config_batch
from prefix_schedule.attention import backends as attention_backends
from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.planner import StepPlan, plan_microbatches

__all__ = ["LOSS", "MEMORY_BASIS", "PATHS", "config_batch", "config_plan", "measure", "selected_backend"]

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
PATHS = ("dense", "dense_batched", "stock_dense", "reuse")
MEMORY_BASIS = ("device bytes of the accounting model (prefix_schedule/runtime/memory.py): "
                "saved-for-backward storages, each once, recompute inputs included, parameters "
                "excluded, plus for reuse the prefix cache's K/V and fp32 gK/gV and prefix "
                "activations brought back for Phase C; offloaded bytes count as host; dense "
                "one row per microbatch, same recompute; one untimed step per path; not the "
                "allocator's peak (tools/memory_probe.py)")


def config_plan(config: BenchConfig, batch: GroupBatch) -> StepPlan:
    from benchlib.hybrid import is_hybrid

    if config.memory_budget_mib is not None:  # packing, chunks, offload within the budget
        from benchlib.capacity import budget_plan

        return budget_plan(config, batch)
    return plan_microbatches(batch, token_budget=config.token_budget,
                             max_seq_len=config.max_seq_len,
                             prefix_chunk_tokens=config.prefix_chunk_tokens,
                             state_reads=is_hybrid(config))  # GDN / Mamba trees: StepPlan


def selected_backend(config: BenchConfig, device="cpu", dtype=torch.float32) -> str:
    """Set the process default to the requested backend; the one the reuse hook will run.
    ValueError (with the reason) if the requested one cannot run here."""
    attention_backends.set_default_backend(config.attention_backend)
    head_dim = config.hidden_size // config.num_attention_heads
    return attention_backends.select_backend(device=device, dtype=dtype, head_dim=head_dim).name


def collective_tensor(values, dtype=torch.float64) -> torch.Tensor:
    """`values` as a tensor a default-group collective accepts: on this rank's GPU under NCCL
    (tools/bench.py --pp/--tp/--dp/--cp on CUDA), else on the CPU (gloo)."""
    device = torch.device("cpu")
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.tensor(values, dtype=dtype, device=device)


def _reduce_max(value: float) -> float:
    """The max over ranks; a NaN on any rank gives inf (a MAX reduction may drop a NaN:
    [Note: non-finite comparisons] in megatron_patches/training.py)."""
    value = math.inf if math.isnan(value) else float(value)
    if torch.distributed.get_world_size() == 1:
        return value
    t = collective_tensor([value])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def _dense_run(config: BenchConfig, plan: StepPlan):
    """The dense step of the paths: one row per microbatch, or with MoE the dense packing the
    reuse plan equals (its aux loss is per microbatch: docs/DESIGN.md "MoE")."""
    if not config.num_experts:
        return lambda model, batch: dense_step(model, batch, LOSS)
    from megatron_patches.training import dense_step as packed_dense_step

    return lambda model, batch: packed_dense_step(model, batch, LOSS, packing=plan)


def _aux_loss(num_microbatches: int) -> Optional[float]:
    """Megatron's logged load_balancing_loss of the step (mean over MoE layers of the
    microbatch sum / num_microbatches; summed over pipeline stages, averaged over DP), then the
    tracker is reset."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import (destroy_moe_metrics_tracker,
                                                           get_moe_metrics_tracker)

    entry = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
    destroy_moe_metrics_tracker()
    if entry is None:
        return None
    total = collective_tensor([float(entry.values.sum()) / num_microbatches])
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
        total /= parallel_state.get_data_parallel_world_size()
    return float(total) / entry.values.numel()


def _progress(config: BenchConfig):
    """The steps' progress on the first rank; other ranks (their output goes to a log under
    launch) count silently."""
    import io

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    return Progress(config.warmup + config.steps, name="bench", unit="step",
                    stream=None if rank0 else io.StringIO(), tty=None if rank0 else False)


def _time_paths(config: BenchConfig, local, fused, batch: GroupBatch,
                plan: StepPlan) -> tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """(wall seconds, process CPU seconds) per timed step and path; with several ranks a step's
    time is the slowest rank's."""
    rows = config.dense_rows_per_microbatch
    reference = _dense_run(config, plan)
    batched = (reference if config.num_experts else
               lambda model, batch: dense_step(model, batch, LOSS, micro_batch_size=rows))
    runs = {
        "dense": (fused, lambda: dense_step(fused, batch, LOSS)),
        "dense_batched": (fused, lambda: batched(fused, batch)),
        "stock_dense": (local, lambda: reference(local, batch)),
        "reuse": (local, lambda: reuse_step(local, batch, plan, LOSS,
                                            offload_prefix_activations=config.offload_prefix_activations)),
    }
    if rows == 1 and not config.num_experts:
        del runs["dense_batched"]
    if config.skip_stock:
        del runs["stock_dense"]
    times: Dict[str, List[float]] = {name: [] for name in runs}
    cpu: Dict[str, List[float]] = {name: [] for name in runs}
    device = first_param(local).device
    with _progress(config) as progress:
        for step in range(config.warmup + config.steps):
            for name, (model, run) in runs.items():  # interleaved: noise hits every path alike
                zero(model)
                with RegionTimer(device) as timer:
                    run()
                seconds = _reduce_max(timer.seconds)  # the MAX also lines the ranks up
                cpu_seconds = _reduce_max(timer.cpu_seconds)
                if step >= config.warmup:
                    times[name].append(seconds)
                    cpu[name].append(cpu_seconds)
            progress.step("warm-up" if step < config.warmup else "timed: " + ", ".join(
                f"{name} {cpu[name][-1]:.3f}s" for name in runs) + " CPU")
    zero(local)
    zero(fused)
    _aux_loss(1)  # the timed steps' logged aux losses (the one-row dense's too) are dropped
    return times, cpu


def _check_step(config: BenchConfig, local, batch: GroupBatch, plan: StepPlan) -> dict:
    """Untimed, after timing, on the local model: stock dense (the reference), reuse, and the
    batched dense layout -- losses and max relative gradient differences."""
    from megatron_patches.training import max_relative_diff

    def grads_of(run):
        zero(local)
        result = run()
        result_grads = grads(local)
        zero(local)
        return result, result_grads

    dense_run = _dense_run(config, plan)
    dense, reference = grads_of(lambda: dense_run(local, batch))
    aux_dense = _aux_loss(len(plan.microbatches))
    reuse, reuse_grads = grads_of(lambda: reuse_step(
        local, batch, plan, LOSS, offload_prefix_activations=config.offload_prefix_activations))
    aux_reuse = _aux_loss(len(plan.microbatches))
    check = {"loss_dense": _global_loss(dense), "loss_reuse": _global_loss(reuse),
             "max_grad_rel_diff": _reduce_max(max_relative_diff(reference, reuse_grads)),
             "aux_loss_dense": aux_dense, "aux_loss_reuse": aux_reuse}
    rows = config.dense_rows_per_microbatch
    if rows > 1 and not config.num_experts:
        _, batched = grads_of(lambda: dense_step(local, batch, LOSS, micro_batch_size=rows))
        check["dense_batched_grad_rel_diff"] = _reduce_max(max_relative_diff(reference, batched))
    return check


def _global_loss(result) -> float:
    """Token mean over the whole batch: the last stage of each DP replica reports (one TP rank)."""
    if torch.distributed.get_world_size() == 1:
        return result.loss
    from megatron.core import parallel_state

    totals = collective_tensor([0.0, 0.0])
    if (parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        totals += collective_tensor([result.loss * result.num_tokens, float(result.num_tokens)])
    torch.distributed.all_reduce(totals)
    return float(totals[0] / totals[1])


def _memory(config: BenchConfig, local, fused, batch: GroupBatch,
            plan: StepPlan) -> Dict[str, float]:
    """One extra step per path under tools/memory_probe.py: the device bytes of the accounting
    model (saved activations, recompute inputs, the prefix cache, offloaded bytes as host)."""
    from benchlib.capacity import CAPACITY_BASIS, capacity_ratio
    from prefix_schedule.runtime.step import ReuseStep

    zero(fused)
    dense = memory_probe.measure_dense(fused, lambda: dense_step(fused, batch, LOSS))
    zero(local)
    step = ReuseStep(batch, plan, offload_prefix_activations=config.offload_prefix_activations)
    reuse = memory_probe.measure_reuse(
        local, step, lambda s: reuse_step(local, batch, plan, LOSS, step=s))
    zero(local)
    zero(fused)
    return {"dense_peak_saved_bytes": dense.peak_saved_bytes,
            "reuse_peak_saved_bytes": reuse.peak_saved_bytes,
            "reuse_suffix_phase_peak_bytes": reuse.suffix_phase_peak_bytes,
            "reuse_cache_bytes": reuse.cache_peak_bytes,
            "reuse_peak_host_bytes": reuse.peak_host_bytes,
            "reuse_phase_peak_bytes": reuse.phase_peaks,
            "suffix_phase_reduction": 1 - reuse.suffix_phase_peak_bytes / dense.peak_saved_bytes,
            "step_peak_reduction": 1 - reuse.peak_saved_bytes / dense.peak_saved_bytes,
            "offload_prefix_activations": config.offload_prefix_activations,
            "recompute": config.recompute,
            "capacity_ratio": capacity_ratio(config, dense.peak_saved_bytes),
            "capacity_basis": CAPACITY_BASIS,
            "basis": MEMORY_BASIS}


def _megatron_layout() -> Dict[str, int]:
    """The parallel sizes Megatron actually ran with (the JSON's `layout`)."""
    from megatron.core import parallel_state as ps

    return {"pp": ps.get_pipeline_model_parallel_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            "ep": ps.get_expert_model_parallel_world_size()}


def _hybrid_stages(config: BenchConfig, local) -> Optional[List[str]]:
    """Hybrid models: each pipeline stage's layer symbols as built (benchlib/hybrid.py)."""
    from benchlib.hybrid import is_hybrid, stage_layers

    if not is_hybrid(config):
        return None
    from benchlib.models import chunks

    mine = stage_layers(chunks(local)[0])
    if torch.distributed.get_world_size() == 1:
        return [mine]
    from megatron.core import parallel_state

    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        every, (parallel_state.get_pipeline_model_parallel_rank(), mine))
    return [layers for _, layers in sorted(dict(every).items())]


def measure(config: BenchConfig, distributed: bool = False) -> dict:
    """Build, time, check and measure in this process, or in each rank of a layout
    (`distributed`, run by megatron_patches.support.launch: its pipeline stage / TP shard / DP share);
    every rank returns the same reduced numbers."""
    local, fused = build_models(config, distributed)
    batch = config_batch(config)
    placement = config.placement(batch)
    if placement is not None:
        from megatron.core import parallel_state

        batch = placement.ranks[parallel_state.get_data_parallel_rank()].batch
    plan = config_plan(config, batch)
    if plan.memory is not None:  # the reuse path runs with what the budget planner chose
        config = dataclasses.replace(config, offload_prefix_activations=plan.memory.options.offload)
    param = first_param(local)
    backend = selected_backend(config, param.device, param.dtype)
    times, cpu_times = _time_paths(config, local, fused, batch, plan)
    check = _check_step(config, local, batch, plan)  # untimed, after every path's timing
    memory: Optional[dict] = None if distributed else _memory(config, local, fused, batch, plan)
    timer = RegionTimer(param.device)
    return {"times": times, "cpu_times": cpu_times, "attention_backend": backend, **check, "memory": memory,
            "layout": _megatron_layout(), "timing_basis": timer.basis,
            "hybrid_stages": _hybrid_stages(config, local),
            "reuse_microbatch_tokens": [m.num_tokens for m in plan.microbatches],
            "plan_dense_rows": [len(m.segments) for m in plan.microbatches]}
