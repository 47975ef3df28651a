"""The RL training loop of the Megatron-LM entry point, on `megatron.training`'s building blocks.

`pretrain()` is not used: it fixes the number of microbatches per step (`get_num_microbatches()`),
while an RL step's count follows its data (and the prefix-reuse plan). Everything else is
Megatron-LM's: `parse_and_validate_args` with our `extra_args_provider`, `initialize_megatron`,
`setup_model_and_optimizer` (model provider, DDP, optimizer, LR scheduler, `--load`),
`save_checkpoint` (`--save`, `--save-interval`, `--ckpt-format`), `training_log` (log lines,
tensorboard) and the timers.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

import torch

import megatron_patches
from megatron_patches.runtime.agreement import StepChecks
from megatron_patches.runtime.finite_grads import agree_finite_grads
from megatron_patches.megatron_lm.data import StepSource, check_moe_tensor_parallel_rows

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config
from megatron.training import get_args, get_timers, print_rank_0
from megatron.training.checkpointing import save_checkpoint
from megatron.training.training import training_log

from prefix_schedule import GroupBatch, PolicyLossConfig, ReuseStep, plan_microbatches
from prefix_schedule.planning.placement import place_groups

__all__ = ["loss_config_from_args", "forward_step_from_args", "configure_step_functions",
           "train", "train_step", "nothing_to_train"]


def loss_config_from_args(args) -> PolicyLossConfig:
    """Megatron-LM's GRPO arguments as our loss configuration (k3 KL, as megatron/rl)."""
    return PolicyLossConfig(clip_eps_low=args.grpo_clamp_eps_lower,
                            clip_eps_high=args.grpo_clamp_eps_upper, kl_coef=args.grpo_kl_beta,
                            kl_estimator="k3", entropy_coef=args.rl_entropy_coef)


def _local_batch(args, batch: GroupBatch, row_multiple: int) -> GroupBatch:
    placement = place_groups(batch, dp_size=ps.get_data_parallel_world_size(),
                             token_budget=_token_budget(args), max_seq_len=args.seq_length,
                             row_multiple=row_multiple)
    if args.num_experts and args.tensor_model_parallel_size > 1:
        for rank, placed in enumerate(placement.ranks):  # every rank checks all: none waits
            check_moe_tensor_parallel_rows(_plan(args, placed.batch, row_multiple),
                                            placed.batch, args.tensor_model_parallel_size, rank)
    return placement.ranks[ps.get_data_parallel_rank()].batch


def _token_budget(args) -> int:
    return args.prefix_reuse_token_budget or args.seq_length


def _plan(args, local: GroupBatch, row_multiple: int):
    return plan_microbatches(local, token_budget=_token_budget(args), max_seq_len=args.seq_length,
                             prefix_chunk_tokens=args.prefix_chunk_tokens,
                             row_multiple=row_multiple)


def _data(args, local: GroupBatch, row_multiple: int, num_model_chunks: int):
    """(data iterator, number of microbatches, number of loss microbatches) of this rank's step."""
    if not args.prefix_reuse:
        from megatron_patches.training import dense_items, dense_packed_items

        if args.num_experts:  # router statistics are per microbatch: the packing reuse equals
            plan = _plan(args, local, row_multiple)
            items, count = (lambda: dense_packed_items(local, plan)), len(plan.microbatches)
        else:
            items = lambda: dense_items(local, row_multiple)  # noqa: E731
            count = sum(len(g.trajectories) for g in local.groups)
        if num_model_chunks > 1:  # Megatron's interleaved schedule: one iterator per chunk
            return [items() for _ in range(num_model_chunks)], count, count
        return items(), count, count
    from megatron_patches.training import context_parallel_group

    cp_group = context_parallel_group()
    if cp_group is not None:  # the CP layout pads each rank's local row itself
        cp_group.row_multiple, row_multiple = row_multiple, 1
    plan = _plan(args, local, row_multiple)
    step = ReuseStep(local, plan, num_stages=ps.get_pipeline_model_parallel_world_size(),
                     num_model_chunks=num_model_chunks,
                     offload_prefix_activations=args.prefix_reuse_offload_prefix_activations,
                     cp_group=cp_group)
    return step, step.num_microbatches, len(plan.microbatches)


def _agreed_data(args, model, checks: StepChecks, batch: GroupBatch, row_multiple: int):
    """`_data` of this rank's part of `batch`, or StepRefused on every rank if any rank's data
    path refused its step ([Note: agreed refusal] in megatron_patches/runtime/agreement.py): reuse steps
    agree in the executor (a rank that failed here joins it), dense steps here (Megatron's stock
    schedule checks nothing), with equal microbatch counts on the expert-parallel ranks."""
    local = checks.run(_local_batch, args, batch, row_multiple)
    data = checks.run(_data, args, local, row_multiple, len(model))
    if args.prefix_reuse:
        if not checks.ok:
            checks.agree()  # raises on every rank, those waiting in the executor's checks too
        return data
    from megatron.core.utils import unwrap_model

    from megatron_patches.training import agree_on_dense_step

    if checks.ok:  # what the reuse executor checks: token ids and lengths against the model
        gpt = unwrap_model(model[0])
        checks.run(local.validate, max_seq_len=gpt.max_sequence_length, vocab_size=gpt.vocab_size)
    agree_on_dense_step(checks, local, data[1] if checks.ok else 0)
    return data


def _rescale_moe_metrics(num_loss_microbatches: int) -> None:
    """Megatron's training_log averages the MoE metrics (aux losses) over
    `get_num_microbatches()` microbatches, a count fixed by --global-batch-size; an RL step runs
    as many microbatches as its data needs: rescale so the log shows the mean over the step's
    own microbatches (the same for dense and reuse: reuse records once per suffix microbatch)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    scale = get_num_microbatches() / max(num_loss_microbatches, 1)
    for entry in get_moe_metrics_tracker().metrics.values():
        entry.values.mul_(scale)


def _reduce_reports(reports: List[dict]) -> Dict[str, torch.Tensor]:
    """Token-weighted means over microbatches and data-parallel ranks (last stage only), as
    Megatron's train_step reduces its `(sum, count)` report pairs."""
    if not ps.is_pipeline_last_stage(ignore_virtual=True) or not reports:
        return {}
    reduced = {}
    for key in reports[0]:
        pair = torch.stack([r[key].view(-1).double() for r in reports]).sum(dim=0)
        torch.distributed.all_reduce(
            pair, group=ps.get_data_parallel_group(with_context_parallel=True))
        reduced["policy loss" if key == "loss" else key] = (pair[0] / pair[1].clamp(min=1)).float()
    return reduced


def train_step(args, model, optimizer, scheduler, batch: GroupBatch, forward_step_func,
               checks: Optional[StepChecks] = None):
    """One RL step: forward-backward (dense or reuse), optimizer, LR scheduler. Runs under
    Megatron's rerun state machine like `train_step` (a rerun rebuilds the step's data).
    Non-finite gradients stop the step on every rank before the optimizer, naming the iteration
    and the parameter (megatron_patches/runtime/finite_grads.py; under fp16 with dynamic loss scaling
    Megatron's optimizer skips such a step and lowers the scale instead).
    `checks`: the step's checks so far (reading `batch` may have failed: it is then None)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    config = get_model_config(model[0])
    row_multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    checks = StepChecks(model[0]) if checks is None else checks
    rerun_state_machine = get_rerun_state_machine()
    while rerun_state_machine.should_run_forward_backward(None):
        reports = _forward_backward(args, model, optimizer, checks, batch, row_multiple,
                                    forward_step_func)
    should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:
        raise SystemExit(exit_code)  # the state machine has logged why
    if not (args.fp16 and not args.loss_scale):  # dynamic loss scaling skips inf steps itself
        agree_finite_grads(model, step=args.iteration)  # [Note: non-finite gradients stop ...]
    update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return _reduce_reports(reports), int(not update_successful), grad_norm, num_zeros


def _forward_backward(args, model, optimizer, checks, batch, row_multiple, forward_step_func):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    data, num_microbatches, num_loss_microbatches = _agreed_data(args, model, checks, batch,
                                                                 row_multiple)
    with megatron_patches.use_prefix_reuse_schedule(args.prefix_reuse):
        forward_backward = get_forward_backward_func()
    timers = get_timers()
    timers("forward-backward", log_level=1).start(barrier=args.barrier_with_L1_time)
    reports = forward_backward(forward_step_func=forward_step_func, data_iterator=data,
                               model=model, num_microbatches=num_microbatches, seq_length=0,
                               micro_batch_size=1, forward_only=False)
    timers("forward-backward").stop()
    if args.num_experts:
        _rescale_moe_metrics(num_loss_microbatches)
    return reports


def _dump_params(args, model, iteration: int, with_grads: bool = False) -> None:
    from safetensors.torch import save_file

    directory = os.path.join(args.prefix_reuse_dump_params, f"iter_{iteration}")
    os.makedirs(directory, exist_ok=True)
    tensors = {f"{i}.{name}": p.detach().float().contiguous().clone()
               for i, chunk in enumerate(model) for name, p in chunk.named_parameters()}
    if with_grads:  # the step's reduced gradients (DDP's main_grad), as the optimizer used them
        tensors.update({f"grad.{i}.{name}": p.main_grad.detach().float().contiguous().clone()
                        for i, chunk in enumerate(model) for name, p in chunk.named_parameters()
                        if getattr(p, "main_grad", None) is not None})
    save_file(tensors, os.path.join(directory, f"rank_{torch.distributed.get_rank()}.safetensors"))


def _learning_rate(optimizer) -> float:
    return max(group["lr"] for group in optimizer.param_groups)


def configure_step_functions(args, model, optimizer) -> None:
    """The config hooks Megatron-LM's `train()` installs before its loop (same conditions):
    loss scaling, timers, DDP no_sync / grad sync / param sync, and `finalize_model_grads`
    (data-parallel and TP-replicated gradient reduction, and the division by the loss-token
    count under --calculate-per-token-loss)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    single = len(model) == 1
    if isinstance(model[0], DistributedDataParallel) and args.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model]
        config.no_sync_func = config.no_sync_func[0] if single else config.no_sync_func
        if args.align_grad_reduce:
            config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
            config.grad_sync_func = config.grad_sync_func[0] if single else config.grad_sync_func
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = config.param_sync_func[0] if single else config.param_sync_func
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads


def train(model, optimizer, scheduler, source: StepSource, checkpointing_context=None) -> int:
    """Run steps `args.iteration` .. `args.train_iters - 1`; returns the last iteration."""
    args = get_args()
    timers = get_timers()
    configure_step_functions(args, model, optimizer)
    forward_step_func = forward_step_from_args(args)
    total_loss_dict: dict = {}
    negative_log: Dict[str, List[float]] = {}
    iteration = start = args.iteration
    saved = False
    mode = "prefix reuse" if args.prefix_reuse else "dense (stock Megatron schedule)"
    print_rank_0(f"> training {mode} from iteration {iteration} to {args.train_iters}")
    if args.prefix_reuse_dump_params:
        _dump_params(args, model, iteration)
    timers("interval-time", log_level=0).start(barrier=True)
    while iteration < args.train_iters:
        checks = StepChecks(model[0])  # reading the step is one of its checks
        batch = checks.run(source.step, iteration)
        loss_dict, skipped, grad_norm, num_zeros = train_step(
            args, model, optimizer, scheduler, batch, forward_step_func, checks)
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += sum(len(g.trajectories) for g in batch.groups)
        if args.prefix_reuse_dump_params:
            _dump_params(args, model, iteration, with_grads=True)
        training_log(loss_dict, total_loss_dict, _learning_rate(optimizer), iteration,
                     optimizer.get_loss_scale().item(), False, skipped, grad_norm, None,
                     num_zeros, None)
        _log_negative_values(args, negative_log, loss_dict, skipped, iteration)
        saved = bool(args.save and args.save_interval and iteration % args.save_interval == 0)
        if saved:
            _save(args, iteration, model, optimizer, scheduler, checkpointing_context)
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"> exiting at iteration {iteration} (--exit-interval)")
            break
    if args.save and iteration > start and not saved:
        _save(args, iteration, model, optimizer, scheduler, checkpointing_context)
    return iteration


def nothing_to_train(args) -> bool:
    """True (and says so on rank 0, on stderr) when the run starts at or past --train-iters:
    a --load checkpoint of a finished run, e.g. a second run into the same --save/--load."""
    if args.iteration < args.train_iters:
        return False
    if torch.distributed.get_rank() == 0:
        where = f"the checkpoint in --load {args.load}" if args.load else "the run"
        verdict = ("--allow-nothing-to-train given: exiting 0" if args.allow_nothing_to_train
                   else "error")
        print(f"\n!!! NOTHING TO TRAIN ({verdict}): {where} is at iteration {args.iteration} "
              f"and --train-iters is {args.train_iters}, so no step runs.\n!!! Give this run its "
              "own --save/--load directory (a new name), or pass --allow-nothing-to-train to "
              "accept a run that trains nothing (e.g. to only --export-hf).\n",
              file=sys.stderr, flush=True)
    return True


def _log_negative_values(args, interval: Dict[str, List[float]], loss_dict, skipped: int,
                         iteration: int) -> None:
    """Megatron's `training_log` prints a loss only when its mean over the log interval is
    >= 0; GRPO's policy loss (and its parts) are often negative. Print those means (the same
    steps Megatron averages: the interval's non-skipped ones) on the rank that logs."""
    from megatron.training.utils import print_rank_last

    if not skipped:
        for key, value in loss_dict.items():
            interval.setdefault(key, []).append(float(value))
    if not args.log_interval or iteration % args.log_interval:
        return
    means = {k: sum(v) / len(v) for k, v in interval.items() if v}
    interval.clear()
    negative = " | ".join(f"{k}: {v:.6E}" for k, v in means.items() if v < 0)
    if negative:
        print_rank_last(f" iteration {iteration:8d}/{args.train_iters:8d} | {negative} | "
                        "(negative: not on Megatron's line above)")


def forward_step_from_args(args):
    from megatron_patches.rl import make_policy_forward_step

    return make_policy_forward_step(loss_config_from_args(args))


def _save(args, iteration, model, optimizer, scheduler, checkpointing_context) -> None:
    timers = get_timers()
    timers("save-checkpoint", log_level=0).start(barrier=True)
    save_checkpoint(iteration, model, optimizer, scheduler,
                    num_floating_point_operations_so_far=0,
                    checkpointing_context=checkpointing_context)
    timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])

