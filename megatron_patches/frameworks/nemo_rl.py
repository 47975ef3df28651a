"""NeMo-RL (NVIDIA-NeMo/RL) with prefix reuse: `policy.megatron_cfg.prefix_reuse` and the hook at
its call into Megatron.

    policy:
      megatron_cfg:
        prefix_reuse: true            # off (absent / false): NeMo-RL's step unchanged

`nemo_rl/models/megatron/train.py::megatron_forward_backward` gets the schedule with
`get_forward_backward_func()` and calls it with `forward_with_post_processing_fn` bound to the
step's `LossPostProcessor` (its loss function, e.g. ClippedPGLossFn; `global_valid_seqs/toks`;
temperature / top-k / top-p `sampling_params`). `install()` replaces that ONE name in NeMo-RL's
module (NEMO_RL_HOOK). A training call whose LossPostProcessor's `cfg["megatron_cfg"]` has
`prefix_reuse: true` goes through `NemoReuseCall`; every other call (log-prob passes, the switch
off) is Megatron's function unchanged.

1. NeMo-RL's microbatches (its `ProcessedMicrobatch` iterator, packed or not) are drained for
   their `data_dict`s (BatchedDataDict rows [b, S], NeMo-RL's own keys); nothing is computed.
2. The samples become a RolloutBatch (group = identical prompt tokens, the prompt being the
   tokens before the first `token_mask` one), planned with `sequence_level_loss=True`.
3. Under the prefix-reuse schedule each suffix microbatch gets NeMo-RL's own
   `apply_temperature_scaling` and then ITS OWN LossPostProcessor (same loss function, config,
   sampling params, global normalisers), with `num_microbatches` = the reuse count, on a
   BatchedDataDict of its samples whose rows start one position before each sample's first
   predicted token, and raw logits placed in that row layout (NeMo-RL's unpacked path).

Refused before compute (ValueError naming the setting): context or pipeline parallelism,
`sequence_packing.fuse_loss`, draft models, router replay, fused linear log-probs, multimodal
batches, dynamic batching.
"""
from __future__ import annotations

import hashlib
from functools import partial
from typing import List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_patches
from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.indexing import SEQ_INDEX, SEQ_POSITION
from megatron_patches.frameworks.rollout import RolloutBatch

__all__ = ["NEMO_RL_HOOK", "install", "uninstall", "NemoReuseCall", "check_nemo_cfg",
           "reuse_enabled"]

NEMO_RL_HOOK = "nemo_rl.models.megatron.train.get_forward_backward_func"
last_call: Optional["NemoReuseCall"] = None
"""The latest reuse call (`last_report`, `num_microbatches`): for logs and tests."""


def reuse_enabled(cfg) -> bool:
    """`policy.megatron_cfg.prefix_reuse` of a PolicyConfig (dict)."""
    return bool((cfg.get("megatron_cfg") or {}).get("prefix_reuse", False))


def check_nemo_cfg(cfg, keywords: dict) -> None:
    """ValueError for NeMo-RL settings the hook does not run with reuse (before compute)."""
    megatron = cfg.get("megatron_cfg") or {}
    refused = {
        "megatron_cfg.context_parallel_size > 1": megatron.get("context_parallel_size", 1) > 1,
        "megatron_cfg.pipeline_model_parallel_size > 1":
            parallel_state.get_pipeline_model_parallel_world_size() > 1,
        "sequence_packing.fuse_loss": bool((cfg.get("sequence_packing") or {}).get("fuse_loss")),
        "dynamic_batching.enabled": bool((cfg.get("dynamic_batching") or {}).get("enabled")),
        "draft model": keywords.get("draft_model") is not None,
        "router replay": bool(keywords.get("use_router_replay")),
        "fused linear log-probs": bool(keywords.get("use_fused_linear_logprobs")),
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"policy.megatron_cfg.prefix_reuse does not run with {bad}; turn these "
                         "off or set prefix_reuse: false")


def install(module=None) -> None:
    """Replace `get_forward_backward_func` in NeMo-RL's train module (NEMO_RL_HOOK)."""
    if module is None:
        from nemo_rl.models.megatron import train as module
    from megatron_patches.frameworks.fb_hook import wrap_forward_backward_func

    wrap_forward_backward_func(module, _Dispatch)


def uninstall(module=None) -> None:
    if module is None:
        from nemo_rl.models.megatron import train as module
    from megatron_patches.frameworks.fb_hook import unwrap_forward_backward_func

    unwrap_forward_backward_func(module)


class _Dispatch:
    """Megatron's function unless the call is a training step with prefix_reuse on."""

    def __init__(self, stock) -> None:
        self.stock = stock

    def __call__(self, *, forward_step_func, forward_only=False, **kwargs):
        from nemo_rl.models.megatron.train import LossPostProcessor
        post = getattr(forward_step_func, "keywords", {}).get("post_processing_fn")
        if forward_only or not isinstance(post, LossPostProcessor) or not reuse_enabled(post.cfg):
            return self.stock(forward_step_func=forward_step_func, forward_only=forward_only,
                              **kwargs)
        call = NemoReuseCall(post, forward_step_func.keywords)
        global last_call
        last_call = call
        return call(**kwargs)


class NemoReuseCall:
    def __init__(self, post, keywords: dict) -> None:
        self.post, self.keywords = post, keywords
        self.last_report: Optional[str] = None
        self.num_microbatches: Optional[int] = None

    def __call__(self, *, data_iterator, model, num_microbatches, **_ignored):
        check_nemo_cfg(self.post.cfg, self.keywords)
        rows = _drain(data_iterator, num_microbatches)
        models = model if isinstance(model, list) else [model]
        prepared = PrefixReuseAdapter(models, AdapterConfig(sequence_level_loss=True)).prepare(
            _rollout(rows))
        self.last_report, self.num_microbatches = prepared.report, prepared.num_microbatches
        with megatron_patches.use_prefix_reuse_schedule():
            forward_backward = get_forward_backward_func()
        forward = partial(_forward_step, rows=rows, call=self)
        return forward_backward(forward_step_func=forward, data_iterator=prepared.step,
                                model=models, num_microbatches=prepared.num_microbatches,
                                seq_length=0, micro_batch_size=1, forward_only=False)


class _Rows:
    """Every sample of the step: its row of each per-sample key of NeMo-RL's data_dicts."""

    def __init__(self, dicts: list) -> None:
        self.keys = [k for k, v in dicts[0].items() if torch.is_tensor(v)]
        self.rows = {k: [row for d in dicts for row in d[k].cpu()] for k in self.keys}
        self.lengths = [int(n) for d in dicts for n in d["input_lengths"]]

    def window(self, key: str, i: int, start: int) -> torch.Tensor:
        row = self.rows[key][i]
        return row[start:self.lengths[i]] if row.dim() >= 1 and row.numel() > 1 else row


def _drain(data_iterator, num_microbatches: int) -> _Rows:
    dicts = []
    for _ in range(num_microbatches):
        mb = next(data_iterator)
        if mb.data_dict.get_multimodal_dict(as_tensors=True):
            raise ValueError("policy.megatron_cfg.prefix_reuse does not run multimodal batches")
        dicts.append(mb.data_dict)
    return _Rows(dicts)


def _rollout(rows: _Rows) -> RolloutBatch:
    tokens, masks, groups = [], [], []
    for i, n in enumerate(rows.lengths):
        t = rows.rows["input_ids"][i][:n]
        mask = (rows.rows["token_mask"][i][:n] * rows.rows["sample_mask"][i]).float()
        mask[0] = 0
        first = int(torch.nonzero(rows.rows["token_mask"][i][:n]).min()) if mask.any() else n
        tokens.append(t)
        masks.append(mask)
        groups.append(hashlib.sha1(t[:first].numpy().tobytes()).hexdigest())
    return RolloutBatch(tokens=tokens, group_ids=groups, loss_mask=masks)


def _forward_step(data_iterator, model, *, rows: _Rows, call: NemoReuseCall):
    item = next(data_iterator)
    device = next(model.parameters()).device
    item = {k: v.to(device) if torch.is_tensor(v) else v for k, v in item.items()}
    output = model(item["tokens"], item["position_ids"], None)
    if item.get("kind") == "prefix" and "loss_index" not in item:
        return output, None  # Phase A: no loss
    if "loss_index" in item:
        raise ValueError("a prefix unit carries loss tokens; NeMo-RL's loss needs "
                         "sequence_level_loss=True planning")
    return output, partial(_nemo_loss, item, rows=rows, call=call)


def _nemo_loss(item, logits, *, rows: _Rows, call: NemoReuseCall):
    """NeMo-RL's own post-processing + loss over this microbatch's samples."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron.train import LossPostProcessor, apply_temperature_scaling
    seq, pos = item[SEQ_INDEX].reshape(-1), item[SEQ_POSITION].reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    real = seq >= 0
    seq, pos, flat = seq[real], pos[real], flat[real]
    samples: List[int] = sorted(set(seq.tolist()))
    starts = {}
    for i in samples:
        covered = pos[seq == i]
        _check_covered(i, covered, rows)
        starts[i] = int(covered.min()) - 1
    width = max(rows.lengths[i] - starts[i] for i in samples)
    row_of = {i: b for b, i in enumerate(samples)}
    b_idx = torch.tensor([row_of[int(i)] for i in seq.tolist()], device=seq.device)
    col = pos - torch.tensor([starts[int(i)] for i in seq.tolist()], device=seq.device) - 1
    grid = flat.new_zeros(len(samples), width, flat.shape[-1]).index_put((b_idx, col), flat)
    data = {}
    for key in rows.keys:
        parts = [rows.window(key, i, starts[i]) for i in samples]
        if parts[0].dim() == 0:
            data[key] = torch.stack(parts)
        else:
            data[key] = torch.stack([torch.nn.functional.pad(p, (0, width - p.numel()))
                                     for p in parts])
    data["input_lengths"] = torch.tensor([rows.lengths[i] - starts[i] for i in samples])
    data = BatchedDataDict({k: v.to(logits.device) for k, v in data.items()})
    post: LossPostProcessor = call.post
    apply_temperature_scaling(grid, call.keywords.get("sampling_params"))
    reuse_post = LossPostProcessor(loss_fn=post.loss_fn, cfg=post.cfg,
                                   num_microbatches=call.num_microbatches,
                                   cp_normalize=post.cp_normalize,
                                   sampling_params=post.sampling_params,
                                   prepare_fn=post.prepare_fn)
    wrapped = reuse_post(data_dict=data, packed_seq_params=None,
                         global_valid_seqs=call.keywords.get("global_valid_seqs"),
                         global_valid_toks=call.keywords.get("global_valid_toks"))
    return wrapped(grid)


def _check_covered(i: int, covered: torch.Tensor, rows: _Rows) -> None:
    n = rows.lengths[i]
    mask = rows.rows["token_mask"][i][:n] * rows.rows["sample_mask"][i]
    need = torch.nonzero(mask[1:] > 0).reshape(-1).add(1).tolist()
    have = set(covered.tolist())
    missing = [p for p in need if p not in have]
    if missing or len(have) != covered.numel():
        raise RuntimeError(f"sample {i}: loss positions {missing[:4]} not in its reuse "
                           "microbatch (or predicted twice); the plan broke sequence_level_loss")
