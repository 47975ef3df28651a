"""Run one dense or prefix-reuse step with Megatron's schedules (tests, demo, bench).

Both paths use the same model, the same forward step (megatron_patches.rl) and the same
loss-token normalisation, so their gradients can be compared bit for bit up to rounding:
dense = stock `get_forward_backward_func()` over full `[prefix; suffix]` rows (one trajectory per
microbatch); reuse = the same call with the prefix-reuse schedule selected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterator, List, Optional

import torch

from prefix_schedule.planning.batch_checks import batch_digest, validate_batch
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.inputs import build_dense_inputs, build_dense_microbatch_inputs
from prefix_schedule.planning.planner import StepPlan
from prefix_schedule.runtime.cp import CPGroup
from prefix_schedule.runtime.step import ReuseStep

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model

import megatron_patches
from megatron_patches.runtime.agreement import StepChecks, fingerprint, refuse_step
from megatron_patches.rl import make_policy_forward_step

__all__ = ["StepResult", "dense_items", "dense_packed_items", "row_multiple_for", "dense_step",
           "reuse_step", "context_parallel_group", "agree_on_dense_step",
           "scale_grads_by_token_count",
           "prepare_for_training", "zero_grads",
           "param_grads", "max_relative_diff", "max_elementwise_error", "missing_grads",
           "worst_of"]


@dataclasses.dataclass(kw_only=True)
class StepResult:
    """What one forward-backward step reported."""

    loss: float
    """Token-mean loss over the step."""
    num_tokens: int
    """Loss tokens of the step."""
    reports: List[dict]
    """Per-microbatch reports from the loss function."""


def scale_grads_by_token_count(models, num_tokens, **_kwargs) -> None:
    """finalize_model_grads_func for un-wrapped models: divide `.grad` by the token count.

    (Megatron's own finalize_model_grads does this, plus DP all-reduce, for DDP-wrapped models;
    this one serves single-replica tests: tensor and pipeline parallel, no data parallel.)
    """
    if num_tokens is None:
        return
    _check_plain_finalize(models[0].config)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        # only the last stage computed the loss: take its count (as Megatron's finalize does)
        num_tokens = num_tokens.clone()
        torch.distributed.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
    cp_group = parallel_state.get_context_parallel_group()
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:  # CP ranks hold parts of the same rows: sum tokens and gradients (as DDP does)
        num_tokens = num_tokens.clone()
        torch.distributed.all_reduce(num_tokens, group=cp_group)
    count = max(int(num_tokens), 1)
    for model in models:
        for p in model.parameters():
            if p.grad is not None:
                if cp > 1:
                    torch.distributed.all_reduce(p.grad, group=cp_group)
                p.grad.div_(count)


def context_parallel_group(config=None) -> Optional[CPGroup]:
    """This rank's CP group for a ReuseStep (None at CP=1); with the model's `config`, local
    rows are padded to a multiple of TP under sequence parallelism (`row_multiple_for`)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return CPGroup(parallel_state.get_context_parallel_group(),
                   row_multiple=1 if config is None else row_multiple_for(config))


def _check_plain_finalize(config) -> None:
    if parallel_state.get_tensor_model_parallel_world_size() > 1 and (
            config.sequence_parallel or config.qk_layernorm):
        raise ValueError("with TP > 1, sequence-parallel norm and q/k-norm weight gradients are "
                         "partial sums per TP rank, which scale_grads_by_token_count does not "
                         "add up; use prepare_for_training(model, ddp=True) (Megatron's "
                         "finalize_model_grads sums them)")


def dense_items(batch: GroupBatch, row_multiple: int = 1) -> Iterator[Dict[str, torch.Tensor]]:
    """Data iterator of the dense baseline: each trajectory's full row, in batch order, right-
    padded to a multiple of `row_multiple` (see `row_multiple_for`)."""
    for g, group in enumerate(batch.groups):
        for t in range(len(group.trajectories)):
            item = build_dense_inputs(batch, g, t, row_multiple=row_multiple)
            item["kind"] = "dense"
            yield item


def row_multiple_for(config) -> int:
    """What every row's length must be a multiple of: the TP size under sequence parallelism
    (Megatron scatters rows along the sequence), else 1. Pass it to
    `plan_microbatches(..., row_multiple=...)` and `dense_items`."""
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def _summarise(reports: List[dict]) -> StepResult:
    loss_sum = sum(float(r["loss"][0]) for r in reports)
    tokens = sum(int(r["loss"][1]) for r in reports)
    return StepResult(loss=loss_sum / max(tokens, 1), num_tokens=tokens, reports=reports)


def dense_packed_items(batch: GroupBatch, plan: StepPlan) -> Iterator[Dict[str, torch.Tensor]]:
    """Data iterator of the dense packing a reuse step with `plan` equals (MoE router
    statistics are per microbatch): microbatch b holds the full rows of the trajectories of the
    plan's microbatch b, [n_b, L] with a padding mask (docs/DESIGN.md "MoE")."""
    for mb in plan.microbatches:
        item = build_dense_microbatch_inputs(batch, mb)
        item["kind"] = "dense"
        yield item


def dense_step(model, batch: GroupBatch, loss_config: PolicyLossConfig,
               forward_only: bool = False, row_multiple: Optional[int] = None,
               packing: Optional[StepPlan] = None) -> StepResult:
    """Stock Megatron dense step: every trajectory's full row is one microbatch, right-padded to
    a multiple of `row_multiple` (None: `row_multiple_for` the model, as stock Megatron needs
    under sequence parallelism). `model`: a module, or the rank's model chunks (virtual pipeline
    stages: Megatron's interleaved schedule, each chunk reading its own copy of the rows).
    `packing`: a reuse plan whose microbatches the dense microbatches mirror
    (`dense_packed_items`: the reference of MoE reuse steps)."""
    if parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("dense_step feeds whole rows; stock Megatron at context_parallel_size > "
                         "1 needs each rank's zigzag shard and Transformer Engine's CP attention: "
                         "run the dense reference at CP=1 (reuse steps run CP themselves)")
    if packing is not None:
        if row_multiple not in (None, 1):
            raise ValueError("dense_step(packing=...) pads rows to the microbatch's longest; "
                             "row_multiple is not supported with it")
        return _dense_forward_backward(model, batch, loss_config, forward_only,
                                       lambda: dense_packed_items(batch, packing),
                                       len(packing.microbatches))
    if row_multiple is None:
        models = model if isinstance(model, list) else [model]
        row_multiple = row_multiple_for(get_model_config(models[0]))
    num_rows = sum(len(g.trajectories) for g in batch.groups)
    return _dense_forward_backward(model, batch, loss_config, forward_only,
                                   lambda: dense_items(batch, row_multiple), num_rows)


def _dense_forward_backward(model, batch, loss_config, forward_only, items, num_microbatches):
    models = model if isinstance(model, list) else [model]
    gpt = unwrap_model(models[0])
    forward_step_func = make_policy_forward_step(loss_config)
    checks = StepChecks(models[0])  # [Note: agreed refusal] in agreement.py
    checks.run(validate_batch, batch, max_seq_len=gpt.max_sequence_length, vocab_size=gpt.vocab_size)
    checks.run(forward_step_func.check_batch, batch)
    agree_on_dense_step(checks, batch, num_microbatches)
    with megatron_patches.use_prefix_reuse_schedule(False):
        forward_backward = get_forward_backward_func()
    reports = forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=[items() for _ in models] if len(models) > 1 else items(),
        model=models,
        num_microbatches=num_microbatches,
        seq_length=0,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return _summarise(reports)


def agree_on_dense_step(checks: StepChecks, batch: Optional[GroupBatch],
                        num_microbatches: int) -> None:
    """The agreement point of a dense step (Megatron's stock schedule has none): the checks of
    every rank, the same rows on the ranks of a data-parallel replica, and with expert
    parallelism equal microbatch counts (each MoE layer exchanges tokens among the
    expert-parallel ranks in every forward and backward). `batch`: None if a check failed."""
    replica = None if batch is None or not checks.ok else fingerprint(repr((
        num_microbatches, batch_digest(batch), [(g.context_len(t), tr.suffix.numel())
                                                for g in batch.groups
                                                for t, tr in enumerate(g.trajectories)])))
    checks.agree(num_microbatches, replica=replica, mismatch=lambda values: (
        f"the expert-parallel ranks' dense steps have {values} microbatches: "
        "expert parallelism exchanges tokens in every MoE layer, so every expert-parallel rank "
        "needs the same number; give each rank groups of the same shapes (synthetic data: "
        "--rl-synthetic-uniform-groups)"))


def reuse_step(model, batch: GroupBatch, plan: StepPlan, loss_config: PolicyLossConfig,
               forward_only: bool = False, step: Optional[ReuseStep] = None) -> StepResult:
    """Prefix-reuse step through `get_forward_backward_func()` with reuse selected (`model`: a
    module, or the rank's model chunks). `step`: a ReuseStep built from this very `batch` and
    `plan` (else ValueError)."""
    if step is not None and (step.batch is not batch or step.plan is not plan):
        raise ValueError("reuse_step(step=...) got a ReuseStep built from another batch or plan; "
                         "pass the batch and plan it was built from, or leave step=None")
    models = model if isinstance(model, list) else [model]
    if step is None:
        try:
            step = ReuseStep(batch, plan,
                             num_stages=parallel_state.get_pipeline_model_parallel_world_size(),
                             num_model_chunks=len(models),
                             cp_group=context_parallel_group(get_model_config(models[0])))
        except ValueError as error:  # the other ranks wait at the executor's agreement point
            refuse_step(models[0], error)
    with megatron_patches.use_prefix_reuse_schedule():
        forward_backward = get_forward_backward_func()
    reports = forward_backward(
        forward_step_func=make_policy_forward_step(loss_config),
        data_iterator=step,
        model=models,
        num_microbatches=step.num_microbatches,
        seq_length=0,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return _summarise(reports)


def prepare_for_training(model, *, ddp: bool):
    """Loss-token normalisation for a built model: un-wrapped with `scale_grads_by_token_count`
    (tensor/pipeline parallel, one replica), or Megatron's DDP wrapper with its
    `finalize_model_grads` and `no_sync` (data parallel). Returns the model to train."""
    if not ddp:
        _check_plain_finalize(model.config)
        model.config.finalize_model_grads_func = scale_grads_by_token_count
        return model
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = model.no_sync
    return model


def zero_grads(model) -> None:
    """Clear gradients, including a DDP wrapper's main_grad buffers."""
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    model.zero_grad(set_to_none=True)


def param_grads(model) -> Dict[str, torch.Tensor]:
    """name -> gradient (main_grad for DDP-wrapped models), cloned, fp32."""
    grads = {}
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        grads[name] = torch.zeros_like(p, dtype=torch.float32) if g is None else g.detach().float().clone()
    return grads


def _check_comparable(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> None:
    """The two sides name the same tensors with the same shapes (a missing gradient is a bug)."""
    missing, extra = sorted(set(reference) - set(other)), sorted(set(other) - set(reference))
    if missing or extra:
        raise ValueError(f"cannot compare: names only in the reference {missing[:5]}, "
                         f"only in the other side {extra[:5]}")
    for name, ref in reference.items():
        if tuple(ref.shape) != tuple(other[name].shape):
            raise ValueError(f"cannot compare {name!r}: shapes {tuple(ref.shape)} vs "
                             f"{tuple(other[name].shape)}")


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def max_relative_diff(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a-b| / max|a| (the equivalence metric of the test suite).

    [Note: non-finite comparisons] A NaN or inf entry on EITHER side makes the result `inf`, so
    every `diff <= tol` check fails and every `max(...)` fold keeps it (Python's `max(0.0, nan)`
    is 0.0: a NaN must never reach a fold). Names and shapes must match on both sides."""
    _check_comparable(reference, other)
    worst = 0.0
    for name, ref in reference.items():
        a, b = ref.detach().double(), other[name].detach().double()
        if not _all_finite(a, b):
            return math.inf
        scale = a.abs().max().item() if a.numel() else 0.0
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def max_elementwise_error(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor],
                          floor: float = 1e-3) -> float:
    """max over tensors and entries of |a-b| / max(|a|, floor * max|a|).

    Unlike `max_relative_diff` a wrong small entry cannot hide under the tensor's largest one:
    entries above `floor` of the tensor's scale are judged relative to themselves, smaller ones
    relative to that floor (below it fp32 rounding of the large entries dominates).
    Non-finite entries on either side give `inf` ([Note: non-finite comparisons])."""
    _check_comparable(reference, other)
    worst = 0.0
    for name, ref in reference.items():
        a, b = ref.detach().double(), other[name].detach().double()
        if not _all_finite(a, b):
            return math.inf
        if a.numel() == 0:
            continue
        scale = a.abs().max()
        if scale == 0:
            worst = max(worst, (b.abs().max()).item())
            continue
        denom = torch.clamp(a.abs(), min=floor * scale)
        worst = max(worst, ((a - b).abs() / denom).max().item())
    return worst


def missing_grads(**sides: Dict[str, torch.Tensor]) -> List[str]:
    """`"side: name"` of every gradient that is all zero or holds a NaN/inf entry, on any of
    the named `sides` (e.g. `missing_grads(dense=..., reuse=...)`): a parameter the step never
    reached, or a broken step ([Note: non-finite comparisons]). Empty list: all present."""
    return [f"{side}: {name}" for side, grads in sides.items() for name, g in grads.items()
            if not (bool(torch.count_nonzero(g)) and _all_finite(g))]


def worst_of(*values: Optional[float]) -> float:
    """The largest of `values` (None skipped), `inf` if any is NaN or inf: Python's
    `max(0.0, nan)` is 0.0, so a fold over metrics must never meet a NaN
    ([Note: non-finite comparisons])."""
    present = [float(v) for v in values if v is not None]
    if not all(math.isfinite(v) for v in present):
        return math.inf
    return max(present, default=0.0)
