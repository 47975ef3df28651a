"""Megatron forward-backward function for prefix reuse: walks the schedule, never decides order.

`forward_backward_prefix_reuse` has the signature of Megatron's own schedule functions, so a
training loop selects it through `get_forward_backward_func()` (see `use_prefix_reuse_schedule`)
and calls it the same way, with a `prefix_schedule.ReuseStep` as `data_iterator`. This rank runs
its row of the step's lowered schedule; each action kind has one handler, built on Megatron's
`forward_step` / `backward_step`, with all p2p traffic in megatron_patches/p2p.py.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from prefix_schedule.runtime.context import active_context
from prefix_schedule.pipeline import Action, ActionKind
from prefix_schedule.runtime.step import ReuseStep

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, unwrap_model

from megatron_patches.cpu_support import cpu_support_enabled, refuse_with_nccl
from megatron_patches.p2p import PipelineP2P, Received
from megatron_patches.schedule_parts import (GradSync, StopAtPrefixEnd, autograd_backward,
                                             model_device)

__all__ = ["forward_backward_prefix_reuse", "check_reuse_supported"]

K = ActionKind
_BACKWARD = (K.SUFFIX_BACKWARD, K.PREFIX_BACKWARD)


def check_reuse_supported(config, step, num_microbatches, model=None) -> None:
    """ValueErrors, before any compute, for settings where reuse would not equal dense."""
    if cpu_support_enabled():
        refuse_with_nccl()  # the CPU layer must never meet a GPU job
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
    if config.context_parallel_size > 1:
        raise ValueError("prefix reuse does not support context parallelism yet; set "
                         "context_parallel_size=1")
    if config.multi_latent_attention:
        raise ValueError("prefix reuse does not hook multi-latent attention (MLA) yet")
    position_embedding = (getattr(unwrap_model(model), "position_embedding_type", "rope")
                          if model is not None else "rope")
    if position_embedding not in ("rope", "learned_absolute", "none"):
        raise ValueError(
            f"position_embedding_type={position_embedding!r}: only 'rope' (and learned absolute "
            "positions) continue at the prefix length in reuse steps; yarn / mrope are not hooked")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp != step.schedule.num_stages:
        raise ValueError(
            f"the step was planned for {step.schedule.num_stages} pipeline stage(s) but the "
            f"pipeline size is {pp}; build it with ReuseStep(batch, plan, num_stages={pp})"
        )
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() not in (None, 1):
        raise ValueError("prefix reuse does not support virtual pipeline stages yet")
    _check_sequence_parallel_rows(config, step)
    _check_deferred_embedding_wgrad(config, step)


def _check_deferred_embedding_wgrad(config, step) -> None:
    # Megatron's drain (utils.drain_embedding_wgrad_compute) pairs the output layer's buffered
    # inputs (appended per forward) with its buffered output gradients (per backward) in order.
    if not config.defer_embedding_wgrad_compute:
        return
    last_row = step.lowered.actions[-1]
    forwards = [a.index for a in last_row if a.kind is K.SUFFIX_FORWARD]
    backwards = [a.index for a in last_row if a.kind is K.SUFFIX_BACKWARD]
    if forwards != backwards:
        raise ValueError(
            "defer_embedding_wgrad_compute pairs the last stage's suffix forwards and backwards "
            f"in order, but this plan runs forwards {forwards} and backwards {backwards}; turn "
            "defer_embedding_wgrad_compute off for this plan")


def _check_sequence_parallel_rows(config, step) -> None:
    # Sequence parallelism scatters every row along the sequence over the TP ranks (the attention
    # hook still sees full-sequence q/k/v: the QKV projection gathers them first).
    tp = config.tensor_model_parallel_size
    if not config.sequence_parallel or tp == 1:
        return
    chunked = step.plan.prefix_chunk_tokens is not None
    rows = [(f"prefix chunk {c.chunk} of group {c.group}" if chunked
             else f"the cached prefix of group {c.group}", c.length)
            for c in step.plan.prefix_units().values()]
    rows += [(f"suffix microbatch {mb.index}", mb.num_tokens) for mb in step.plan.microbatches]
    for what, length in rows:
        if length % tp:
            raise ValueError(
                f"sequence_parallel=True splits every row over the {tp} tensor-parallel ranks, but "
                f"{what} has {length} tokens, not a multiple of {tp}; rows are not padded yet: "
                "turn sequence_parallel off, or use prompts and a token budget that keep every "
                f"row length a multiple of {tp}"
            )


class _StageRunner:
    """One step on one pipeline rank: the state that flows between this rank's actions."""

    def __init__(self, *, step, model, forward_step_func, config, pg_collection,
                 collect_non_loss_data, forward_only, first_val_step):
        self.step, self.model, self.config = step, model, config
        self.forward_step_func = forward_step_func
        self.cp_size = pg_collection.cp.size()
        self.tp_size = pg_collection.tp.size()
        self.collect_non_loss_data = collect_non_loss_data
        self.forward_only, self.first_val_step = forward_only, first_val_step
        self.is_first = parallel_state.is_pipeline_first_stage()
        self.is_last = parallel_state.is_pipeline_last_stage()
        self.prev_rank = (None if self.is_first
                          else parallel_state.get_pipeline_model_parallel_prev_rank())
        self.next_rank = (None if self.is_last
                          else parallel_state.get_pipeline_model_parallel_next_rank())
        self.device = model_device(model)  # everything created here lives on it
        self.p2p = PipelineP2P(group=parallel_state.get_pipeline_model_parallel_group(),
                               rank=torch.distributed.get_rank(),
                               dtype=config.pipeline_dtype or config.params_dtype,
                               device=self.device)
        self.grad_sync = GradSync(config, model)
        # Megatron's schedules: torch.zeros([], dtype=torch.int, device="cuda"); all-reduced
        # over NCCL by finalize_model_grads, so it must live where the model does.
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.deallocate = config.deallocate_pipeline_outputs and not forward_only
        self.backward_fn = autograd_backward if self.deallocate else torch.autograd.backward
        self.forward_data_store: List = []
        self.num_forwards = 0
        # (kind of the work, index) -> tensors (or posted receives) in flight on this rank
        self.inputs: Dict[tuple, object] = {}
        self.outputs: Dict[tuple, torch.Tensor] = {}
        self.output_grads: Dict[tuple, object] = {}
        self.input_grads: Dict[tuple, Optional[torch.Tensor]] = {}
        self.handlers = {
            K.PREFIX_FORWARD: self.prefix_forward, K.SUFFIX_FORWARD: self.suffix_forward,
            K.SUFFIX_BACKWARD: self.suffix_backward, K.PREFIX_BACKWARD: self.prefix_backward,
            K.RECV_PREFIX_FORWARD: self.recv_forward, K.RECV_SUFFIX_FORWARD: self.recv_forward,
            K.SEND_PREFIX_FORWARD: self.send_forward, K.SEND_SUFFIX_FORWARD: self.send_forward,
            K.RECV_PREFIX_BACKWARD: self.recv_backward, K.RECV_SUFFIX_BACKWARD: self.recv_backward,
            K.SEND_PREFIX_BACKWARD: self.send_backward, K.SEND_SUFFIX_BACKWARD: self.send_backward,
            K.REDUCE_GRAD: lambda action: self.grad_sync.start(),
        }

    # ---- shapes (every rank derives them from the shared plan; nothing is exchanged)
    def _hidden_shape(self, action: Action):
        work = action.kind.compute
        rows = (self.step.prefix_length(action.index) if work in (K.PREFIX_FORWARD,
                                                                  K.PREFIX_BACKWARD)
                else self.step.microbatch_length(action.index))
        if self.config.sequence_parallel:  # as schedules.get_tensor_shapes: rows / TP per rank
            rows //= self.tp_size
        return (rows, 1, self.config.hidden_size)

    @staticmethod
    def _key(action: Action) -> tuple:
        prefix = action.kind.compute in (K.PREFIX_FORWARD, K.PREFIX_BACKWARD)
        return ("prefix" if prefix else "suffix", action.index)

    @staticmethod
    def _arrived(store: Dict[tuple, object], key: tuple, pop: bool = False):
        """The tensor under `key`, waiting for its receive if it was one."""
        value = store.pop(key, None) if pop else store.get(key)
        if isinstance(value, Received):
            value = value.wait()
            if not pop:
                store[key] = value
        return value

    def _is_first_forward(self) -> bool:
        """Megatron's `is_first_microbatch` (FP8 weight casts): the step's first forward on
        this rank, prefix or suffix."""
        first = self.num_forwards == 0
        self.num_forwards += 1
        return schedules.check_first_val_step(self.first_val_step, self.forward_only, first)

    # ---- p2p handlers
    def recv_forward(self, action):
        self.inputs[self._key(action)] = self.p2p.recv(self._hidden_shape(action), self.prev_rank,
                                                       str(action), requires_grad=True)

    def send_forward(self, action):
        output = self.outputs[self._key(action)]
        self.p2p.send(output, self.next_rank, str(action))
        schedules.deallocate_output_tensor(output, self.deallocate)  # as Megatron after a send

    def recv_backward(self, action):
        self.output_grads[self._key(action)] = self.p2p.recv(
            self._hidden_shape(action), self.next_rank, str(action), requires_grad=False)

    def send_backward(self, action):
        self.p2p.send(self.input_grads.pop(self._key(action)), self.prev_rank, str(action))

    # ---- compute handlers
    def prefix_forward(self, action):
        step, config, key = self.step, self.config, self._key(action)
        step.prepare(action)
        stop = config.num_layers if self.is_last else None
        # Dormant prefix activations (needed again only in Phase C) can live in host memory.
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
                   if step.offload_prefix_activations else contextlib.nullcontext())
        with active_context(step.prefix_context(action.index, stop_after_layer=stop)), offload:
            # Megatron's forward_step: first-microbatch flag (FP8 casts), input tensor, autocast
            output, _ = schedules.forward_step(
                StopAtPrefixEnd(self.forward_step_func), step, self.model,
                step.num_microbatches, self._arrived(self.inputs, key), [], config,
                self.cp_size, is_first_microbatch=self._is_first_forward(),
                is_last_stage=False)  # no loss on a prefix row
        step.finish_forward()  # a rank may leave the item unread (TP ranks > 0 in get_batch)
        assert (output is None) == self.is_last, (
            f"{action}: the prefix forward must stop at the last layer's K/V exactly on the "
            "last stage")
        if output is not None:
            self.outputs[key] = output

    def suffix_forward(self, action):
        step, key = self.step, self._key(action)
        step.prepare(action)
        with active_context(step.suffix_context(action.index)):
            output, num_tokens = schedules.forward_step(
                self.forward_step_func, step, self.model, step.num_microbatches,
                self._arrived(self.inputs, key), self.forward_data_store, self.config,
                self.cp_size, self.collect_non_loss_data,
                is_first_microbatch=self._is_first_forward(), current_microbatch=action.index,
                is_last_stage=self.is_last,
            )
        step.finish_forward()  # a rank may leave the item unread (TP ranks > 0 in get_batch)
        self.total_num_tokens += num_tokens
        self.outputs[key] = output

    def suffix_backward(self, action):
        key = self._key(action)
        with active_context(self.step.suffix_context(action.index)):
            grad = schedules.backward_step(self.inputs.pop(key, None), self.outputs.pop(key),
                                           self._arrived(self.output_grads, key, pop=True),
                                           self.config)
        if not self.is_first:
            self.input_grads[key] = grad
        self.step.release_microbatch(action.index)

    def prefix_backward(self, action):
        step, key = self.step, self._key(action)
        input_tensor = self.inputs.pop(key, None)
        ctx = step.prefix_context(action.index, stop_after_layer=None, recomputing=True)
        unit = step.prefix_unit(action.index)
        with active_context(ctx):
            step.cache.backward(unit.group, chunk=unit.chunk, output=self.outputs.pop(key, None),
                                output_grad=self._arrived(self.output_grads, key, pop=True),
                                backward_fn=self.backward_fn)
        if not self.is_first:
            self.input_grads[key] = input_tensor.grad

    def run(self, actions: List[Action]) -> None:
        """Execute `actions` in order (all backwards under no_sync until REDUCE_GRAD)."""
        self.grad_sync.disable()
        try:
            for action in actions:
                self.handlers[action.kind](action)
                self.p2p.release_completed()
            self.p2p.wait_all()
        finally:
            self.grad_sync.enable()
        if self.forward_only:
            self.outputs.clear()
        assert not (self.outputs or self.output_grads or self.input_grads), (
            "tensors left in flight after the step: the schedule and the executor disagree")


def forward_backward_prefix_reuse(*, forward_step_func, data_iterator, model, num_microbatches,
                                  seq_length=None, micro_batch_size=None,
                                  decoder_seq_length=None, forward_only=False,
                                  collect_non_loss_data=False, first_val_step=None,
                                  adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                  pg_collection=None, force_all_reduce=False):
    """Run one prefix-reuse step (Phases A, B, C interleaved as the step's schedule says).

    Same contract as Megatron's schedule functions: returns the list of what the loss function
    reported per suffix microbatch (last stage), and calls `config.finalize_model_grads_func`
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
    check_reuse_supported(config, step, num_microbatches, model)
    if pg_collection is None:
        pg_collection = schedules._build_default_pg_collection()

    rank = parallel_state.get_pipeline_model_parallel_rank()
    actions = list(step.lowered.actions[rank])
    if forward_only:
        actions = [a for a in actions if a.kind.is_forward]
    finalize = config.finalize_model_grads_func is not None and not forward_only
    runner = _StageRunner(step=step, model=model, forward_step_func=forward_step_func,
                          config=config, pg_collection=pg_collection,
                          collect_non_loss_data=collect_non_loss_data,
                          forward_only=forward_only, first_val_step=first_val_step)
    embedding = (schedules.clear_embedding_activation_buffer(config, model, runner.is_last)
                 if finalize else None)
    runner.run(actions)
    for group in step.cache.live_groups():  # forward-only steps keep nothing
        assert forward_only, f"group {group}: prefix cache left after a training step"
        step.cache.free(group)

    if finalize:
        # deferred output-layer weight gradients (defer_embedding_wgrad_compute), as Megatron
        schedules.finish_embedding_wgrad_compute(config, embedding, runner.is_last,
                                                 pg_collection.tp)
        config.finalize_model_grads_func(
            [model],
            runner.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    return runner.forward_data_store
