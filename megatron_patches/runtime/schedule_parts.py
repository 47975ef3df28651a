"""Pieces of Megatron's schedules that the prefix-reuse executor needs in its own form.

Megatron's schedule functions (pipeline_parallel/schedules.py, megatron-core 0.19.2) do these
things inline; the executor walks a lowered plan instead of a fixed loop, so it takes them from
here: the grad-sync bracket around the step, the shape-check-free backward for pseudo-freed
outputs, and the wrapper that runs a prefix row through `schedules.forward_step`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import Variable

from prefix_schedule.runtime.context import PrefixForwardDone

__all__ = ["GradSync", "StopAtPrefixEnd", "autograd_backward", "model_device",
           "without_full_recompute"]


class StopAtPrefixEnd:
    """The user's forward_step_func for a prefix row, under Megatron's `forward_step`: the
    forward stops after the last cached K/V on the last stage ([Note: prefix forward stops at
    the last cached K/V] in docs/DESIGN.md) and the loss function is never called."""

    def __init__(self, forward_step_func):
        self.forward_step_func = forward_step_func

    def __call__(self, data_iterator, model, *args):
        try:
            output, _ = self.forward_step_func(data_iterator, model, *args)
        except PrefixForwardDone as done:
            if done.args:  # a full-recompute replay stopped before the final norm: its input
                return done.args[0], None
            # Megatron's forward_step reads the output's device after the forward (MoE loss
            # scale): an empty tensor on the model's device, which `stopped` recognises.
            output = torch.empty(0, device=model_device(model))
            output.prefix_forward_done = True
        return output, None

    @staticmethod
    def stopped(output) -> bool:
        """True for the marker output of a forward that stopped at the last cached K/V."""
        return getattr(output, "prefix_forward_done", False)


class GradSync:
    """Megatron's disable_grad_sync / enable_grad_sync, for the whole step.

    Every backward runs under `no_sync` (each model chunk's, as the interleaved schedule enters
    them all); each REDUCE_GRAD action (after this rank's last backward) leaves it and starts
    its model chunk's data-parallel gradient reduce the way Megatron's schedules launch their
    remaining reductions: `config.grad_sync_func` (what Megatron-LM sets with
    overlap_grad_reduce), or, without one, the DDP wrapper's own `start_grad_sync` when it
    overlaps. So DDP's per-parameter ready counts never depend on which prefix or suffix work
    happens to run last, nor on the plan of the step (distributed/param_and_grad_buffer.py).
    """

    def __init__(self, config, models):
        self.config, self.models = config, models
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            self.no_sync = lambda: _enter_all(no_sync)
        else:
            self.no_sync = no_sync or contextlib.nullcontext
        self.context = None

    def disable(self) -> None:
        if self.context is None:
            self.context = self.no_sync()
            self.context.__enter__()

    def enable(self) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def start(self, chunk: int) -> None:
        self.enable()
        model = self.models[chunk]
        grad_sync = self.config.grad_sync_func
        if isinstance(grad_sync, list):
            grad_sync = grad_sync[chunk]
        if grad_sync is None and getattr(getattr(model, "ddp_config", None),
                                         "overlap_grad_reduce", False):
            grad_sync = model.start_grad_sync
        if grad_sync is not None:
            grad_sync(model.parameters())


@contextlib.contextmanager
def _enter_all(context_funcs):
    with contextlib.ExitStack() as stack:
        for func in context_funcs:
            stack.enter_context(func())
        yield


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def autograd_backward(tensors, grads) -> None:
    """torch.autograd.backward without its shape checks, as Megatron's `custom_backward`: a
    pseudo-freed output (deallocate_pipeline_outputs) keeps only its grad_fn."""
    Variable._execution_engine.run_backward(
        tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=False, create_graph=False,
        inputs=tuple(), allow_unreachable=True, accumulate_grad=True)


@contextlib.contextmanager
def without_full_recompute(config):
    """Run a prefix row without Megatron's full recompute ([Note: prefix full recompute] in
    docs/DESIGN.md): TransformerBlock.forward reads `config.recompute_granularity` at every
    forward (megatron-core 0.19.2 transformer_block.py), and its CheckpointFunction would run the
    layers without a graph, so the cached K/V could never get their gradient."""
    granularity = config.recompute_granularity
    if granularity != "full":
        yield
        return
    config.recompute_granularity = None
    try:
        yield
    finally:
        config.recompute_granularity = granularity
