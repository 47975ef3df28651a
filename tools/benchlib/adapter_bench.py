"""`tools/bench.py --adapter generic|verl|megatron-rl`: the training step through a framework
adapter.

Dense = the framework's own step on the bench's workload; reuse = the adapter
(megatron_patches.frameworks) on the same batch and weights, under the framework's loss:
- generic: stock Megatron over one whole sequence per microbatch (fused-SDPA attention, the main
  bench's fair baseline), a token mean over the global batch x the step's microbatch count;
- verl (benchlib/adapter_verl.py; the frameworks venv, `make test-frameworks`): verl 0.9.1's own
  `MegatronEngine.forward_backward_batch` vs the registered prefix-reuse engine, verl's
  `ppo_loss`;
- megatron-rl (benchlib/adapter_train_rl.py; the offline Megatron-LM main tree): Megatron-LM
  RL's training step (train_rl.forward_step / loss_func through get_forward_backward_func) vs the
  same with the TrainRLReuse hooks.
Steps are interleaved, the median per path reported, with the JSON fields of the main bench
(dense_seconds, reuse_seconds, speedup, ideal_speedup, efficiency, max_grad_rel_diff against
stock local attention on the reuse model's weights), plus `adapter_overhead_seconds`: the time
the adapter itself adds per step (`PrefixReuseAdapter.prepare`: detection, policy, planning, the
step's build; no model) at `--overhead-groups` groups x `--overhead-group-size`.
Single process only (megatron-rl: one worker process on the Megatron-LM tree).
"""
from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable, Dict, List

import torch

from benchlib.config import BenchConfig
from benchlib.measure import config_batch
from benchlib.models import model_shape

__all__ = ["run_adapter_bench", "rollout_of", "adapter_overhead", "time_paths", "adapter_result",
           "ideal_speedup", "overhead_of", "bench_models", "format_adapter"]

ADAPTERS = ("generic", "verl", "megatron-rl")


def rollout_of(batch):
    """The bench batch (GroupBatch) as a framework hands it: flat sequences with group ids."""
    from megatron_patches.frameworks import RolloutBatch
    tokens, masks, adv, old, ref, gids = [], [], [], [], [], []
    for g, group in enumerate(batch.groups):
        for t, tr in enumerate(group.trajectories):
            context = group.context(tr.node)
            pad = torch.zeros(context.numel())
            tokens.append(torch.cat([context, tr.suffix]))
            masks.append(torch.cat([pad, tr.loss_mask]))
            adv.append(torch.cat([pad, tr.advantages]))
            old.append(torch.cat([pad, tr.old_logprobs]) if tr.old_logprobs is not None else None)
            ref.append(torch.cat([pad, tr.ref_logprobs]) if tr.ref_logprobs is not None else None)
            gids.append(g)
    return RolloutBatch(tokens=tokens, loss_mask=masks, group_ids=gids, advantages=adv,
                        old_logprobs=None if old[0] is None else old,
                        ref_logprobs=None if ref[0] is None else ref)


def _generic_loss(global_tokens: int):
    def loss_fn(b):
        ratio = torch.exp(b.logprobs - (b.old_logprobs if b.old_logprobs is not None else b.logprobs.detach()))
        pg = -torch.minimum(ratio * b.advantages, ratio.clamp(0.8, 1.2) * b.advantages)
        loss = (pg * b.loss_mask).sum() / global_tokens
        return loss * b.num_microbatches, {"loss": loss.detach()}
    return loss_fn


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
                       "interleaved": True}}


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


def run_adapter_bench(config: BenchConfig, raw_times: Dict[str, List[float]]) -> dict:
    """The result dict (module docstring)."""
    if config.adapter not in ADAPTERS:
        raise ValueError(f"--adapter {config.adapter!r}; choose one of {', '.join(ADAPTERS)}")
    if config.world_size != 1 or config.tree or config.num_experts:
        raise ValueError("--adapter runs one process, no --tree, no MoE; drop those flags")
    import megatron_patches
    megatron_patches.enable_cpu_support()  # before megatron.core loads (a no-op with CUDA)
    if config.adapter == "verl":
        from benchlib.adapter_verl import run_verl_bench
        return run_verl_bench(config, raw_times)
    if config.adapter == "megatron-rl":
        from benchlib.adapter_train_rl import run_train_rl_bench
        return run_train_rl_bench(config, raw_times)
    from megatron_patches.frameworks import PrefixReuseAdapter, dense_forward_backward
    from megatron_patches.training import max_relative_diff, param_grads, zero_grads
    models = bench_models(config)
    rollout = rollout_of(config_batch(config))
    loss_fn = _generic_loss(rollout.num_loss_tokens)
    adapter = PrefixReuseAdapter(models["reuse"])
    singles = [[i] for i in range(rollout.num_sequences)]
    paths = {"dense": lambda: dense_forward_backward(models["dense"], rollout, loss_fn,
                                                     micro_batches=singles),
             "reuse": lambda: adapter.forward_backward(rollout, loss_fn)}
    times = time_paths(paths, {n: partial(zero_grads, m) for n, m in models.items()}, config)
    raw_times.update(times)
    reuse_grads = param_grads(models["reuse"])
    zero_grads(models["reuse"])  # the numerical reference: stock local attention, same weights
    dense_forward_backward(models["reuse"], rollout, loss_fn, micro_batches=singles)
    diff = max_relative_diff(param_grads(models["reuse"]), reuse_grads)
    ideal, num_reuse = ideal_speedup(models["reuse"], rollout)
    return adapter_result(config, times, diff=diff,
                          finite=all(torch.isfinite(g).all() for g in reuse_grads.values()),
                          num_microbatches={"dense": len(singles), "reuse": num_reuse},
                          ideal=ideal, overhead=overhead_of(config, models["reuse"]))


def format_adapter(result: dict) -> str:
    return "\n".join([
        f"adapter {result['adapter']}: dense {result['dense_seconds']:.3f}s, reuse "
        f"{result['reuse_seconds']:.3f}s, speedup {result['speedup']:.2f}x (ideal "
        f"{result['ideal_speedup']:.2f}x, efficiency {result['efficiency']:.2f}), "
        f"max grad rel diff {result['max_grad_rel_diff']:.2e}",
        f"adapter overhead (detect + plan + build, no model): "
        f"{result['adapter_overhead_seconds']:.3f}s at {result['adapter_overhead_workload']}"])
