"""One prefix-reuse step on one pipeline rank: runs this rank's row of the lowered schedule.

Each action kind has one handler, built on Megatron's `forward_step` / `backward_step`; every
send, receive and grouped exchange goes through megatron_patches/runtime/p2p.py. The row decides the
order; nothing here reorders, batches or skips. With virtual stages the rank holds V model
chunks (Megatron's interleaved layout) and each action names the chunk it runs on
(`Schedule.model_chunk_of`); tensors in flight are keyed by (prefix|suffix, index, chunk).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch

from prefix_schedule.pipeline import Action, ActionKind
from prefix_schedule.runtime.context import PrefixForwardDone, active_context
from prefix_schedule.runtime.offload import (PinnedHostPool, PrefixActivationOffloader,
                                             prefetch_points)

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import unwrap_model

from megatron_patches.runtime.layers import prefix_stop
from megatron_patches.runtime.p2p import P2POp, PipelineP2P, Received
from megatron_patches.runtime.schedule_parts import (GradSync, StopAtPrefixEnd, autograd_backward,
                                             model_device, without_full_recompute)

__all__ = ["StageRunner"]


@contextlib.contextmanager
def _stop_before(module):
    """Stop the forward at `module`'s input (PrefixForwardDone carries it); None: no stop."""
    if module is None:
        yield
        return

    def stop(_module, args):
        raise PrefixForwardDone(args[0])

    handle = module.register_forward_pre_hook(stop)
    try:
        yield
    finally:
        handle.remove()

def _final_norm(model):
    """The decoder's final norm on the last stage, or None: TransformerBlock's
    `final_layernorm` (GPTModel), HybridStack's `final_norm` (HybridModel; its forward calls
    it only with `post_layer_norm`)."""
    decoder = getattr(unwrap_model(model), "decoder", None)
    if not getattr(decoder, "post_layer_norm", True):
        return None
    for name in ("final_layernorm", "final_norm"):
        norm = getattr(decoder, name, None)
        if norm is not None:
            return norm
    return None


K = ActionKind
_PREFIX = (K.PREFIX_FORWARD, K.PREFIX_BACKWARD)


class StageRunner:
    """The state that flows between this rank's actions during one step."""

    def __init__(self, *, step, models, forward_step_func, config, pg_collection, actions,
                 collect_non_loss_data, forward_only, first_val_step):
        self.step, self.models, self.config = step, models, config
        self.sched = step.lowered
        self.actions = actions
        self.forward_step_func = forward_step_func
        self.cp_size, self.tp_size = pg_collection.cp.size(), pg_collection.tp.size()
        self.collect_non_loss_data = collect_non_loss_data
        self.forward_only, self.first_val_step = forward_only, first_val_step
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = torch.distributed.get_process_group_ranks(pp_group)  # rank -> global
        self.device = model_device(models[0])  # everything created here lives on it
        self.p2p = PipelineP2P(group=pp_group, rank=torch.distributed.get_rank(),
                               dtype=config.pipeline_dtype or config.params_dtype,
                               device=self.device)
        self.grad_sync = GradSync(config, models)
        # Megatron's schedules: torch.zeros([], dtype=torch.int, device="cuda"); all-reduced
        # over NCCL by finalize_model_grads, so it must live where the model does.
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)
        self.deallocate = config.deallocate_pipeline_outputs and not forward_only
        self.backward_fn = autograd_backward if self.deallocate else torch.autograd.backward
        self.forward_data_store: List = []
        self.forwards_per_chunk = [0] * len(models)
        self.inputs: Dict[tuple, object] = {}  # tensors, or receives not waited for yet
        self.outputs: Dict[tuple, torch.Tensor] = {}
        self.output_grads: Dict[tuple, object] = {}
        self.input_grads: Dict[tuple, Optional[torch.Tensor]] = {}
        step.in_flight = self.in_flight_tensors  # memory accounting (runtime/memory.py)
        self.full_recompute = config.recompute_granularity == "full" and not forward_only
        if step.offload_prefix_activations and not forward_only:
            step.offloader = self._offloader()
        self.handlers = {  # every other kind is a send, receive or exchange: self.post
            K.PREFIX_FORWARD: self.prefix_forward, K.SUFFIX_FORWARD: self.suffix_forward,
            K.SUFFIX_BACKWARD: self.suffix_backward, K.PREFIX_BACKWARD: self.prefix_backward,
            K.REDUCE_GRAD: self.reduce_grad}

    def _offloader(self) -> PrefixActivationOffloader:
        """[Note: prefix activation offload] (runtime/offload.py): never the parameters, nor the
        K/V storages the caches keep on the device anyway."""
        caches = self.step.caches
        return PrefixActivationOffloader(
            self.device, params=[p for m in self.models for p in m.parameters()],
            keep=lambda t: any(c.holds_storage(t) for c in caches),
            pool=PinnedHostPool(self.step.offload_pool_bytes, pin=self.device.type == "cuda"))

    def in_flight_tensors(self) -> Iterator[torch.Tensor]:
        """Pipeline tensors held between actions (received inputs, outputs, gradients)."""
        for store in (self.inputs, self.outputs, self.output_grads, self.input_grads):
            for value in store.values():
                if isinstance(value, Received):
                    value = value._buffer
                if isinstance(value, torch.Tensor):
                    yield value

    # ---- layout and shapes (every rank derives them from the shared plan; nothing is exchanged)
    def chunk(self, action: Action) -> int:
        return self.sched.model_chunk_of(action)

    def is_first_stage(self, action: Action) -> bool:
        return action.stage == 0

    def is_last_stage(self, action: Action) -> bool:
        return action.stage == self.sched.num_stages - 1

    def key(self, action: Action) -> tuple:
        kind = "prefix" if action.kind.compute in _PREFIX else "suffix"
        return kind, action.index, self.chunk(action)

    def hidden_shape(self, action: Action) -> tuple:
        """[rows, 1, hidden] of the activation or gradient `action` carries."""
        rows = (self.step.prefix_length(action.index) if action.kind.compute in _PREFIX
                else self.step.microbatch_length(action.index))
        if self.config.sequence_parallel:  # as schedules.get_tensor_shapes: rows / TP per rank
            rows //= self.tp_size
        return (rows, 1, self.config.hidden_size)

    @staticmethod
    def arrived(store: Dict[tuple, object], key: tuple, pop: bool = False):
        """The tensor under `key`, waiting for its receive if it was one."""
        value = store.pop(key, None) if pop else store.get(key)
        if isinstance(value, Received):
            value = value.wait()
            if not pop:
                store[key] = value
        return value

    def is_first_forward(self, chunk: int) -> bool:
        """Megatron's `is_first_microbatch` (FP8 weight casts): the step's first forward of this
        model chunk, prefix or suffix (the interleaved schedule asks it per model chunk)."""
        first = self.forwards_per_chunk[chunk] == 0
        self.forwards_per_chunk[chunk] += 1
        return schedules.check_first_val_step(self.first_val_step, self.forward_only, first)

    # ---- p2p: one row entry (a send, a receive or a grouped exchange) = one posted group
    def post(self, action: Action) -> None:
        ops = []
        for op in action.p2p_ops:
            key, peer = self.key(op), self.pp_ranks[self.sched.peer_rank(op)]
            if op.kind.is_send:
                tensor = (self.outputs[key] if op.kind.is_forward else self.input_grads.pop(key))
                ops.append(P2POp(peer=peer, label=str(op), tensor=tensor))
            else:
                ops.append(P2POp(peer=peer, label=str(op), shape=self.hidden_shape(op),
                                 requires_grad=op.kind.is_forward))
        for op, received in zip(action.p2p_ops, self.p2p.post(ops)):
            if received is not None:
                (self.inputs if op.kind.is_forward else self.output_grads)[self.key(op)] = received
            elif op.kind.is_forward:  # as Megatron after send_forward
                schedules.deallocate_output_tensor(self.outputs[self.key(op)], self.deallocate)

    # ---- compute
    def prefix_forward(self, action: Action) -> None:
        step, key = self.step, self.key(action)
        if self.full_recompute:  # [Note: prefix full recompute]: no graph until Phase C
            memory = torch.no_grad()
        elif step.offloader is not None:  # dormant until Phase C: in host memory meanwhile
            memory = step.offloader.capture(key[1:])
        else:
            memory = contextlib.nullcontext()
        with memory:
            output = self.run_prefix_forward(action)
        if output is not None:
            self.outputs[key] = output

    def run_prefix_forward(self, action: Action, *, mode: str = "forward",
                           final_norm=None) -> Optional[torch.Tensor]:
        """A prefix row through Megatron's forward_step (first-microbatch flag for FP8 casts,
        input tensor, autocast); None on the last stage, which stops at the last cached K/V.
        `mode` ([Note: prefix full recompute]): "forward" (Phase A of a training step) and
        "rebind" run without Megatron's full recompute; "inject" keeps it and, on the last
        stage, stops at the input of `final_norm` and returns it. A forward-only step keeps it
        too: its routers then see the grad mode stock gives them, and count what stock counts
        ([Note: prefix router stats under full recompute])."""
        step, config, key, chunk = self.step, self.config, self.key(action), self.chunk(action)
        last = self.is_last_stage(action)
        if last and step.prefix_has_loss(action.index):
            return self.prefix_forward_with_loss(action)
        step.prepare(action)
        stop, in_router = (prefix_stop(self.models[chunk])  # HybridModel: last '*' or 'E'
                           if last and mode != "inject" else (None, False))
        context = step.prefix_context(action.index, model_chunk=chunk, stop_after_layer=stop,
                                      stop_in_router=in_router,
                                      replay=mode == "rebind", inject=mode == "inject",
                                      full_recompute=self.full_recompute and mode == "forward")
        recompute = (contextlib.nullcontext() if mode == "inject" or self.forward_only
                     else without_full_recompute(config))
        with active_context(context), recompute, _stop_before(final_norm):
            output, _ = schedules.forward_step(
                StopAtPrefixEnd(self.forward_step_func), step, self.models[chunk],
                step.num_microbatches, self.arrived(self.inputs, key), [], config, self.cp_size,
                is_first_microbatch=self.is_first_forward(chunk), vp_stage=self.vp_stage(chunk),
                is_last_stage=False)  # no loss on a prefix row
        step.finish_forward()  # a rank may leave the item unread (TP ranks > 0 in get_batch)
        output = None if StopAtPrefixEnd.stopped(output) else output
        assert (output is None) == (last and mode != "inject"), (
            f"{action}: the prefix forward must stop at the last layer's K/V exactly on the "
            "last stage")
        return output

    def prefix_forward_with_loss(self, action: Action) -> None:
        """A prefix-tree unit that predicts loss tokens, on the last stage: the whole model runs
        and its loss (one entry per trajectory and token, [Note: loss inside shared nodes] in
        planning/tree.py) is reported like a suffix's; Phase C starts from it."""
        step, key, chunk = self.step, self.key(action), self.chunk(action)
        step.prepare(action)
        context = step.prefix_context(action.index, model_chunk=chunk, stop_after_layer=None)
        with active_context(context):
            output, num_tokens = schedules.forward_step(
                self.forward_step_func, step, self.models[chunk], step.num_microbatches,
                self.arrived(self.inputs, key), self.forward_data_store, self.config,
                self.cp_size, self.collect_non_loss_data,
                is_first_microbatch=self.is_first_forward(chunk), vp_stage=self.vp_stage(chunk),
                is_last_stage=True)
        step.finish_forward()
        self.total_num_tokens += num_tokens
        self.outputs[key] = output

    def suffix_forward(self, action: Action) -> None:
        step, key, chunk = self.step, self.key(action), self.chunk(action)
        step.prepare(action)
        with active_context(step.suffix_context(action.index, chunk)):
            output, num_tokens = schedules.forward_step(
                self.forward_step_func, step, self.models[chunk], step.num_microbatches,
                self.arrived(self.inputs, key), self.forward_data_store, self.config,
                self.cp_size, self.collect_non_loss_data,
                is_first_microbatch=self.is_first_forward(chunk), current_microbatch=action.index,
                vp_stage=self.vp_stage(chunk), is_last_stage=self.is_last_stage(action))
        step.finish_forward()  # a rank may leave the item unread (TP ranks > 0 in get_batch)
        self.total_num_tokens += num_tokens
        self.outputs[key] = output

    def suffix_backward(self, action: Action) -> None:
        key, chunk = self.key(action), self.chunk(action)
        with active_context(self.step.suffix_context(action.index, chunk)):
            grad = schedules.backward_step(self.inputs.pop(key, None), self.outputs.pop(key),
                                           self.arrived(self.output_grads, key, pop=True),
                                           self.config)
        if not self.is_first_stage(action):
            self.input_grads[key] = grad
        if chunk == 0:  # the microbatch's last backward on this rank
            self.step.release_microbatch(action.index)

    def prefix_backward(self, action: Action) -> None:
        step, key, chunk = self.step, self.key(action), self.chunk(action)
        output = self.outputs.pop(key, None)
        output_grad = self.arrived(self.output_grads, key, pop=True)
        if self.full_recompute:  # Phase A kept the K/V only: re-run the forward with its graph
            output, output_grad = self.replay_prefix(action, output_grad)
        input_tensor = self.inputs.pop(key, None)
        # under full recompute Megatron's checkpoints re-run the hook inside this backward
        context = step.prefix_context(action.index, stop_after_layer=None, recomputing=True,
                                      inject=self.full_recompute, model_chunk=chunk)
        unit = step.prefix_unit(action.index)
        if (not self.full_recompute and output is not None
                and self.is_last_stage(action)):  # a tree unit's loss, as backward_step
            if self.config.grad_scale_func is not None:
                output = self.config.grad_scale_func(output)
            output_grad = torch.ones_like(output)
        packed = [(c.group, c.chunk) for c in step.prefix_members(action.index)[1:]]
        with active_context(context):
            step.caches[chunk].backward(
                unit.group, chunk=unit.chunk, output=output, output_grad=output_grad,
                backward_fn=self.backward_fn, packed=packed)
        if not self.is_first_stage(action):
            self.input_grads[key] = input_tensor.grad

    def replay_prefix(self, action: Action, output_grad):
        """[Note: prefix full recompute]: re-run a prefix unit for its Phase C; (output, its
        gradient). With Megatron's checkpoints kept ("inject") where the stage's end is a
        final norm to stop at (TransformerBlock's or HybridStack's, whose checkpointed forward
        runs the same way) or a send; else bind a whole re-run's K/V graph ("rebind")."""
        if not self.is_last_stage(action):
            return self.run_prefix_forward(action, mode="inject"), output_grad
        final_norm = _final_norm(self.models[self.chunk(action)])
        if final_norm is None:
            return self.run_prefix_forward(action, mode="rebind"), output_grad
        hidden = self.run_prefix_forward(action, mode="inject", final_norm=final_norm)
        return hidden, torch.zeros_like(hidden)  # nothing after the final norm feeds a suffix

    def reduce_grad(self, action: Action) -> None:
        self.grad_sync.start(self.chunk(action))

    def vp_stage(self, chunk: int) -> Optional[int]:
        return chunk if len(self.models) > 1 else None

    def run(self) -> None:
        """Execute this rank's actions in order (backwards under no_sync until REDUCE_GRAD)."""
        compute = [a for a in self.actions if a.kind in self.handlers]
        prefetch = (prefetch_points([a.kind.value for a in compute],
                                    [self.key(a)[1:] for a in compute])
                    if self.step.offloader is not None else {})
        position = 0  # of the action among this row's compute actions
        self.grad_sync.disable()
        try:
            for action in self.actions:
                if action.kind in self.handlers:
                    self.step.notify(action)
                    for unit in prefetch.get(position, ()):
                        self.step.offloader.prefetch(unit)  # as its Phase C starts
                    position += 1
                self.handlers.get(action.kind, self.post)(action)
                self.p2p.release_completed()
            self.p2p.wait_all()
        finally:
            self.grad_sync.enable()
            self.step.notify(None)
        if self.forward_only:
            self.outputs.clear()
        assert not (self.outputs or self.output_grads or self.input_grads), (
            "tensors left in flight after the step: the schedule and the executor disagree")
