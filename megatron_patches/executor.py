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

from prefix_schedule.runtime.context import PrefixForwardDone, active_context
from prefix_schedule.pipeline import Action, ActionKind
from prefix_schedule.runtime.step import ReuseStep

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model

from megatron_patches.config_support import check_config_supported
from megatron_patches.layers import check_layers_supported, last_kv_layer_number
from megatron_patches.p2p import PipelineP2P

__all__ = ["forward_backward_prefix_reuse", "check_reuse_supported"]

K = ActionKind
_BACKWARD = (K.SUFFIX_BACKWARD, K.PREFIX_BACKWARD)


def check_reuse_supported(config, step, num_microbatches, model=None) -> None:
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
    check_config_supported(config)  # every TransformerConfig field: config_support.py
    if model is not None:  # the data against the model: token ids and lengths
        gpt = unwrap_model(model)
        step.batch.validate(max_seq_len=gpt.max_sequence_length, vocab_size=gpt.vocab_size)
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
    if model is not None:
        check_layers_supported(config, model)  # HybridModel layer kinds, MTP
    _check_sequence_parallel_rows(config, step)


def _check_sequence_parallel_rows(config, step) -> None:
    # Sequence parallelism scatters every row along the sequence over the TP ranks (the attention
    # hook still sees full-sequence q/k/v: the QKV projection gathers them first), so every row
    # must be a multiple of TP: the planner pads them ([Note: row padding] in planner.py).
    tp = config.tensor_model_parallel_size
    if not config.sequence_parallel or tp == 1:
        return
    chunked = step.plan.prefix_chunk_tokens is not None
    rows = [(f"prefix chunk {c.chunk} of group {c.group}" if chunked
             else f"the cached prefix of group {c.group}", step.prefix_length(u))
            for u, c in step.plan.prefix_units().items()]
    rows += [(f"suffix microbatch {mb.index}", step.microbatch_length(mb.index))
             for mb in step.plan.microbatches]
    for what, length in rows:
        if length % tp:
            raise ValueError(
                f"sequence_parallel=True splits every row over the {tp} tensor-parallel ranks, but "
                f"{what} is {length} tokens long, not a multiple of {tp}: plan the step with "
                f"plan_microbatches(..., row_multiple={tp}), which pads every row exactly "
                f"(the plan has row_multiple={step.plan.row_multiple})"
            )


class _StageRunner:
    """One step on one pipeline rank: the state that flows between this rank's actions."""

    def __init__(self, *, step, model, forward_step_func, config, pg_collection,
                 collect_non_loss_data):
        self.step, self.model, self.config = step, model, config
        self.forward_step_func = forward_step_func
        self.pg_collection = pg_collection
        self.collect_non_loss_data = collect_non_loss_data
        self.is_first = parallel_state.is_pipeline_first_stage()
        self.is_last = parallel_state.is_pipeline_last_stage()
        self.p2p = PipelineP2P(
            group=parallel_state.get_pipeline_model_parallel_group(),
            prev_rank=None if self.is_first else parallel_state.get_pipeline_model_parallel_prev_rank(),
            next_rank=None if self.is_last else parallel_state.get_pipeline_model_parallel_next_rank(),
            rank=torch.distributed.get_rank(),
            dtype=config.pipeline_dtype or config.params_dtype,
            device=torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available() else torch.device("cpu"),
        )
        self.forward_data_store: List = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int)
        self.num_forwards = 0
        # (kind of the work, index) -> tensors in flight on this rank
        self.inputs: Dict[tuple, Optional[torch.Tensor]] = {}
        self.outputs: Dict[tuple, torch.Tensor] = {}
        self.output_grads: Dict[tuple, torch.Tensor] = {}
        self.input_grads: Dict[tuple, Optional[torch.Tensor]] = {}
        self.handlers = {
            K.PREFIX_FORWARD: self.prefix_forward, K.SUFFIX_FORWARD: self.suffix_forward,
            K.SUFFIX_BACKWARD: self.suffix_backward, K.PREFIX_BACKWARD: self.prefix_backward,
            K.RECV_PREFIX_FORWARD: self.recv_forward, K.RECV_SUFFIX_FORWARD: self.recv_forward,
            K.SEND_PREFIX_FORWARD: self.send_forward, K.SEND_SUFFIX_FORWARD: self.send_forward,
            K.RECV_PREFIX_BACKWARD: self.recv_backward, K.RECV_SUFFIX_BACKWARD: self.recv_backward,
            K.SEND_PREFIX_BACKWARD: self.send_backward, K.SEND_SUFFIX_BACKWARD: self.send_backward,
            K.REDUCE_GRAD: lambda action: None,  # finalize_model_grads reduces at the end
        }

    # ---- shapes (every rank derives them from the shared plan; nothing is exchanged)
    def _hidden_shape(self, action: Action):
        work = action.kind.compute
        rows = (self.step.prefix_length(action.index) if work in (K.PREFIX_FORWARD,
                                                                  K.PREFIX_BACKWARD)
                else self.step.microbatch_length(action.index))
        return (rows, 1, self.config.hidden_size)

    @staticmethod
    def _key(action: Action) -> tuple:
        prefix = action.kind.compute in (K.PREFIX_FORWARD, K.PREFIX_BACKWARD)
        return ("prefix" if prefix else "suffix", action.index)

    # ---- p2p handlers
    def recv_forward(self, action):
        self.inputs[self._key(action)] = self.p2p.recv_forward(self._hidden_shape(action),
                                                              str(action))

    def send_forward(self, action):
        self.p2p.send_forward(self.outputs[self._key(action)], str(action))

    def recv_backward(self, action):
        self.output_grads[self._key(action)] = self.p2p.recv_backward(self._hidden_shape(action),
                                                                      str(action))

    def send_backward(self, action):
        self.p2p.send_backward(self.input_grads.pop(self._key(action)), str(action))

    # ---- compute handlers
    def prefix_forward(self, action):
        step, config = self.step, self.config
        key = self._key(action)
        step.prepare(action)
        get_attr_wrapped_model(self.model, "set_input_tensor")([self.inputs.get(key)])
        stop = last_kv_layer_number(self.model) if self.is_last else None
        autocast = (torch.autocast("cuda", dtype=config.autocast_dtype)
                    if config.enable_autocast else contextlib.nullcontext())
        # Dormant prefix activations (needed again only in Phase C) can live in host memory.
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                   if step.offload_prefix_activations else contextlib.nullcontext())
        with active_context(step.prefix_context(action.index, stop_after_layer=stop)), autocast, \
                offload:
            try:
                output, _ = self.forward_step_func(step, self.model)
            except PrefixForwardDone:
                output = None
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
                self.inputs.get(key), self.forward_data_store, self.config,
                self.pg_collection.cp.size(), self.collect_non_loss_data,
                is_first_microbatch=self.num_forwards == 0, current_microbatch=action.index,
                is_last_stage=self.is_last,
            )
        step.finish_forward()  # a rank may leave the item unread (TP ranks > 0 in get_batch)
        self.num_forwards += 1
        self.total_num_tokens += num_tokens
        self.outputs[key] = output

    def suffix_backward(self, action):
        key = self._key(action)
        with active_context(self.step.suffix_context(action.index)):
            grad = schedules.backward_step(self.inputs.pop(key, None), self.outputs.pop(key),
                                           self.output_grads.pop(key, None), self.config)
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
                                output_grad=self.output_grads.pop(key, None))
        if not self.is_first:
            self.input_grads[key] = input_tensor.grad

    def run(self, actions: List[Action], no_sync, forward_only: bool) -> None:
        """Execute `actions` in order; only the last backward runs with gradient sync."""
        last_backward = max((i for i, a in enumerate(actions) if a.kind in _BACKWARD),
                            default=-1)
        for i, action in enumerate(actions):
            sync = contextlib.nullcontext() if i == last_backward else no_sync()
            if action.kind in _BACKWARD:
                with sync:
                    self.handlers[action.kind](action)
            else:
                self.handlers[action.kind](action)
        self.p2p.wait_all()
        if forward_only:
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
    check_batch = getattr(forward_step_func, "check_batch", None)  # rl.make_policy_forward_step
    if check_batch is not None:
        check_batch(step.batch)
    step.begin()
    if pg_collection is None:
        pg_collection = schedules._build_default_pg_collection()

    rank = parallel_state.get_pipeline_model_parallel_rank()
    actions = list(step.lowered.actions[rank])
    if forward_only:
        actions = [a for a in actions if a.kind.is_forward]
    runner = _StageRunner(step=step, model=model, forward_step_func=forward_step_func,
                          config=config, pg_collection=pg_collection,
                          collect_non_loss_data=collect_non_loss_data)
    runner.run(actions, config.no_sync_func or contextlib.nullcontext, forward_only)
    for group in step.cache.live_groups():  # forward-only steps keep nothing
        assert forward_only, f"group {group}: prefix cache left after a training step"
        step.cache.free(group)

    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model],
            runner.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    return runner.forward_data_store
