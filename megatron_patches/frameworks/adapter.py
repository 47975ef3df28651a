"""One entry point for RL frameworks: their batch in, a prefix-reuse step under THEIR loss out.

    adapter = PrefixReuseAdapter(model, AdapterConfig())
    result = adapter.forward_backward(rollout, loss_fn)            # a training step
    result = adapter.forward_backward(rollout, None, forward_only=True)  # old/ref log-probs

`rollout` is a RolloutBatch (per-sequence tokens, loss mask, advantages, old/ref log-probs,
group ids). The adapter looks for shared prefixes inside each group (detect.py: a group whose
members share too little runs dense, partial sharing becomes a prefix tree), lets the FLOP policy
decide per group (policy.py), plans, and runs ONE `get_forward_backward_func()` call with the
prefix-reuse schedule. `loss_fn(TokenBatch)` is the framework's loss for one microbatch and keeps
Megatron's contract: it returns `(loss, report)` (Megatron divides by the step's microbatch count:
multiply by `TokenBatch.num_microbatches`, the count of THIS step, where a framework multiplies by
its own) or `(loss_sum, num_tokens, report)` (with `calculate_per_token_loss=True` Megatron
divides by the tokens summed over microbatches and data-parallel ranks: no factor at all).
Exactness needs a loss that is a sum over tokens of per-token terms (any per-token weights, such
as 1/global tokens or 1/(sequence tokens x batch size)): a prefix-tree node's loss tokens and a
suffix's are different microbatches. A per-SEQUENCE nonlinear loss (a sequence-level ratio)
needs `AdapterConfig(sequence_level_loss=True)`: then every loss token of a sequence is in one
microbatch. Returned: Megatron's per-microbatch reports, and per sequence the log-probs (and
entropy) of its loss-mask positions, in the framework's order (docs/FRAMEWORKS.md).

For a framework that keeps its own call: `prepared = adapter.prepare(rollout)` gives the
data_iterator (`prepared.step`), `prepared.num_microbatches` and
`prepared.forward_step(loss_fn)`; select the schedule with
`megatron_patches.use_prefix_reuse_schedule()` and read the results with
`prepared.collect(losses_reduced)`.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional

import torch

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.detect import (DEFAULT_MIN_SHARED_LEN, DEFAULT_NODE_OVERHEAD_TOKENS,
                                             Detection, FlatTrajectory,
                                             checked_flat_trajectories, detect_prefix_trees)
from prefix_schedule.planning.flops import ModelDims, dense_flops, reuse_flops
from prefix_schedule.planning.policy import DEFAULT_MIN_GAIN, ReusePolicy, plan_with_policy

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model

import megatron_patches
from megatron_patches.frameworks.indexing import (SEQ_INDEX, SEQ_POSITION, IndexedReuseStep,
                                                  shadow_batch)
from megatron_patches.frameworks.rollout import RolloutBatch, TokenBatch
from megatron_patches.rl import token_entropy, token_logprobs
from megatron_patches.runtime.layers import has_recurrent_layers
from megatron_patches.training import row_multiple_for

__all__ = ["AdapterConfig", "AdapterResult", "PreparedStep", "PrefixReuseAdapter",
           "LossFn", "detect_by_group", "dims_of_model"]

LossFn = Callable[[TokenBatch], tuple]


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """How the adapter detects and plans."""

    min_shared_len: int = DEFAULT_MIN_SHARED_LEN
    """Shared spans shorter than this are not cached (detect.py)."""
    node_overhead_tokens: int = DEFAULT_NODE_OVERHEAD_TOKENS
    """A tree node must save this many token-rows (detect.py)."""
    min_gain: float = DEFAULT_MIN_GAIN
    """A group whose FLOP gain is below this runs dense (policy.py)."""
    token_budget: Optional[int] = None
    """Tokens per suffix microbatch (None: the policy's default)."""
    prefix_chunk_tokens: Optional[int] = None
    """Split long prefixes into units of this many tokens (None: whole)."""
    compute_entropy: bool = False
    """Give the loss (and the result) per-token entropy."""
    sequence_level_loss: bool = False
    """The loss is nonlinear per sequence: keep every loss token of a sequence in one
    microbatch (sharing stops at a sequence's first loss token)."""
    temperature: float = 1.0
    """Sampling temperature: log-probs and entropy of softmax(logits / temperature), the
    division in the logits' dtype as verl's logits processor does it (1.0: logits as they are)."""

    def __post_init__(self) -> None:
        if self.token_budget is not None and self.token_budget < 2:
            raise ValueError(f"token_budget={self.token_budget}; give >= 2 tokens or None")
        if not self.min_gain > 0:
            raise ValueError(f"min_gain={self.min_gain}; give a positive FLOP gain (1.0: reuse "
                             "whenever it saves FLOPs)")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}; give a positive sampling "
                             "temperature (1.0: none)")


@dataclass(kw_only=True)
class AdapterResult:
    """What the step returns, in the framework's sequence order."""

    losses_reduced: list
    """Megatron's return value: what loss_fn reported per microbatch (last pipeline stage)."""
    logprobs: Optional[List[torch.Tensor]]
    """Per sequence [n_i]: log p(tokens[j]) at its loss-mask positions, 0 elsewhere (None off
    the last pipeline stage)."""
    entropy: Optional[List[torch.Tensor]]
    """The same for the entropy (compute_entropy=True)."""
    num_microbatches: int
    """Microbatches of the step (Megatron's count)."""
    report: str
    """What was shared, what ran dense, the FLOP-ideal speedup."""


def dims_of_model(model) -> ModelDims:
    """The FLOP model's shape of a Megatron GPT model (policy input)."""
    gpt = unwrap_model(model[0] if isinstance(model, list) else model)
    c = gpt.config
    if getattr(c, "multi_latent_attention", False):  # never cost MLA as GQA
        raise ValueError("dims_of_model: the FLOP model (ModelDims) does not count multi-latent "
                         "attention (low-rank q/kv projections, Q/K head dim "
                         "qk_head_dim + qk_pos_emb_head_dim != V's); the framework adapter's "
                         "FLOP report cannot describe this model (docs/LIMITS.md, MLA)")
    return ModelDims(num_layers=c.num_layers, hidden_size=c.hidden_size,
                     ffn_hidden_size=c.ffn_hidden_size, num_attention_heads=c.num_attention_heads,
                     num_query_groups=c.num_query_groups or c.num_attention_heads,
                     vocab_size=gpt.vocab_size, gated_linear_unit=bool(c.gated_linear_unit),
                     kv_channels=c.kv_channels, **window_dims(c))


def window_dims(config) -> dict:
    """ModelDims' window fields from a TransformerConfig (window_size (W, 0), skip freq int)."""
    if config.window_size is None or config.window_size[0] < 0:
        return {}
    freq = config.window_attn_skip_freq
    if freq is not None and not isinstance(freq, int):
        raise ValueError(f"window_attn_skip_freq={freq!r}: the FLOP model takes an int (or None)")
    return dict(window_size=int(config.window_size[0]), window_attn_skip_freq=freq)


def _flats(rollout: RolloutBatch) -> List[FlatTrajectory]:
    checked = checked_flat_trajectories(rollout.tokens, rollout.loss_mask, rollout.advantages,
                                        rollout.old_logprobs, rollout.ref_logprobs)
    if checked is not None:
        return checked
    out = []  # one by one: the first sequence that fails is named
    for i in range(rollout.num_sequences):
        try:
            out.append(FlatTrajectory(
                tokens=rollout.tokens[i], loss_mask=rollout.loss_mask[i],
                advantages=rollout.advantages[i],
                old_logprobs=None if rollout.old_logprobs is None else rollout.old_logprobs[i],
                ref_logprobs=None if rollout.ref_logprobs is None else rollout.ref_logprobs[i]))
        except ValueError as error:
            raise ValueError(f"sequence {i}: {error}") from None
    return out


def detect_by_group(rollout: RolloutBatch, flats: List[FlatTrajectory],
                    config: AdapterConfig) -> Detection:
    """Shared prefixes inside each framework group (never across: groups stay whole), merged
    into one Detection whose sources are RolloutBatch indices."""
    members: Dict[object, List[int]] = {}
    for i, gid in enumerate(rollout.group_ids):
        members.setdefault(gid, []).append(i)
    groups, sources, shared, lost = [], [], 0, 0
    for ids in members.values():
        found = detect_prefix_trees([flats[i] for i in ids], min_shared_len=config.min_shared_len,
                                    node_overhead_tokens=config.node_overhead_tokens,
                                    cache_loss_tokens=not config.sequence_level_loss)
        groups += found.batch.groups
        sources += [tuple(ids[j] for j in src) for src in found.sources]
        shared, lost = shared + found.shared_tokens, lost + found.lost_to_loss_tokens
    return Detection(batch=GroupBatch(groups=groups), sources=tuple(sources), shared_tokens=shared,
                     total_tokens=sum(rollout.lengths), lost_to_loss_tokens=lost)


class _TokenStore:
    """Per-token arrays of the rollout on the model's device, and what the step computed."""

    def __init__(self, rollout: RolloutBatch, device, entropy: bool) -> None:
        lengths = torch.tensor(rollout.lengths)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]).to(device)
        names = ["loss_mask", "advantages", "old_logprobs", "ref_logprobs", *rollout.fields]
        self.arrays = {n: (None if rollout.flat(n) is None else rollout.flat(n).to(device))
                       for n in names}
        total = int(lengths.sum())
        self.logprobs = torch.zeros(total, device=device)
        self.entropy = torch.zeros(total, device=device) if entropy else None



def _loss(item, logits, *, prepared: "PreparedStep", loss_fn: Optional[LossFn],
          expose_logits: bool = False):
    if "loss_index" in item:  # a prefix-tree unit: one entry per (trajectory, loss token)
        logits = logits[:, item["loss_index"][0]]
    if prepared.config.temperature != 1.0:
        logits = logits / torch.tensor(prepared.config.temperature, dtype=logits.dtype,
                                       device=logits.device)
    seq, pos = item[SEQ_INDEX].reshape(-1), item[SEQ_POSITION].reshape(-1)  # rows [b, s]
    real = seq >= 0
    logprobs = token_logprobs(logits, item["labels"]).reshape(-1)[real]
    entropy = (token_entropy(logits).reshape(-1)[real] if prepared.config.compute_entropy
               else None)
    seq, pos = seq[real], pos[real]
    store = prepared.store
    flat = store.offsets[seq] + pos
    store.logprobs[flat] = logprobs.detach().float()
    if entropy is not None:
        store.entropy[flat] = entropy.detach().float()
    if loss_fn is None:  # a log-prob pass without a loss
        return logprobs.sum() * 0.0, {}
    arrays = {n: (None if a is None else a[flat]) for n, a in store.arrays.items()}
    if expose_logits:  # a framework that computes log-probs itself (frameworks/areal.py)
        arrays["_logits"] = logits.reshape(-1, logits.shape[-1])[real]
    batch = TokenBatch(logprobs=logprobs, entropy=entropy, sequence_index=seq, position=pos,
                       loss_mask=arrays.pop("loss_mask"), advantages=arrays.pop("advantages"),
                       old_logprobs=arrays.pop("old_logprobs"),
                       ref_logprobs=arrays.pop("ref_logprobs"), fields=arrays,
                       num_microbatches=prepared.num_microbatches, rollout=prepared.rollout)
    out = loss_fn(batch)
    _check_contract(out, prepared)
    return out


def _check_contract(out, prepared: "PreparedStep") -> None:
    """Megatron's loss_func contract, and exactness under reuse: without per-token loss Megatron
    divides a 3-tuple's loss by its num_tokens, which must then not depend on the packing (a
    constant, as slime's 1)."""
    per_token = prepared.per_token
    ok = isinstance(out, tuple) and (len(out) == 3 if per_token else len(out) in (2, 3))
    if not ok:
        raise ValueError(
            f"with calculate_per_token_loss={per_token} loss_fn must return "
            + ("(loss_sum, num_tokens, report)" if per_token else
               "(loss, report) (or (loss, constant, report)), the loss normalised over the "
               "global batch and multiplied by TokenBatch.num_microbatches")
            + f"; got {type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}")
    if len(out) == 3:
        _check_num_tokens(out[1], per_token)
    loss = out[0]
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(f"loss_fn returned a loss of {type(loss).__name__} "
                         f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}; return one "
                         "scalar tensor that carries the gradient")
    finite = torch.isfinite(loss.detach()).reshape(())  # checked once after the call (no sync)
    prepared.loss_finite = finite if prepared.loss_finite is None else prepared.loss_finite & finite
    if not per_token and len(out) == 3:
        count = float(out[1])
        if prepared.constant_num_tokens is None:
            prepared.constant_num_tokens = count
        elif count != prepared.constant_num_tokens:
            raise ValueError(
                f"loss_fn returned num_tokens {prepared.constant_num_tokens} and then {count} "
                "with calculate_per_token_loss=False: Megatron divides each microbatch's loss by "
                "it, so the gradient would depend on how sequences are packed; return a constant "
                "(as slime's 1) or set calculate_per_token_loss=True")


def _check_num_tokens(num_tokens, per_token: bool) -> None:
    """Megatron adds num_tokens into an int tensor (and divides by it): an integer tensor."""
    integer = torch.is_tensor(num_tokens) and num_tokens.numel() == 1 and not (
        num_tokens.is_floating_point() or num_tokens.dtype == torch.bool)
    if not integer:
        got = (f"a {num_tokens.dtype} tensor of shape {tuple(num_tokens.shape)}"
               if torch.is_tensor(num_tokens) else f"a {type(num_tokens).__name__}")
        raise ValueError(f"loss_fn returned num_tokens as {got}; return one integer tensor on "
                         "the model's device" + (", e.g. TokenBatch.num_tokens (the loss mask's "
                                                 "sum as torch.int)" if per_token else
                                                 " (a constant, as slime's torch.tensor(1))"))


def check_finite_loss(prepared: "PreparedStep", models) -> None:
    """Raise if loss_fn returned NaN / inf in this step, or the step's gradients are not finite
    (finite_grads.py), on every rank together."""
    from megatron_patches.runtime.agreement import StepChecks
    from megatron_patches.runtime.finite_grads import check_finite_grads

    def loss_check():
        if prepared.loss_finite is not None and not bool(prepared.loss_finite):
            raise ValueError("loss_fn returned a NaN or inf loss in this step: its gradients are "
                             "not finite; do not run the optimizer. Check what the loss reads "
                             "(log-probs, advantages, old log-probs at masked positions)")
    checks = StepChecks(models[0])
    checks.run(loss_check)
    checks.run(check_finite_grads, models)
    checks.agree()


@dataclass(kw_only=True)
class PreparedStep:
    """A planned step: data iterator, microbatch count, forward step, result collection."""

    rollout: RolloutBatch
    config: AdapterConfig
    step: object
    """The data_iterator of the call (an IndexedReuseStep, or the dense rows' iterator)."""
    num_microbatches: int
    report: str
    sources: tuple = ()
    """Per planned group, the RolloutBatch indices of its sequences."""
    per_token: bool = False
    """calculate_per_token_loss of the model: which return contract loss_fn keeps."""
    store: Optional[_TokenStore] = None
    constant_num_tokens: Optional[float] = None
    loss_finite: Optional[torch.Tensor] = None
    """Whether every loss loss_fn returned in this step was finite (a device flag)."""

    def forward_step(self, loss_fn: Optional[LossFn], *, expose_logits: bool = False) -> Callable:
        """Megatron's forward_step_func for this step, with `loss_fn` as the loss
        (`expose_logits`: the loss also gets the logit rows it computes, [n, V] with gradient,
        as `TokenBatch.fields['_logits']`, for a framework that computes log-probs itself)."""
        prepared = self

        def forward_step(data_iterator, model):
            item = next(data_iterator)
            device = next(model.parameters()).device
            if prepared.store is None:
                prepared.store = _TokenStore(prepared.rollout, device, prepared.config.compute_entropy)
            item = {k: v.to(device) if torch.is_tensor(v) else v for k, v in item.items()}
            output = model(item["tokens"], item["position_ids"], None)
            if item.get("kind") == "prefix" and "loss_index" not in item:
                return output, None  # Phase A: no loss
            return output, partial(_loss, item, prepared=prepared, loss_fn=loss_fn,
                                   expose_logits=expose_logits)
        return forward_step

    def collect(self, losses_reduced) -> AdapterResult:
        """The result after the call (per-sequence arrays at loss-mask positions)."""
        store = self.store
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)

        def per_sequence(flat):
            if flat is None or not last:
                return None
            mask = torch.cat(self.rollout.loss_mask).to(flat.device)
            return [t.cpu() for t in (flat * mask).split(self.rollout.lengths)]
        return AdapterResult(losses_reduced=losses_reduced,
                             logprobs=per_sequence(None if store is None else store.logprobs),
                             entropy=per_sequence(None if store is None else store.entropy),
                             num_microbatches=self.num_microbatches, report=self.report)


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for the block (restored after). `prepare` makes
    tens of thousands of small objects per step (trajectories, their arrays, the shadow batch,
    the plan); each allocation burst triggers collections that walk every object of the
    process, the model's included: at 512 groups x 16 that doubled `prepare`'s time
    (docs/FRAMEWORKS.md "Measure"). Any cyclic garbage it leaves goes at the next collection
    after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PrefixReuseAdapter:
    """The framework-neutral entry (module docstring). `model`: a Megatron GPT model (or this
    rank's model chunks), with `finalize_model_grads_func` set as the framework sets it."""

    def __init__(self, model, config: Optional[AdapterConfig] = None, *,
                 dims: Optional[ModelDims] = None) -> None:
        self.models = model if isinstance(model, list) else [model]
        self.config = config or AdapterConfig()
        self.dims = dims or dims_of_model(self.models)

    def prepare(self, rollout: RolloutBatch) -> PreparedStep:
        """Detect, decide, plan and build the step; ValueError before any compute."""
        if not isinstance(rollout, RolloutBatch):
            raise ValueError(f"expected a RolloutBatch, got {type(rollout).__name__}")
        with _gc_paused():
            return self._prepare(rollout)

    def _prepare(self, rollout: RolloutBatch) -> PreparedStep:
        gpt = unwrap_model(self.models[0])
        flats = _flats(rollout)
        detection = detect_by_group(rollout, flats, self.config)
        policy = ReusePolicy(dims=self.dims, min_gain=self.config.min_gain,
                             token_budget=self.config.token_budget)
        planned = plan_with_policy(detection.batch, policy=policy,
                                   max_seq_len=gpt.max_sequence_length,
                                   row_multiple=row_multiple_for(get_model_config(self.models[0])),
                                   prefix_chunk_tokens=self.config.prefix_chunk_tokens,
                                   vocab_size=gpt.vocab_size,
                                   state_reads=has_recurrent_layers(
                                       get_model_config(self.models[0]), gpt))
        model_config = get_model_config(self.models[0])
        per_token = bool(model_config.calculate_per_token_loss)
        if not per_token and model_config.num_moe_experts:
            raise ValueError("an MoE model needs calculate_per_token_loss=True with prefix reuse "
                             "(router statistics count a prefix token once per trajectory in "
                             "that mode only); use the (loss_sum, num_tokens, report) contract")
        step = IndexedReuseStep(
            detection.batch, planned.plan, shadow=shadow_batch(detection, flats),
            global_loss_contract=not per_token, data_digest=rollout.fields_digest(),
            num_stages=parallel_state.get_pipeline_model_parallel_world_size(),
            num_model_chunks=len(self.models))
        dense = dense_flops(self.dims, [n - 1 for n in rollout.lengths])
        ideal = dense / reuse_flops(self.dims, planned.plan)
        report = "\n".join([detection.describe(), planned.describe(),
                            f"expected speedup (FLOP-ideal): {ideal:.2f}x"])
        return PreparedStep(rollout=rollout, config=self.config, step=step, per_token=per_token,
                            sources=detection.sources,
                            num_microbatches=step.num_microbatches, report=report)

    def forward_backward(self, rollout: RolloutBatch, loss_fn: Optional[LossFn], *,
                         forward_only: bool = False) -> AdapterResult:
        """One Megatron call with the prefix-reuse schedule (Phase A + B only if forward_only)."""
        if loss_fn is None and not forward_only:
            raise ValueError("a training step needs the framework's loss_fn; pass loss_fn or "
                             "forward_only=True (a log-prob pass)")
        prepared = self.prepare(rollout)
        with megatron_patches.use_prefix_reuse_schedule():
            forward_backward = get_forward_backward_func()
        losses = forward_backward(forward_step_func=prepared.forward_step(loss_fn),
                                  data_iterator=prepared.step, model=self.models,
                                  num_microbatches=prepared.num_microbatches, seq_length=0,
                                  micro_batch_size=1, forward_only=forward_only)
        if not forward_only:
            check_finite_loss(prepared, self.models)
        return prepared.collect(losses)
