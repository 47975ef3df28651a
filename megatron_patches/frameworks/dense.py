"""The framework's own dense step, for comparison: stock Megatron over the framework's
microbatches of whole sequences, under the same loss function (tests, bench, A/B checks).

`dense_forward_backward(model, rollout, loss_fn, micro_batches=[[0, 1], [2, 3], ...])` runs one
stock `get_forward_backward_func()` call, one microbatch per list of RolloutBatch indices (rows
right-padded to the microbatch's longest; causal attention: no real token sees padding), and
returns an AdapterResult like the adapter's, so `TokenBatch.num_microbatches` is the dense count.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import torch

from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.core.utils import get_model_config

import megatron_patches
from megatron_patches.frameworks.adapter import AdapterConfig, AdapterResult, LossFn, PreparedStep
from megatron_patches.frameworks.indexing import SEQ_INDEX, SEQ_POSITION
from megatron_patches.frameworks.rollout import RolloutBatch

__all__ = ["dense_forward_backward", "dense_rows"]


def dense_rows(rollout: RolloutBatch, micro_batches: Sequence[Sequence[int]]) -> Iterator[dict]:
    """One item per microbatch: input tokens[:-1], labels tokens[1:], [b, L] right-padded."""
    for ids in micro_batches:
        longest = max(rollout.lengths[i] - 1 for i in ids)
        rows = {k: torch.zeros(len(ids), longest, dtype=torch.int64)
                for k in ("tokens", "labels", "position_ids", SEQ_POSITION)}
        rows[SEQ_INDEX] = torch.full((len(ids), longest), -1, dtype=torch.int64)
        for b, i in enumerate(ids):
            seq, n = rollout.tokens[i], rollout.lengths[i] - 1
            rows["tokens"][b, :n], rows["labels"][b, :n] = seq[:-1], seq[1:]
            rows["position_ids"][b] = torch.arange(longest)
            rows[SEQ_INDEX][b, :n] = i
            rows[SEQ_POSITION][b, :n] = torch.arange(1, n + 1)
        rows["kind"] = "dense"
        yield rows


def _check_cover(rollout: RolloutBatch, micro_batches) -> List[List[int]]:
    flat = sorted(i for ids in micro_batches for i in ids)
    if flat != list(range(rollout.num_sequences)) or not all(micro_batches):
        raise ValueError("micro_batches must list every sequence index exactly once, in "
                         "non-empty microbatches")
    return [list(ids) for ids in micro_batches]


def dense_forward_backward(model, rollout: RolloutBatch, loss_fn: Optional[LossFn], *,
                           micro_batches: Sequence[Sequence[int]], forward_only: bool = False,
                           config: Optional[AdapterConfig] = None) -> AdapterResult:
    """Stock Megatron over `micro_batches` (module docstring)."""
    micro_batches = _check_cover(rollout, micro_batches)
    models = model if isinstance(model, list) else [model]
    prepared = PreparedStep(rollout=rollout, config=config or AdapterConfig(), step=None,
                            num_microbatches=len(micro_batches), report="dense",
                            per_token=bool(get_model_config(models[0]).calculate_per_token_loss))
    with megatron_patches.use_prefix_reuse_schedule(False):
        forward_backward = get_forward_backward_func()
    iterators = [dense_rows(rollout, micro_batches) for _ in models]
    losses = forward_backward(forward_step_func=prepared.forward_step(loss_fn),
                              data_iterator=iterators if len(models) > 1 else iterators[0],
                              model=models, num_microbatches=len(micro_batches), seq_length=0,
                              micro_batch_size=1, forward_only=forward_only)
    return prepared.collect(losses)
