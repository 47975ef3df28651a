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

from functools import partial
from typing import Dict, List

import torch

from benchlib.adapter_common import (adapter_overhead, adapter_result, bench_models,
                                     ideal_speedup, overhead_of, time_paths)
from benchlib.config import BenchConfig
from benchlib.measure import config_batch

__all__ = ["run_adapter_bench", "rollout_of", "adapter_overhead", "format_adapter"]

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
        *([f"  {result['timing']['noise']}"] if result["timing"].get("noise") else []),
        f"adapter overhead (detect + plan + build, no model): "
        f"{result['adapter_overhead_seconds']:.3f}s at {result['adapter_overhead_workload']}"])
