"""One point of tools/sweep.py: dense vs prefix reuse on one (prefix, suffix, group size) shape.

Both paths run the same weights and data in this process, one forward+backward step each
(gradients cleared before, no optimizer): dense = Megatron's dense schedule, one [prefix; suffix]
row per microbatch, fused-SDPA core attention (`build_model(fused_attention=True)`, the fair
baseline: reuse's attention is fused too); reuse = the prefix-reuse schedule planned by
prefix_schedule.planning.policy (or, with policy off, a group's suffixes in one microbatch, the
bench's default). After `warmup` untimed steps per path, `reps` steps are interleaved (dense,
reuse, dense, ...); per path the median of wall time and of process CPU time is kept
(tools/benchlib: CUDA events between synchronisations on a GPU; the steps move each item to the
model's device, as a training script's get_batch does). On a shared CPU, CPU time moves far less with other jobs'
load than wall time: run with one thread so it is not inflated by spinning OpenMP workers.
Memory: one more untimed step per path under tools/memory_probe.py (bytes held for backward;
`suffix_phase_reduction` = 1 - reuse's suffix-phase peak / dense's step peak). The gradients
of the two paths' last timed steps are compared (`grad_rel_diff`, max relative): every point is
an exactness check of its plan too.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch

import memory_probe
from benchlib.steps import dense_step, reuse_step
from benchlib.timing import RegionTimer
from benchlib.workload import make_batch
from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, ideal_speedup
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.planning.policy import ReusePolicy, plan_with_policy

__all__ = ["ModelSpec", "Models", "measure_point", "LOSS"]

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: int = 688
    num_attention_heads: int = 8
    num_query_groups: int = 2
    vocab_size: int = 2048

    def dims(self) -> ModelDims:
        return ModelDims(gated_linear_unit=True, **self.__dict__)


class Models:
    """The two models of every point (built once per sweep): local spec for reuse (its core
    attention is replaced by the reuse hooks), fused SDPA for dense, same weights."""

    def __init__(self, spec: ModelSpec, max_seq_len: int, *, seed: int, compile: bool) -> None:
        from megatron_patches.support.cpu_support import enable_cpu_support

        enable_cpu_support()  # opt-in CPU/gloo layer; a no-op with CUDA
        import megatron_patches
        from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_single_process
        from megatron_patches.training import prepare_for_training

        megatron_patches.install()
        initialize_single_process(seed=seed)
        shape = TinyLlamaConfig(max_seq_len=max_seq_len, **spec.__dict__)
        self.local = prepare_for_training(build_model(shape, seed=seed), ddp=False)
        fused = build_model(shape, fused_attention=True, seed=seed + 1)
        fused.load_state_dict(self.local.state_dict())
        self.fused = prepare_for_training(fused, ddp=False)
        self.compiled = compile
        if compile:
            _compile_models(self.local, self.fused)

    @property
    def device(self) -> torch.device:
        return next(self.local.parameters()).device


def _compile_models(*models) -> None:
    """torch.compile both models' forward (dynamic shapes). The reuse attention hook runs eager:
    dynamo (torch 2.13) fails inside its custom autograd Functions (InternalTorchDynamoError in
    handle_saved_tensors_wiring), so it is wrapped in torch.compiler.disable -- a graph break at
    every attention layer, in both paths (the hook is installed process-wide; dense calls it too
    and falls through to its own fused SDPA). Everything between the breaks compiles."""
    from megatron.core.transformer import attention

    hook = attention._core_attention_hook
    if hook is not None and not getattr(hook, "_sweep_eager", False):
        eager = torch.compiler.disable(hook)
        eager._sweep_eager = True
        attention._core_attention_hook = eager
    for model in models:
        model.forward = torch.compile(model.forward, dynamic=True)


def _plan(batch: GroupBatch, dims: ModelDims, max_seq_len: int, policy: Optional[ReusePolicy]):
    """(plan, policy note): the policy's, or a group's suffixes per microbatch (bench default)."""
    if policy is None:
        budget = max(len(g.trajectories) * max(t.num_tokens for t in g.trajectories)
                     for g in batch.groups)
        return plan_microbatches(batch, token_budget=budget, max_seq_len=max_seq_len), \
            f"off: suffix microbatches of {budget} tokens"
    planned = plan_with_policy(batch, policy=policy, max_seq_len=max_seq_len)
    dense = planned.dense_groups
    note = (f"dense ({planned.decisions[0].reason})" if dense else
            f"reuse, microbatches <= {planned.token_budget} tokens")
    return planned.plan, note


def measure_point(models: Models, dims: ModelDims, *, prefix_len: int, suffix_len: int,
                  group_size: int, num_groups: int, policy: Optional[ReusePolicy], reps: int,
                  warmup: int, memory: bool, seed: int) -> dict:
    """Time, check and measure one point; returns the CSV row's measured fields."""
    from megatron_patches.training import max_relative_diff, param_grads, zero_grads

    batch = make_batch(prefix_len=prefix_len, suffix_len=suffix_len, group_size=group_size,
                       num_groups=num_groups, vocab_size=dims.vocab_size, seed=seed)
    max_len = prefix_len + suffix_len
    plan, note = _plan(batch, dims, max_len, policy)
    full_plan, _ = _plan(batch, dims, max_len, None)
    runs = {"dense": (models.fused, lambda: dense_step(models.fused, batch, LOSS)),
            "reuse": (models.local, lambda: reuse_step(models.local, batch, plan, LOSS))}
    wall: dict = {name: [] for name in runs}
    cpu: dict = {name: [] for name in runs}
    for rep in range(warmup + reps):
        for name, (model, run) in runs.items():
            zero_grads(model)
            with RegionTimer(models.device) as timer:
                run()
            if rep >= warmup:
                wall[name].append(timer.seconds)
                cpu[name].append(timer.cpu_seconds)
    grad_diff = max_relative_diff(param_grads(models.fused), param_grads(models.local))
    row = {"dense_s": statistics.median(wall["dense"]), "reuse_s": statistics.median(wall["reuse"]),
           "dense_cpu_s": statistics.median(cpu["dense"]),
           "reuse_cpu_s": statistics.median(cpu["reuse"]),
           "ideal": ideal_speedup(dims, batch, plan),
           "ideal_full_reuse": ideal_speedup(dims, batch, full_plan),
           "microbatches": len(plan.microbatches), "policy": note, "grad_rel_diff": grad_diff}
    if memory:
        row.update(_memory(models, batch, plan))
    for model in (models.local, models.fused):
        zero_grads(model)
    return row


def _memory(models: Models, batch: GroupBatch, plan) -> dict:
    from megatron_patches.training import zero_grads
    from prefix_schedule.runtime.step import ReuseStep

    zero_grads(models.fused)
    dense = memory_probe.measure_dense(models.fused, lambda: dense_step(models.fused, batch, LOSS))
    zero_grads(models.local)
    reuse = memory_probe.measure_reuse(models.local, ReuseStep(batch, plan),
                                       lambda s: reuse_step(models.local, batch, plan, LOSS, step=s))
    return {"dense_peak_mib": dense.peak_saved_bytes / 2 ** 20,
            "reuse_suffix_peak_mib": reuse.suffix_phase_peak_bytes / 2 ** 20,
            "suffix_phase_reduction": 1 - reuse.suffix_phase_peak_bytes / dense.peak_saved_bytes}
