"""What every `tools/bench.py --adapter` choice shares (benchlib/adapter_bench.py,
adapter_verl.py, train_rl_worker.py): the bench models, the interleaved timing loop, the
adapter's host overhead, the FLOP-ideal speedup, the result's JSON fields."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch

from benchlib.config import BenchConfig
from benchlib.models import model_shape

__all__ = ["adapter_overhead", "time_paths", "adapter_result", "ideal_speedup", "overhead_of",
           "bench_models"]


def adapter_overhead(*, num_groups: int, group_size: int, prefix_len: int, suffix_len: int,
                     model, repeats: int = 3) -> float:
    """Median seconds of `PrefixReuseAdapter.prepare` (detect, decide, plan, build the step)."""
    from megatron_patches.frameworks import PrefixReuseAdapter, RolloutBatch
    gen = torch.Generator().manual_seed(0)
    tokens, gids = [], []
    for g in range(num_groups):
        prompt = torch.randint(1, 1000, (prefix_len,), generator=gen)
        for _ in range(group_size):
            tokens.append(torch.cat([prompt, torch.randint(1, 1000, (suffix_len,), generator=gen)]))
            gids.append(g)
    masks = [torch.cat([torch.zeros(prefix_len), torch.ones(suffix_len)]) for _ in tokens]
    rollout = RolloutBatch(tokens=tokens, loss_mask=masks, group_ids=gids,
                           advantages=[1.0] * len(tokens))
    adapter = PrefixReuseAdapter(model)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        adapter.prepare(rollout)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def time_paths(paths: Dict[str, Callable[[], object]], zero: Dict[str, Callable[[], None]],
               config: BenchConfig) -> Dict[str, List[float]]:
    """Seconds per step of each path: --warmup untimed steps, then --steps timed ones,
    interleaved (dense, reuse, dense, ...); gradients zeroed before each step, untimed."""
    times: Dict[str, List[float]] = {name: [] for name in paths}
    for step in range(config.warmup + config.steps):
        for name, run in paths.items():
            zero[name]()
            start = time.perf_counter()
            run()
            if step >= config.warmup:
                times[name].append(time.perf_counter() - start)
    return times


def timing_noise(times: Dict[str, List[float]]) -> dict:
    """The load average and why the timings are noise, or None (megatron_patches/support/noise.py)."""
    from megatron_patches.support.noise import machine_load, noise_warning
    load, cores = machine_load()
    return {"load_average": load, "cores": cores,
            "noise": noise_warning(times, load=load, cores=cores)}


def adapter_result(config: BenchConfig, times: Dict[str, List[float]], *, diff: float,
                   finite: bool, num_microbatches: dict, ideal: float, overhead: float) -> dict:
    """The JSON fields every --adapter choice reports (module docstring)."""
    median = {name: statistics.median(v) for name, v in times.items()}
    return {"adapter": config.adapter, "dense_seconds": median["dense"],
            "reuse_seconds": median["reuse"], "speedup": median["dense"] / median["reuse"],
            "ideal_speedup": ideal, "efficiency": median["dense"] / median["reuse"] / ideal,
            "max_grad_rel_diff": diff, "grads_finite": bool(finite),
            "num_microbatches": num_microbatches,
            "adapter_overhead_seconds": overhead,
            "adapter_overhead_workload": {"groups": config.overhead_groups,
                                          "group_size": config.overhead_group_size,
                                          "prefix_len": config.prefix_len,
                                          "suffix_len": config.suffix_len},
            "workload": {name: getattr(config, name) for name in (
                "prefix_len", "suffix_len", "group_size", "num_groups")},
            "threads": config.threads, "steps": config.steps,
            "timing": {"basis": "wall (perf_counter)", "warmup_steps_per_path": config.warmup,
                       "interleaved": True, **timing_noise(times)}}


def ideal_speedup(model, rollout) -> tuple:
    """(FLOP-ideal speedup of the adapter's plan for `rollout`, its microbatch count)."""
    from megatron_patches.frameworks import PrefixReuseAdapter
    from megatron_patches.frameworks.adapter import dims_of_model
    from prefix_schedule.planning.flops import dense_flops, reuse_flops
    prepared = PrefixReuseAdapter(model).prepare(rollout)
    dims = dims_of_model(model)
    dense = dense_flops(dims, [n - 1 for n in rollout.lengths])
    return dense / reuse_flops(dims, prepared.step.plan), prepared.num_microbatches


def overhead_of(config: BenchConfig, model) -> float:
    return adapter_overhead(num_groups=config.overhead_groups,
                            group_size=config.overhead_group_size,
                            prefix_len=config.prefix_len, suffix_len=config.suffix_len,
                            model=model)


def bench_models(config: BenchConfig) -> dict:
    """The bench model twice (same seed): "dense" with fused SDPA attention (the timing
    baseline), "reuse" on the local spec (the adapter's, and stock local attention for the
    gradient reference)."""
    import megatron_patches
    from megatron_patches.models.tiny import build_model, initialize_single_process
    from megatron_patches.training import scale_grads_by_token_count
    torch.set_num_threads(config.threads)
    megatron_patches.install()
    initialize_single_process(seed=config.seed)
    shape = model_shape(config)
    models = {"dense": build_model(shape, fused_attention=True), "reuse": build_model(shape)}
    for model in models.values():
        model.config.finalize_model_grads_func = scale_grads_by_token_count
        model.config.calculate_per_token_loss = False
    return models
