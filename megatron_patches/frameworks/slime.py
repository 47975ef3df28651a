"""slime (THUDM/slime) with prefix reuse: its `--prefix-reuse` switch and the hook at its call
into Megatron.

    from megatron_patches.frameworks import slime as slime_reuse
    slime_reuse.add_prefix_reuse_arguments(parser)   # slime's argparse: --prefix-reuse
    slime_reuse.install()                             # the hook in slime's model.py

slime's training step (`slime/backends/megatron_utils/model.py::train_one_step`) gets the
schedule with `get_forward_backward_func()` and calls it with its own `forward_step` (slime's
`get_batch` over its `DataIterator`, THD packing, then `partial(loss_function, args, batch,
num_microbatches, step_global_batch_size)`). `install()` replaces that ONE name in slime's module
(declared: SLIME_HOOK); with `args.prefix_reuse` off it returns Megatron's function unchanged.
With it on, a training call (forward_only=False) goes through `SlimeReuseCall`:

1. slime's own `forward_step` runs once per slime microbatch against a recorder instead of the
   model: slime's `get_batch` prepares the samples, and the bound `loss_function` partial (its
   args and `step_global_batch_size`) comes back. Nothing is computed.
2. The step's samples become a RolloutBatch (group = identical prompt tokens), planned with
   `sequence_level_loss=True`: every response token of a sample lands in ONE reuse microbatch,
   so slime's per-sample normalisers (`get_sum_of_sample_mean`, its per-rollout denominators,
   GSPO / OPSM sequence terms) see whole samples.
3. Megatron's prefix-reuse schedule runs; for each suffix microbatch slime's REAL
   `loss_function` is called on raw logits laid out as slime's cp=1 THD stream (one window per
   sample: from the position before its first predicted token to its end), with the sub-batch
   of those samples and `num_microbatches` = the reuse step's count, so slime's
   `x num_microbatches / step_global_batch_size x dp` cancels Megatron's division exactly; with
   `--calculate-per-token-loss` the (sum, num_tokens) contract needs no factor.

Refused before compute (ValueError naming the setting): context parallelism (slime's zigzag CP
layout), `--allgather-cp`, multimodal inputs, `--enable-mtp-training`, rollout top-p replay
(`--rollout-top-p` < 1), the critic's `value_loss`, pipeline parallelism through this hook. A
loss token of a sample outside its reuse microbatch raises (RuntimeError: a planning bug).
Log-prob passes (`forward_only`) run slime's dense path unchanged.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_patches
from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.indexing import SEQ_INDEX, SEQ_POSITION
from megatron_patches.frameworks.rollout import RolloutBatch

__all__ = ["SLIME_HOOK", "add_prefix_reuse_arguments", "install", "uninstall",
           "SlimeReuseCall", "check_slime_args"]

SLIME_HOOK = "slime.backends.megatron_utils.model.get_forward_backward_func"
"""The one name the hook replaces (slime's module global, read by train_one_step/forward_only)."""

last_call: Optional["SlimeReuseCall"] = None
"""The latest reuse call (its `last_report`, `num_microbatches`): for logs and tests."""

_PER_SAMPLE_SKIP = ("tokens", "unconcat_tokens", "total_lengths", "packed_seq_params",
                    "full_loss_masks", "multimodal_train_inputs")


def add_prefix_reuse_arguments(parser):
    """slime's argparse style (slime/utils/arguments.py add_*_arguments): `--prefix-reuse`,
    plus the detection thresholds of AdapterConfig."""
    group = parser.add_argument_group(title="prefix reuse")
    group.add_argument("--prefix-reuse", action="store_true", default=False,
                       help="Train the actor with shared-prompt prefix reuse (prompt forward and "
                            "backward once per group; docs/FRAMEWORKS.md).")
    group.add_argument("--prefix-reuse-min-shared-len", type=int, default=None,
                       help="Shared prompt spans shorter than this run dense (default: adapter's).")
    group.add_argument("--prefix-reuse-token-budget", type=int, default=None,
                       help="Tokens per suffix microbatch (default: the policy's).")
    return parser


def check_slime_args(args) -> None:
    """ValueError for slime settings the hook does not run with reuse (before any compute)."""
    refused = {
        "context_parallel_size > 1 (slime's zigzag CP layout)":
            getattr(args, "context_parallel_size", 1) > 1,
        "--allgather-cp": bool(getattr(args, "allgather_cp", False)),
        "--enable-mtp-training": bool(getattr(args, "enable_mtp_training", False)),
        "--rollout-top-p < 1 (top-p replay masks)": getattr(args, "rollout_top_p", 1.0) != 1.0,
        "--loss-type value_loss (critic)": getattr(args, "loss_type", None) == "value_loss",
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"--prefix-reuse does not run with {bad}; turn these off or drop "
                         "--prefix-reuse")


def install(module=None) -> None:
    """Replace `get_forward_backward_func` in slime's model module (SLIME_HOOK)."""
    if module is None:
        from slime.backends.megatron_utils import model as module
    if getattr(module.get_forward_backward_func, "_prefix_reuse", False):
        return
    stock = module.get_forward_backward_func

    def get_forward_backward_func_with_reuse(*a, **kw):
        from megatron.training.global_vars import get_args
        if not getattr(get_args(), "prefix_reuse", False):
            return stock(*a, **kw)
        call = SlimeReuseCall(get_args(), stock(*a, **kw))
        global last_call
        last_call = call
        return call
    get_forward_backward_func_with_reuse._prefix_reuse = True
    get_forward_backward_func_with_reuse._stock = stock
    module.get_forward_backward_func = get_forward_backward_func_with_reuse


def uninstall(module=None) -> None:
    if module is None:
        from slime.backends.megatron_utils import model as module
    stock = getattr(module.get_forward_backward_func, "_stock", None)
    if stock is not None:
        module.get_forward_backward_func = stock


class _Recorder:
    """Stands in for the model while slime's forward_step prepares a microbatch."""

    def __call__(self, **kwargs):
        if kwargs.get("packed_seq_params") is None:
            raise ValueError("slime's forward_step passed no packed_seq_params; the hook "
                             "expects slime's THD get_batch")
        return None


@dataclass
class _SlimeStep:
    """The step's samples as slime's get_batch prepared them, flattened over its microbatches."""

    per_sample: Dict[str, list]
    tokens: List[torch.Tensor]
    total_lengths: List[int]
    response_lengths: List[int]
    loss: partial


def _record(forward_step_func, data_iterator, num_microbatches: int) -> _SlimeStep:
    """Run slime's forward_step against the recorder, once per slime microbatch."""
    per_sample: Dict[str, list] = {}
    tokens, totals, responses, loss = [], [], [], None
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    for _ in range(num_microbatches):
        _, loss = forward_step_func(iterator, _Recorder())
        batch = loss.args[1]
        if batch.get("multimodal_train_inputs") is not None:
            raise ValueError("--prefix-reuse does not run multimodal batches "
                             "(multimodal_train_inputs)")
        n = len(batch["total_lengths"])
        for key, value in batch.items():
            if key in _PER_SAMPLE_SKIP:
                continue
            if isinstance(value, list) and len(value) == n:
                per_sample.setdefault(key, []).extend(value)
            elif value is not None and not (isinstance(value, list) and not value):
                raise ValueError(f"slime batch key {key!r} is not per sample; the prefix-reuse "
                                 "hook cannot split it")
        tokens += [t[:L] for t, L in zip(batch["unconcat_tokens"], batch["total_lengths"])]
        totals += list(batch["total_lengths"])
        responses += list(batch["response_lengths"])
    return _SlimeStep(per_sample=per_sample, tokens=tokens, total_lengths=totals,
                      response_lengths=responses, loss=loss)


def _rollout(step: _SlimeStep) -> RolloutBatch:
    masks, groups = [], []
    for t, total, resp, m in zip(step.tokens, step.total_lengths, step.response_lengths,
                                 step.per_sample["loss_masks"]):
        prompt = total - resp
        masks.append(torch.cat([torch.zeros(prompt), m.detach().float().cpu()]))
        groups.append(hashlib.sha1(t[:prompt].cpu().numpy().tobytes()).hexdigest())
    return RolloutBatch(tokens=[t.cpu() for t in step.tokens], group_ids=groups, loss_mask=masks)


class SlimeReuseCall:
    """Megatron's forward_backward_func signature; runs slime's loss under the reuse schedule."""

    def __init__(self, args, stock) -> None:
        self.args, self.stock = args, stock
        self.last_report: Optional[str] = None
        self.num_microbatches: Optional[int] = None

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches,
                 forward_only=False, **kwargs):
        if forward_only:  # log-prob passes: slime's dense path
            return self.stock(forward_step_func=forward_step_func, data_iterator=data_iterator,
                              model=model, num_microbatches=num_microbatches,
                              forward_only=True, **kwargs)
        check_slime_args(self.args)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("--prefix-reuse through slime's hook runs pipeline_model_parallel_size"
                             "=1 here; drop --prefix-reuse under PP")
        step = _record(forward_step_func, data_iterator, num_microbatches)
        config = AdapterConfig(sequence_level_loss=True, **self._adapter_kwargs())
        models = model if isinstance(model, list) else [model]
        prepared = PrefixReuseAdapter(models, config).prepare(_rollout(step))
        self.last_report, self.num_microbatches = prepared.report, prepared.num_microbatches
        with megatron_patches.use_prefix_reuse_schedule():
            forward_backward = get_forward_backward_func()
        forward = partial(_forward_step, step=step, num_microbatches=prepared.num_microbatches)
        return forward_backward(forward_step_func=forward, data_iterator=prepared.step,
                                model=models, num_microbatches=prepared.num_microbatches,
                                seq_length=0, micro_batch_size=1, forward_only=False)

    def _adapter_kwargs(self) -> dict:
        out = {}
        if getattr(self.args, "prefix_reuse_min_shared_len", None) is not None:
            out["min_shared_len"] = self.args.prefix_reuse_min_shared_len
        if getattr(self.args, "prefix_reuse_token_budget", None) is not None:
            out["token_budget"] = self.args.prefix_reuse_token_budget
        return out


def _forward_step(data_iterator, model, *, step: _SlimeStep, num_microbatches: int):
    item = next(data_iterator)
    device = next(model.parameters()).device
    item = {k: v.to(device) if torch.is_tensor(v) else v for k, v in item.items()}
    output = model(item["tokens"], item["position_ids"], None)
    if item.get("kind") == "prefix" and "loss_index" not in item:
        return output, None  # Phase A: no loss
    if "loss_index" in item:
        raise ValueError("a prefix unit carries loss tokens; slime's per-sample loss needs "
                         "sequence_level_loss=True planning")
    return output, partial(_slime_loss, item, step=step, num_microbatches=num_microbatches)


def _slime_loss(item, logits, *, step: _SlimeStep, num_microbatches: int):
    """slime's loss_function over this microbatch's samples, logits as slime's THD stream."""
    seq, pos = item[SEQ_INDEX].reshape(-1), item[SEQ_POSITION].reshape(-1)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    real = seq >= 0
    seq, pos, flat_logits = seq[real], pos[real], flat_logits[real]
    samples = sorted(set(seq.tolist()))
    starts, offsets, total = {}, {}, 0
    for i in samples:
        covered = pos[seq == i]
        prompt = step.total_lengths[i] - step.response_lengths[i]
        _check_covered(i, covered, prompt, step)
        starts[i] = min(int(covered.min()), prompt) - 1
        offsets[i] = total
        total += step.total_lengths[i] - starts[i]
    base = torch.tensor([offsets[int(i)] - starts[int(i)] - 1 for i in seq.tolist()],
                        device=seq.device, dtype=torch.int64)
    where = base + pos
    stream = flat_logits.new_zeros(total, flat_logits.shape[-1]).index_put((where,), flat_logits)
    args, _, _, step_global_batch_size = step.loss.args[:4]
    batch = {key: [values[i] for i in samples] for key, values in step.per_sample.items()}
    batch["unconcat_tokens"] = [step.tokens[i][starts[i]:].to(logits.device) for i in samples]
    batch["total_lengths"] = [step.total_lengths[i] - starts[i] for i in samples]
    batch["response_lengths"] = [step.response_lengths[i] for i in samples]
    batch.setdefault("rollout_mask_sums", None)
    return step.loss.func(args, batch, num_microbatches, step_global_batch_size,
                          stream.unsqueeze(0).float())


def _check_covered(i: int, covered: torch.Tensor, prompt: int, step: _SlimeStep) -> None:
    """Every response token with loss_mask 1 of sample i must be predicted in this microbatch."""
    mask = step.per_sample["loss_masks"][i].reshape(-1)
    need = (torch.nonzero(mask.cpu() > 0).reshape(-1) + prompt).tolist()
    have = set(covered.tolist())
    missing = [p for p in need if p not in have]
    if missing or len(have) != covered.numel():
        raise RuntimeError(f"sample {i}: loss positions {missing[:4]} not in its reuse "
                           "microbatch (or predicted twice); the plan broke sequence_level_loss")
