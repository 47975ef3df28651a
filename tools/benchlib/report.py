"""tools/bench.py's result dict (the JSON) and its human-readable table."""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional

import torch

from benchlib.adapter_common import timing_noise
from benchlib.config import BenchConfig
from benchlib.hybrid import hybrid_dims
from benchlib.measure import config_batch, config_plan, measure
from prefix_schedule.planning.flops import ideal_speedup

__all__ = ["IDEAL_BASIS", "format_table", "run_bench", "check_failures"]

IDEAL_BASIS = ("FLOP ratio dense/reuse of the whole (global) batch planned as one step "
               "(prefix_schedule/planning/flops.py); ignores pipeline bubbles and DP imbalance")


def run_bench(config: BenchConfig, raw_times: Optional[Dict[str, List[float]]] = None) -> dict:
    """Run the benchmark; return the result dict that `--json` writes.

    `raw_times`, if given, receives every timed step's seconds per path (for the table's spread).
    """
    dims = config.model_dims()
    threads = max(1, config.threads // config.world_size)
    batch = config_batch(config)
    ideal = ideal_speedup(dims, batch, config_plan(config, batch))
    placement = config.placement(batch)
    if config.world_size == 1:
        torch.set_num_threads(config.threads)
        measured = measure(config)
    else:
        from benchlib.cp import measure_cp
        from megatron_patches.support.launch import launch

        measured = launch(measure_cp if config.cp > 1 else measure,
                          world_size=config.world_size, args=(config, True),
                          timeout_s=config.timeout, threads_per_rank=threads,
                          backend="auto")[0]  # NCCL, one GPU per rank, on CUDA
    times, cpu_times = measured.pop("times"), measured.pop("cpu_times")
    if raw_times is not None:
        raw_times.update(times)
    median = {name: statistics.median(values) for name, values in times.items()}
    speedup = median["dense"] / median["reuse"]
    reuse_tokens = measured.pop("reuse_microbatch_tokens")
    plan_rows = measured.pop("plan_dense_rows", None)  # benchlib/cp.py (no MoE) has none
    batched_diff = measured.pop("dense_batched_grad_rel_diff", None)
    stages = measured.pop("hybrid_stages", None)  # hybrid models: layers per pipeline stage
    rows = max(plan_rows) if config.num_experts else config.dense_rows_per_microbatch
    result = {
        "dense_seconds": median["dense"],
        "stock_dense_seconds": median.get("stock_dense"),
        "reuse_seconds": median["reuse"],
        "speedup": speedup,
        "ideal_speedup": ideal,
        "ideal_speedup_basis": IDEAL_BASIS,
        "efficiency": speedup / ideal,
        "dense_batched": None if "dense_batched" not in median else {
            "seconds": median["dense_batched"],
            "micro_batch_size": rows,
            "tokens_per_microbatch": rows * config.row_len,
            "packing": ("the reuse plan's (microbatch b = reuse microbatch b's trajectories, "
                        "full rows; max rows shown): the MoE aux-loss reference"
                        if config.num_experts else "equal rows up to the token budget"),
            "speedup": median["dense_batched"] / median["reuse"],
            "efficiency": median["dense_batched"] / median["reuse"] / ideal,
            "max_grad_rel_diff_vs_stock_dense": batched_diff},
        "timing": {"basis": measured.pop("timing_basis"), "warmup_steps_per_path": config.warmup,
                   "interleaved": True, **timing_noise(times),
                   "cpu_seconds": {name: statistics.median(v) for name, v in cpu_times.items()},
                   "cpu_seconds_basis": "median process CPU time per step, all threads (slowest "
                                        "rank); steadier than wall time on a loaded machine",
                   "tokens_per_microbatch": {
                       "dense": config.row_len, "reuse_mean": sum(reuse_tokens) / len(reuse_tokens),
                       "reuse_max": max(reuse_tokens)}},
        **measured,
        "model": {name: getattr(dims, name) for name in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "vocab_size", "gated_linear_unit", "num_experts",
            "moe_router_topk")} | hybrid_dims(config)  # + GDN / Mamba shapes (hybrid.py)
        | ({} if stages is None else {"stages": stages}),
        "ep": config.ep,
        "workload": {name: getattr(config, name) for name in (
            "prefix_len", "suffix_len", "group_size", "num_groups", "tree", "node_len")},
        "token_budget": config.token_budget,
        "prefix_chunk_tokens": config.prefix_chunk_tokens,
        "offload_prefix_activations": config.offload_prefix_activations,
        "recompute": config.recompute,
        "threads": config.threads,
        "threads_per_rank": threads,
        "steps": config.steps,
        "production_settings": config.production,
    }
    if placement is not None:
        result["placement"] = placement.describe()
    if config.memory_budget_mib is not None:
        from benchlib.capacity import budget_report

        result["memory_budget"] = budget_report(config, config_plan(config, batch), median)
    return result


def format_table(result: dict, raw_times: Optional[Dict[str, List[float]]] = None) -> str:
    """A short human-readable summary of a result dict (with min/max per path if given times)."""
    w, m, lay = result["workload"], result["model"], result["layout"]
    raw_times = raw_times or {}

    cpu = result["timing"]["cpu_seconds"]

    def row(label: str, name: str, seconds) -> str:
        if seconds is None:
            return f"{label:<34}{'skipped':>12}"
        values = raw_times.get(name)
        spread = f"{min(values):>10.4f}{max(values):>10.4f}" if values else ""
        return f"{label:<34}{seconds:>12.4f}{spread}{cpu[name]:>10.4f}"

    world = lay["pp"] * lay["tp"] * lay["dp"] * lay.get("cp", 1)
    batched, tokens = result["dense_batched"], result["timing"]["tokens_per_microbatch"]
    lines = [
        (f"workload: {w['num_groups']} groups x {w['group_size']} trajectories, prefix "
         f"{w['prefix_len']}" if not w.get("tree") else
         f"workload: {w['num_groups']} prefix trees {w['tree']} (depth x branching) of "
         f"{w['node_len']}-token nodes, {w['group_size']} trajectories per leaf")
        + f", suffix {w['suffix_len']}, token budget {result['token_budget']}"
        + (f", prefix chunks of <= {result['prefix_chunk_tokens']} tokens"
           if result["prefix_chunk_tokens"] else ""),
        f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"heads {m['num_attention_heads']}/{m['num_query_groups']} kv, vocab {m['vocab_size']}"
        + (f", GDN with attention every {m['linear_attention_freq']} layers"
           if m.get("linear_attention_freq") else "")
        + (f", HybridModel {m['hybrid_pattern']}" if m.get("hybrid_pattern") else "")
        + (f" (stages {' | '.join(m['stages'])})" if len(m.get("stages") or ()) > 1 else "")
        + "; "
        f"{result['threads']} threads, median of {result['steps']} steps after "
        f"{result['timing']['warmup_steps_per_path']} warm-up step(s) per path",
        f"layout: pp {lay['pp']}" + (f" (x {lay['vpp']} virtual)" if lay.get("vpp", 1) > 1 else "")
        + f" x tp {lay['tp']} x dp {lay['dp']}"
        + (f" x cp {lay['cp']}" if lay.get("cp", 1) > 1 else "") + f" = {world} process(es), "
        + ("Megatron-LM production settings, " if result.get("production_settings") else "") +
        f"{result['threads_per_rank']} thread(s) each; attention backend "
        f"{result['attention_backend']}",
        *([result["placement"]] if "placement" in result else []),
        f"tokens per microbatch: dense {tokens['dense']} (one row), reuse mean "
        f"{tokens['reuse_mean']:.0f} / max {tokens['reuse_max']}"
        + (f", dense batched {batched['tokens_per_microbatch']} ({batched['micro_batch_size']} rows)"
           if batched else ""),
        f"{'fwd+bwd seconds' + (' (slowest rank)' if world > 1 else ''):<34}"
        f"{'median':>12}{'min':>10}{'max':>10}{'cpu s':>10}",
        row("dense (fused SDPA, 1 row/mb)", "dense", result["dense_seconds"]),
        row(f"dense batched ({batched['micro_batch_size']} rows/mb"
            + (", plan)" if m.get("num_experts") else ")") if batched else "dense batched",
            "dense_batched", batched and batched["seconds"]),
        row("stock dense (local, unfused)", "stock_dense", result["stock_dense_seconds"]),
        row("reuse", "reuse", result["reuse_seconds"]),
        f"speedup {result['speedup']:.3f}x"
        + (f" (vs batched dense {batched['speedup']:.3f}x, efficiency "
           f"{batched['efficiency']:.3f})" if batched else "")
        + f"  ideal {result['ideal_speedup']:.3f}x (whole-batch FLOPs)  efficiency "
        f"{result['efficiency']:.3f}",
        *([f"  {result['timing']['noise']}"] if result["timing"].get("noise") else []),
        f"cpu-time speedup {cpu['dense'] / cpu['reuse']:.3f}x"
        + (f" (vs batched dense {cpu['dense_batched'] / cpu['reuse']:.3f}x)" if batched else ""),
        f"loss dense {result['loss_dense']:.6f}  reuse {result['loss_reuse']:.6f}  "
        f"max grad rel diff vs stock dense {result['max_grad_rel_diff']:.2e}"
        + (f"  aux loss dense {result['aux_loss_dense']:.6f}  reuse "
           f"{result['aux_loss_reuse']:.6f}" if result.get("aux_loss_dense") is not None else "")
        + (f" (batched dense {batched['max_grad_rel_diff_vs_stock_dense']:.2e})" if batched and batched["max_grad_rel_diff_vs_stock_dense"] is not None else ""),
        f"timing: {result['timing']['basis']}",
        _memory_line(result["memory"]),
        *_budget_lines(result),
        *_cp_lines(result),
    ]
    return "\n".join(lines)


def check_failures(result: dict) -> List[str]:
    """What the untimed numerical check says is broken: a NaN or inf loss or gradient
    difference (`max_relative_diff` gives inf for a non-finite entry on either side). Empty:
    the numbers are finite (their size is for the reader; the tests hold the tolerances)."""
    batched = result.get("dense_batched") or {}
    values = {"loss_dense": result.get("loss_dense"), "loss_reuse": result.get("loss_reuse"),
              "max_grad_rel_diff": result.get("max_grad_rel_diff"),
              "dense_batched.max_grad_rel_diff_vs_stock_dense":
                  batched.get("max_grad_rel_diff_vs_stock_dense")}
    return [f"{name} is {value} (a NaN or inf on the dense or the reuse side)"
            for name, value in values.items() if value is not None and not math.isfinite(value)]


def _budget_lines(result: dict) -> List[str]:
    budget = result.get("memory_budget")
    if not budget:
        return []
    model = result.get("model", {})
    hybrid = model.get("linear_attention_freq") or model.get("hybrid_pattern")
    return [budget["reuse"]["explanation"]
            + ("\n  (predicted as the GPU kernels save: fla / mamba-ssm; on CPU the torch "
               "stand-ins of GDN / Mamba-2 layers save more, so the device MiB above exceed it)"
               if hybrid else ""),
            f"dense within the budget: {budget['dense']['micro_batch_size']} row(s) per "
            f"microbatch; speedup at equal memory {budget['speedup_at_equal_memory']:.3f}x"]


def _cp_lines(result: dict) -> List[str]:
    traffic = result.get("cp_traffic")
    if not traffic:
        return []
    mib = 2.0 ** 20
    reuse = ", ".join(f"{k} {v / mib:.2f}" for k, v in sorted(
        traffic["reuse_bytes_per_rank"].items()))
    dense = traffic["dense_cp_bytes_per_rank_model"]
    ref = result["cp_reference"]
    return [f"dense timed as: {result['dense_layout']}",
            f"reuse at CP=1 x DP={result['layout']['cp']} (same work per rank, no CP): "
            f"{ref['reuse_cp1_seconds']:.4f} s (min {min(ref['reuse_cp1_seconds_all']):.4f}), "
            f"efficiency {ref['speedup_cp1'] / result['ideal_speedup']:.3f}; CP reuse / CP=1 "
            f"reuse {ref['cp_overhead']:.3f}",
            f"CP MiB per rank per step: reuse {reuse} (total "
            f"{sum(traffic['reuse_bytes_per_rank'].values()) / mib:.2f}); dense CP would move "
            f"all_gather {dense['all_gather'] / mib:.2f}, reduce_scatter "
            f"{dense['reduce_scatter'] / mib:.2f} (total {sum(dense.values()) / mib:.2f})"]


def _memory_line(memory: Optional[dict]) -> str:
    if memory is None:
        return "device memory (saved-tensor accounting): not counted with several processes"
    mib = 2.0 ** 20
    return (f"device MiB (saved-tensor accounting, not an allocator; recompute {memory['recompute']}, offload "
            f"{memory['offload_prefix_activations']}): dense peak "
            f"{memory['dense_peak_saved_bytes'] / mib:.1f}, "
            f"reuse peak {memory['reuse_peak_saved_bytes'] / mib:.1f}, reuse suffix phase "
            f"{memory['reuse_suffix_phase_peak_bytes'] / mib:.1f} "
            f"({-100 * memory['suffix_phase_reduction']:+.0f}% vs dense; whole step "
            f"{-100 * memory['step_peak_reduction']:+.0f}%), cache "
            f"{memory['reuse_cache_bytes'] / mib:.1f}, host {memory['reuse_peak_host_bytes'] / mib:.1f}"
            + (f"; capacity ratio {memory['capacity_ratio']:.2f}"
               if memory.get("capacity_ratio") is not None else ""))
