"""ROLL (alibaba/ROLL) with prefix reuse: `prefix_reuse` on the worker config and the hook at its
call into Megatron.

    actor_train:                      # a ROLL WorkerConfig (with_prefix_reuse(WorkerConfig))
      prefix_reuse: true              # off (absent / false): ROLL's step unchanged
      strategy_args:
        strategy_name: megatron_train

`roll/distributed/strategy/megatron_strategy.py::MegatronTrainStrategy.initialize` binds
`self.forward_backward_func = get_forward_backward_func()`; `train_step` calls it with
`partial(self.inner_forward_step, loss_func)` over ROLL's micro-batches (`batch.chunk`, each
`meta_info['loss_scale'] = num_microbatches x dp`). `install()` replaces that ONE name in ROLL's
module (ROLL_HOOK) before `initialize`. A call whose strategy's `worker_config.prefix_reuse` is
true and that trains (not `forward_only`) goes through `RollReuseCall`; every other call (the
log-prob passes of `forward_step`, the switch off) is Megatron's function unchanged.

1. ROLL's micro-batches (DataProto, [b, S] rows: left-padded prompt, right-padded response) are
   drained and concatenated; nothing is computed.
2. Each row's real tokens (its `attention_mask`) become a RolloutBatch sample; group = identical
   tokens before the first `response_mask` one; loss tokens = `response_mask`; planned with
   `sequence_level_loss=True` (every loss token of a sample in one micro-batch).
3. Under the prefix-reuse schedule each suffix micro-batch calls ROLL's OWN `loss_func(data,
   logits)` (the worker's, e.g. the RLVR actor's PPO/GRPO loss with its `agg_loss` modes) on a
   DataProto of its samples, full rows and meta_info as ROLL gave them, with logits in ROLL's
   [b, S, V] layout (the positions this micro-batch computes; zeros elsewhere, all masked), and
   ROLL's `loss *= meta_info['loss_scale']` with `loss_scale` = the REUSE micro-batch count x dp.

Refused before compute (ValueError naming the setting): context or pipeline parallelism,
`use_sequence_packing`, `use_dynamic_batching_in_train`, `apply_loss_scale: false`, router
replay, MTP training, multimodal batches, `length_loss_weight` (a statistic of the
micro-batch), `entropy_loss_coef > 0` (not verified: ROLL's own fp32 step fails there, its
non-fused `vocab_parallel_entropy` backward edits the logits in place), a batch without
`response_mask` or with holes in its attention mask.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import field
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_patches
from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.rollout import RolloutBatch, TokenBatch

__all__ = ["ROLL_HOOK", "install", "uninstall", "with_prefix_reuse", "reuse_enabled",
           "check_roll_settings", "RollReuseCall"]

ROLL_HOOK = "roll.distributed.strategy.megatron_strategy.get_forward_backward_func"
last_call: Optional["RollReuseCall"] = None
"""The latest reuse call (`report`, `num_microbatches`): for logs and tests."""


@functools.lru_cache(maxsize=None)
def with_prefix_reuse(base: type) -> type:
    """ROLL's WorkerConfig dataclass (or a subclass) with `prefix_reuse: bool` (default off)
    and `prefix_reuse_min_shared_len: int` added, ROLL's field/metadata style."""
    return dataclasses.make_dataclass(f"{base.__name__}WithPrefixReuse", [
        ("prefix_reuse", bool, field(default=False, metadata={
            "help": "megatron_train only: each shared prompt prefix of a train_step runs forward "
                    "and backward once (exact against the dense step; megatron_patches)."})),
        ("prefix_reuse_min_shared_len", int, field(default=8, metadata={
            "help": "Samples sharing fewer prompt tokens are not grouped."}))], bases=(base,))


def reuse_enabled(worker_config) -> bool:
    return bool(getattr(worker_config, "prefix_reuse", False))


def check_roll_settings(strategy) -> None:
    """ValueError for ROLL settings the hook does not run with reuse (before compute)."""
    wc = strategy.worker_config
    pipeline = getattr(getattr(strategy, "worker", None), "pipeline_config", None)
    refused = {
        "context_parallel_size > 1": parallel_state.get_context_parallel_world_size() > 1,
        "pipeline_model_parallel_size > 1":
            parallel_state.get_pipeline_model_parallel_world_size() > 1,
        "use_sequence_packing": bool(getattr(wc, "use_sequence_packing", False)),
        "use_dynamic_batching_in_train": bool(getattr(wc, "use_dynamic_batching_in_train", False)),
        "apply_loss_scale: false": not getattr(wc, "apply_loss_scale", True),
        "router_replay": bool(getattr(strategy, "enable_router_replay", False)),
        "mtp_training_mode": getattr(wc, "mtp_training_mode", "disabled") not in (None, "disabled"),
        "length_loss_weight": bool(getattr(pipeline, "length_loss_weight", False)),
        "entropy_loss_coef > 0": (getattr(pipeline, "entropy_loss_coef", 0) or 0) > 0,
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"{getattr(wc, 'name', 'worker')}.prefix_reuse does not run with {bad}; "
                         "turn these off or set prefix_reuse: false")


def install(module=None) -> None:
    """Replace `get_forward_backward_func` in ROLL's megatron_strategy module (ROLL_HOOK); call
    before the strategy's `initialize` (which binds it)."""
    if module is None:
        from roll.distributed.strategy import megatron_strategy as module
    from megatron_patches.frameworks.fb_hook import wrap_forward_backward_func

    wrap_forward_backward_func(module, _Dispatch)


def uninstall(module=None) -> None:
    if module is None:
        from roll.distributed.strategy import megatron_strategy as module
    from megatron_patches.frameworks.fb_hook import unwrap_forward_backward_func

    unwrap_forward_backward_func(module)


class _Dispatch:
    """Megatron's function unless the call is ROLL's train_step with prefix_reuse on."""

    def __init__(self, stock) -> None:
        self.stock = stock

    def __call__(self, *, forward_step_func, forward_only=False, **kwargs):
        bound = getattr(forward_step_func, "func", None)
        strategy = getattr(bound, "__self__", None)
        if (forward_only or getattr(bound, "__name__", "") != "inner_forward_step"
                or not reuse_enabled(getattr(strategy, "worker_config", None))):
            return self.stock(forward_step_func=forward_step_func, forward_only=forward_only,
                              **kwargs)
        call = RollReuseCall(strategy, forward_step_func.args[0])
        global last_call
        last_call = call
        return call(**kwargs)


class RollReuseCall:
    def __init__(self, strategy, loss_func) -> None:
        self.strategy, self.loss_func = strategy, loss_func
        self.report: Optional[str] = None
        self.num_microbatches: Optional[int] = None
        self.dense_num_microbatches: Optional[int] = None

    def __call__(self, *, data_iterator, model, num_microbatches, **_ignored):
        check_roll_settings(self.strategy)
        batch = _drain(data_iterator, num_microbatches)
        self.dense_num_microbatches = num_microbatches
        firsts, lengths = _real_spans(batch.batch["attention_mask"])
        models = model if isinstance(model, list) else [model]
        min_shared = getattr(self.strategy.worker_config, "prefix_reuse_min_shared_len", 8)
        prepared = PrefixReuseAdapter(models, AdapterConfig(
            sequence_level_loss=True, min_shared_len=min_shared)).prepare(
                _rollout(batch, firsts, lengths))
        self.report, self.num_microbatches = prepared.report, prepared.num_microbatches
        loss_scale = prepared.num_microbatches * parallel_state.get_data_parallel_world_size()

        def roll_loss(b: TokenBatch):
            return self._loss(batch, firsts, lengths, b, loss_scale)
        with megatron_patches.use_prefix_reuse_schedule():
            forward_backward = get_forward_backward_func()
        return forward_backward(forward_step_func=prepared.forward_step(roll_loss,
                                                                        expose_logits=True),
                                data_iterator=prepared.step, model=models,
                                num_microbatches=prepared.num_microbatches, seq_length=0,
                                micro_batch_size=1, forward_only=False)

    def _loss(self, batch, firsts, lengths, b: TokenBatch, loss_scale: int):
        """ROLL's loss_func (and its loss_wrapper's loss_scale) on this micro-batch's samples."""
        seq, pos = b.sequence_index, b.position
        samples: List[int] = sorted(set(seq.tolist()))
        _check_covered(batch, firsts, samples, seq, pos)
        logits = b.fields["_logits"]
        row_of = {s: r for r, s in enumerate(samples)}
        rows = torch.tensor([row_of[int(s)] for s in seq.tolist()], device=logits.device)
        first = torch.tensor(firsts, device=logits.device)[seq]
        cols = first + pos - 1  # ROLL's logits column t predicts token t+1
        S = batch.batch["input_ids"].shape[1]
        grid = logits.new_zeros(len(samples), S, logits.shape[-1]).index_put((rows, cols), logits)
        data = batch.select_idxs(samples)
        data.meta_info = dict(batch.meta_info, loss_scale=loss_scale,
                              micro_batch_size=len(samples))
        loss, metrics = self.loss_func(data, grid)
        if self.strategy.worker_config.apply_loss_scale:
            loss = loss * data.meta_info["loss_scale"]
        return loss, metrics


def _drain(data_iterator, num_microbatches: int):
    from roll.distributed.scheduler.protocol import DataProto
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    parts = [next(iterator) for _ in range(num_microbatches)]
    for part in parts:
        if "multi_modal_inputs" in part.non_tensor_batch:
            raise ValueError("prefix_reuse does not run multimodal batches (multi_modal_inputs)")
        if "response_mask" not in part.batch.keys():
            raise ValueError("prefix_reuse needs ROLL's actor batch with response_mask (its loss "
                             "tokens); this batch has none")
    batch = DataProto.concat(parts)
    batch.meta_info = dict(parts[0].meta_info)
    return batch


def _real_spans(attention_mask: torch.Tensor):
    """Per row: (first real column, number of real tokens); ValueError on holes."""
    mask = attention_mask.bool().cpu()
    lengths = mask.sum(1)
    firsts = mask.float().argmax(1)
    cols = torch.arange(mask.shape[1])[None]
    spans = (cols >= firsts[:, None]) & (cols < (firsts + lengths)[:, None])
    if not torch.equal(spans, mask):
        raise ValueError("ROLL batch's attention_mask has holes (real tokens not contiguous); "
                         "prefix_reuse needs left-padded prompts and right-padded responses")
    return firsts.tolist(), lengths.tolist()


def _rollout(batch, firsts, lengths) -> RolloutBatch:
    tokens, masks, groups = [], [], []
    ids, response = batch.batch["input_ids"].cpu(), batch.batch["response_mask"].cpu()
    for b, (first, n) in enumerate(zip(firsts, lengths)):
        t = ids[b, first:first + n]
        mask = (response[b, first:first + n] != 0).float()
        mask[0] = 0
        start = int(torch.nonzero(mask).min()) if mask.any() else n
        tokens.append(t)
        masks.append(mask)
        groups.append(hashlib.sha1(t[:start].numpy().tobytes()).hexdigest())
    return RolloutBatch(tokens=tokens, group_ids=groups, loss_mask=masks)


def _check_covered(batch, firsts, samples: List[int], seq: torch.Tensor,
                   pos: torch.Tensor) -> None:
    """Every response token of each sample is predicted in this micro-batch, once."""
    response = batch.batch["response_mask"].cpu()
    for s in samples:
        have = pos[seq == s].cpu()
        need = set((torch.nonzero(response[s, 1:]).reshape(-1) + 1 - firsts[s]).tolist())
        if not need <= set(have.tolist()) or len(set(have.tolist())) != have.numel():
            raise RuntimeError(f"sample {s}: its response tokens are not all in one reuse "
                               "micro-batch; the plan broke sequence_level_loss")
