"""Megatron forward-backward function for prefix reuse: walks the schedule, never decides order.

`forward_backward_prefix_reuse` has the signature of Megatron's own schedule functions, so a
training loop selects it through `get_forward_backward_func()` (see `use_prefix_reuse_schedule`)
and calls it the same way, with a `prefix_schedule.ReuseStep` as `data_iterator`. Each action of
this rank's list goes to one handler built on Megatron's `forward_step` / `backward_step`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List

import torch

from prefix_schedule.context import PrefixForwardDone, active_context
from prefix_schedule.schedule import Action, ActionKind
from prefix_schedule.step import ReuseStep

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_attr_wrapped_model, get_model_config

__all__ = ["forward_backward_prefix_reuse", "check_reuse_supported"]


def check_reuse_supported(config, step, num_microbatches) -> None:
    """ValueErrors, before any compute, for settings where reuse would not equal dense."""
    if not isinstance(step, ReuseStep):
        raise ValueError(
            "the prefix-reuse schedule needs a prefix_schedule.ReuseStep as data_iterator "
            f"(got {type(step).__name__}); build one with ReuseStep(batch, plan)"
        )
    if num_microbatches is not None and num_microbatches != step.num_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} but the step plan has {step.num_microbatches} "
            "suffix microbatches; pass num_microbatches=step.num_microbatches"
        )
    if not config.calculate_per_token_loss:
        raise ValueError(
            "prefix reuse needs calculate_per_token_loss=True (a token mean over the global batch "
            "that does not depend on how groups are packed into microbatches)"
        )
    if config.hidden_dropout > 0 or config.attention_dropout > 0:
        raise ValueError(
            "dropout > 0: dense training draws a prefix dropout mask per trajectory, reuse one per "
            "group, so they are different estimators; set hidden_dropout=attention_dropout=0"
        )
    if getattr(config, "num_moe_experts", None):
        raise ValueError("MoE needs logical prefix-token accounting, not supported yet")
    if config.recompute_granularity == "full":
        raise ValueError(
            "recompute_granularity='full' would drop the prefix K/V graph of Phase A; use "
            "'selective' recompute or none"
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp != step.schedule.num_stages or pp != 1:
        raise ValueError(
            f"pipeline size {pp}: this executor runs single-stage schedules "
            f"(the step was planned for {step.schedule.num_stages} stage(s))"
        )


def _run_prefix_forward(step, action, model, forward_step_func, config) -> None:
    stop = config.num_layers if parallel_state.is_pipeline_last_stage() else None
    step.prepare(action)
    get_attr_wrapped_model(model, "set_input_tensor")([None])
    autocast = (torch.autocast("cuda", dtype=config.autocast_dtype) if config.enable_autocast
                else contextlib.nullcontext())
    with active_context(step.prefix_context(action.index, stop_after_layer=stop)), autocast:
        try:
            forward_step_func(step, model)
        except PrefixForwardDone:
            pass
        else:
            raise AssertionError("the prefix forward did not reach the last layer's K/V")
    assert step.taken(), "forward_step_func must take its item with next(data_iterator)"


def forward_backward_prefix_reuse(*, forward_step_func, data_iterator, model, num_microbatches,
                                  seq_length=None, micro_batch_size=None,
                                  decoder_seq_length=None, forward_only=False,
                                  collect_non_loss_data=False, first_val_step=None,
                                  adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                  pg_collection=None, force_all_reduce=False):
    """Run one prefix-reuse step (Phases A, B, C interleaved as the step's schedule says).

    Same contract as Megatron's `forward_backward_no_pipelining`: returns the list of what the
    loss function reported per suffix microbatch, and calls `config.finalize_model_grads_func`
    with the step's total loss-token count.
    """
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("prefix reuse does not support virtual pipeline model chunks yet")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    step: ReuseStep = data_iterator
    config = get_model_config(model)
    check_reuse_supported(config, step, num_microbatches)
    if pg_collection is None:
        pg_collection = schedules._build_default_pg_collection()

    actions = list(step.schedule.actions[0])
    if forward_only:
        actions = [a for a in actions if a.kind in (ActionKind.PREFIX_FORWARD,
                                                     ActionKind.SUFFIX_FORWARD)]
    last_backward = max((i for i, a in enumerate(actions)
                         if a.kind in (ActionKind.SUFFIX_BACKWARD, ActionKind.PREFIX_BACKWARD)),
                        default=-1)
    no_sync = config.no_sync_func or contextlib.nullcontext
    forward_data_store: List = []
    outputs: Dict[int, torch.Tensor] = {}
    total_num_tokens = torch.zeros([], dtype=torch.int)
    num_forwards = 0

    for i, action in enumerate(actions):
        sync = contextlib.nullcontext() if i == last_backward else no_sync()
        if action.kind is ActionKind.PREFIX_FORWARD:
            _run_prefix_forward(step, action, model, forward_step_func, config)
        elif action.kind is ActionKind.SUFFIX_FORWARD:
            step.prepare(action)
            with active_context(step.suffix_context(action.index)):
                output, num_tokens = schedules.forward_step(
                    forward_step_func, step, model, step.num_microbatches, None,
                    forward_data_store, config, pg_collection.cp.size(), collect_non_loss_data,
                    is_first_microbatch=num_forwards == 0, current_microbatch=action.index,
                )
            assert step.taken(), "forward_step_func must take its item with next(data_iterator)"
            num_forwards += 1
            total_num_tokens += num_tokens
            outputs[action.index] = output
        elif action.kind is ActionKind.SUFFIX_BACKWARD:
            with sync, active_context(step.suffix_context(action.index)):
                schedules.backward_step(None, outputs.pop(action.index), None, config)
            step.release_microbatch(action.index)
        elif action.kind is ActionKind.PREFIX_BACKWARD:
            stop = config.num_layers
            ctx = step.prefix_context(action.index, stop_after_layer=stop, recomputing=True)
            with sync, active_context(ctx):
                step.cache.backward(action.index)
        else:
            raise AssertionError(f"{action}: no handler for {action.kind}")

    for group in step.cache.live_groups():  # forward-only steps keep nothing
        assert forward_only, f"group {group}: prefix cache left after a training step"
        step.cache.free(group)

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model],
            total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    return forward_data_store
