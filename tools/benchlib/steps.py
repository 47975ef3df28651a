"""One training step (forward + backward, no optimizer) through Megatron's schedules, on any
device: dense one row per microbatch, dense with rows batched into microbatches
(micro_batch_size > 1, as Megatron's GPT datasets feed it: equal-length rows, shorter ones
right-padded with loss_mask 0), and prefix reuse.

The forward step is megatron_patches.rl's, given items moved to the model's device first (what
a training script's get_batch does; the builders return host tensors).
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.planner import StepPlan
from prefix_schedule.runtime.step import ReuseStep

__all__ = ["batched_dense_items", "dense_micro_batch_size", "dense_step", "private_rendezvous",
           "reuse_step"]

_PAD = {"tokens": 0, "labels": 0, "loss_mask": 0, "advantages": 0.0, "old_logprobs": 0.0,
        "ref_logprobs": 0.0}


def private_rendezvous() -> None:
    """Before a one-process gloo group: a free local port, not one inherited from a parent
    process (a test runner or launcher whose own store may still listen on it)."""
    import os
    import socket

    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class _OnDevice:
    """An iterator of item dicts whose tensors arrive on `device`."""

    def __init__(self, items, device) -> None:
        self.items, self.device = items, device

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in item.items()}


def _forward_step(loss: PolicyLossConfig, device):
    from megatron_patches.rl import make_policy_forward_step

    inner = make_policy_forward_step(loss)
    return lambda data_iterator, model: inner(_OnDevice(data_iterator, device), model)


def dense_micro_batch_size(batch: GroupBatch, token_budget: int) -> int:
    """Rows per dense microbatch within `token_budget` tokens (at least 1)."""
    longest = max(g.context_len(i) - 1 + len(t.suffix) for g in batch.groups
                  for i, t in enumerate(g.trajectories))
    return max(1, token_budget // longest)


def batched_dense_items(batch: GroupBatch, micro_batch_size: int) -> List[Dict[str, torch.Tensor]]:
    """Dense rows in batch order, `micro_batch_size` per item ([b, L] tensors; a shorter row is
    right-padded: under causal attention padding after a token cannot change it, and its
    loss_mask is 0)."""
    from megatron_patches.training import dense_items

    rows = list(dense_items(batch))
    items = []
    for start in range(0, len(rows), micro_batch_size):
        chunk = rows[start:start + micro_batch_size]
        length = max(r["tokens"].shape[1] for r in chunk)
        item = {"kind": "dense"}
        for key in chunk[0]:
            if key == "kind":
                continue
            if key == "position_ids":
                item[key] = torch.arange(length).unsqueeze(0).expand(len(chunk), -1).contiguous()
                continue
            item[key] = torch.cat([torch.nn.functional.pad(r[key], (0, length - r[key].shape[1]),
                                                           value=_PAD[key]) for r in chunk])
        items.append(item)
    return items


def _summary(reports):
    from megatron_patches.training import StepResult

    loss = sum(float(r["loss"][0]) for r in reports)
    tokens = sum(int(r["loss"][1]) for r in reports)
    return StepResult(loss=loss / max(tokens, 1), num_tokens=tokens, reports=reports)


def dense_step(model, batch: GroupBatch, loss: PolicyLossConfig, micro_batch_size: int = 1):
    """Stock Megatron dense step (`model`: a module or a rank's model chunks); returns a megatron_patches.training.StepResult (token-mean loss
    and token count as the last pipeline stage saw them)."""
    import megatron_patches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    models = _chunks(model)
    items = [iter(batched_dense_items(batch, micro_batch_size)) for _ in models]
    num = -(-sum(len(g.trajectories) for g in batch.groups) // micro_batch_size)
    with megatron_patches.use_prefix_reuse_schedule(False):
        forward_backward = get_forward_backward_func()
    reports = forward_backward(forward_step_func=_forward_step(loss, _device(model)),
                               data_iterator=items if len(models) > 1 else items[0],
                               model=models, num_microbatches=num,
                               seq_length=0, micro_batch_size=micro_batch_size)
    return _summary(reports)


def reuse_step(model, batch: GroupBatch, plan: StepPlan, loss: PolicyLossConfig,
               offload_prefix_activations: bool = False, step: Optional[ReuseStep] = None,
               cp_group=None):
    """Prefix-reuse step through get_forward_backward_func with reuse selected (a StepResult);
    `cp_group`: a prefix_schedule.runtime.cp.CPGroup when Megatron runs with CP > 1."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    models = _chunks(model)
    if step is None:
        step = ReuseStep(batch, plan, num_stages=parallel_state.get_pipeline_model_parallel_world_size(),
                         num_model_chunks=len(models),
                         offload_prefix_activations=offload_prefix_activations,
                         cp_group=cp_group)
    with megatron_patches.use_prefix_reuse_schedule():
        forward_backward = get_forward_backward_func()
    reports = forward_backward(forward_step_func=_forward_step(loss, _device(model)),
                               data_iterator=step, model=models,
                               num_microbatches=step.num_microbatches, seq_length=0,
                               micro_batch_size=1)
    return _summary(reports)


def _chunks(model) -> list:
    """A module, or a rank's model chunks (virtual pipeline stages), as Megatron's list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _device(model) -> torch.device:
    return next(_chunks(model)[0].parameters()).device
