"""AReaL 1.0.4: its Megatron engine's `train_batch` with prefix reuse, under AReaL's own loss code.

The switch is a config key in AReaL's dataclass style: `prefix_reuse: PrefixReuseConfig` on the
engine config (`with_prefix_reuse(PPOActorConfig)` makes the subclass; YAML
`actor.prefix_reuse.enabled: true`), read by `engine_class()`'s `PrefixReuseMegatronEngine`
(AReaL's `MegatronEngine` / `MegatronPPOActor` with `train_batch` overridden). With the key off
the engine is AReaL's, unchanged. With it on, against `MegatronEngine.train_batch`:
- micro-batches: the adapter's plan (groups: sequences sharing their first `min_shared_len`
  tokens), never AReaL's `_prepare_mb_list` (its length-balanced split ignores prefixes);
- the normaliser is AReaL's: `compute_total_loss_weight` over the whole batch with the engine's
  `loss_weight_fn`, all-reduced over DP x CP as AReaL does;
- each reuse micro-batch's loss is AReaL's own `_compute_logprobs_and_loss` (its log-prob and
  entropy gather with the engine's temperature, `loss_fn` such as `grpo_loss_fn`, the
  `local_weight / total_weight * loss_multiplier` factor) on an AReaL micro-batch dict packed by
  AReaL's `pack_tensor_dict`: per touched sample the span of positions the micro-batch computes,
  `loss_mask` restricted to them (token sums partition exactly); `loss_multiplier` =
  dp x loss scale x the REUSE step's micro-batch count (AReaL's `len(mb_list)` factor);
- then AReaL's `optimizer_step`.
Refused before compute, naming the setting: tree training on as well (`enable_tree_training`:
pick one), a critic (`is_critic`), a vision model, context or pipeline parallelism (not tested
here), M2PO (`m2_threshold`: its token filter is a statistic of the whole micro-batch, so any
other micro-batching changes it), another AReaL release. Sequence-level losses (GSPO
`importance_sampling_level="sequence"`, sequence-level rejection sampling) switch the adapter's
`sequence_level_loss` on (every loss token of a sequence in one micro-batch).
AReaL is imported lazily: this module imports without it (tests: `make test-frameworks`).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.rollout import RolloutBatch, TokenBatch

__all__ = ["SUPPORTED_AREAL", "PrefixReuseConfig", "check_areal_version", "with_prefix_reuse", "install",
           "rollout_from_areal", "engine_class", "areal_train_batch"]

SUPPORTED_AREAL = ("1.0.4",)
"""AReaL releases this module was tested with (make test-frameworks)."""


@dataclass
class PrefixReuseConfig:
    """Shared-prefix reuse for AReaL's Megatron engine (megatron_patches.frameworks.areal)."""

    enabled: bool = field(default=False, metadata={
        "help": "Train with prefix reuse: each shared prompt prefix runs forward and backward "
                "once per step (exact against the dense step)."})
    min_shared_len: int = field(default=8, metadata={
        "help": "Sequences sharing fewer leading tokens are not grouped; shorter shared spans "
                "are not cached."})
    token_budget: Optional[int] = field(default=None, metadata={
        "help": "Tokens per suffix micro-batch (None: the planner's default)."})
    prefix_chunk_tokens: Optional[int] = field(default=None, metadata={
        "help": "Run long prefixes as chunks of at most this many tokens (None: whole)."})
    min_gain: float = field(default=1.0, metadata={
        "help": "A group whose FLOP gain is below this runs dense."})

    def __post_init__(self) -> None:
        if self.min_shared_len < 2:
            raise ValueError(f"prefix_reuse.min_shared_len={self.min_shared_len}; give >= 2")

    def adapter_config(self, *, sequence_level_loss: bool) -> AdapterConfig:
        return AdapterConfig(min_shared_len=self.min_shared_len, token_budget=self.token_budget,
                             prefix_chunk_tokens=self.prefix_chunk_tokens, min_gain=self.min_gain,
                             sequence_level_loss=sequence_level_loss)


def check_areal_version(version: Optional[str] = None) -> None:
    """ValueError unless AReaL (or `version`) is a supported release."""
    if version is None:
        from importlib.metadata import version as dist_version
        version = dist_version("areal")
    if version not in SUPPORTED_AREAL:
        raise ValueError(f"AReaL {version} is not supported by megatron_patches.frameworks.areal: "
                         f"it is tested with areal=={SUPPORTED_AREAL[0]}; install that release or "
                         "run AReaL's own engine without prefix_reuse")


@functools.lru_cache(maxsize=None)
def with_prefix_reuse(base: type) -> type:
    """AReaL config dataclass `base` (TrainEngineConfig, PPOActorConfig, ...) with the field
    `prefix_reuse: PrefixReuseConfig` added (default: off)."""
    return dataclasses.make_dataclass(
        f"{base.__name__}WithPrefixReuse",
        [("prefix_reuse", PrefixReuseConfig, field(default_factory=PrefixReuseConfig, metadata={
            "help": "Shared-prefix reuse on the Megatron engine (megatron_patches)."}))],
        bases=(base,))


def _group_ids(sequences: List[torch.Tensor], min_shared_len: int) -> List[tuple]:
    """Sequences that share their first `min_shared_len` tokens form a group (others cannot
    share a cached prefix of that length)."""
    return [tuple(s[:min_shared_len].tolist()) for s in sequences]


def rollout_from_areal(data: Dict[str, Any], *, min_shared_len: int) -> RolloutBatch:
    """AReaL's padded batch (`input_ids` / `attention_mask` [B, S] right-padded, `loss_mask`,
    `logprobs`, `advantages` rolled by -1: entry t is about predicting token t+1) -> a
    RolloutBatch (token-aligned). Old log-probs and advantages are carried for the report only:
    the loss reads AReaL's own arrays."""
    for key in ("input_ids", "attention_mask", "loss_mask"):
        if key not in data:
            raise ValueError(f"AReaL batch has no {key!r}; give the actor's padded batch")
    keep = data["attention_mask"].bool().cpu()
    right_padded = torch.arange(keep.shape[1])[None] < keep.sum(1, keepdim=True)
    if not torch.equal(keep, right_padded):
        raise ValueError("AReaL batch's attention_mask is not right-padded; give AReaL's "
                         "padded batch (real tokens first)")
    lengths = keep.sum(1).tolist()
    tokens = [data["input_ids"][b, :n].cpu() for b, n in enumerate(lengths)]

    def token_aligned(name):
        rows = data[name].float().detach().cpu()
        return [torch.cat([torch.zeros(1), rows[b, :n - 1]]) for b, n in enumerate(lengths)]
    mask = token_aligned("loss_mask")
    mask = [(m != 0).float() for m in mask]
    return RolloutBatch(tokens=tokens, loss_mask=mask,
                        group_ids=_group_ids(tokens, min_shared_len),
                        advantages=token_aligned("advantages") if "advantages" in data else None,
                        old_logprobs=token_aligned("logprobs") if "logprobs" in data else None)


def _loss_settings(loss_fn) -> Dict[str, Any]:
    keywords = dict(getattr(loss_fn, "keywords", None) or {})
    return keywords


def check_supported(engine, loss_fn) -> bool:
    """ValueError naming the setting that reuse refuses (module docstring); returns whether the
    loss is sequence-level (GSPO, sequence-level rejection sampling)."""
    config = engine.config
    if getattr(config, "enable_tree_training", False):
        raise ValueError("actor.enable_tree_training=True and actor.prefix_reuse.enabled=True: "
                         "both share prefixes; pick one (set enable_tree_training=false)")
    if getattr(config, "is_critic", False):
        raise ValueError("prefix_reuse on a critic (is_critic=True) is not supported: its loss "
                         "reads values, not log-probs; turn prefix_reuse off for the critic")
    if getattr(engine, "is_vision_model", False):
        raise ValueError("prefix_reuse with a vision model is not supported; turn it off")
    if getattr(engine.tf_config, "calculate_per_token_loss", False):
        raise ValueError("prefix_reuse with calculate_per_token_loss=True is not supported: "
                         "AReaL's loss returns Megatron's 2-tuple; leave it off")
    strategy = engine.parallel_strategy
    for name in ("context_parallel_size", "pipeline_parallel_size"):
        if getattr(strategy, name, 1) > 1:
            raise ValueError(f"prefix_reuse with AReaL's {name}={getattr(strategy, name)} is not "
                             "tested; run it with 1 or turn prefix_reuse off")
    settings = _loss_settings(loss_fn)
    if settings.get("m2_threshold") is not None:
        raise ValueError("prefix_reuse with M2PO (m2_threshold set) is refused: its token filter "
                         "is a statistic of the whole micro-batch, so reuse's other micro-batches "
                         "would change which tokens train; unset m2_threshold or turn "
                         "prefix_reuse off")
    level = settings.get("importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r}; AReaL knows 'token' or 'sequence'")
    rs = settings.get("rejection_sampling")
    return level == "sequence" or getattr(rs, "level", "token") == "sequence"


def _spans(b: TokenBatch) -> Dict[int, tuple]:
    """Per touched sample: (lo, hi), the token slice [lo, hi] whose rolled entries lo..hi-1
    predict the positions lo+1..hi this micro-batch computes."""
    seq, pos = b.sequence_index.cpu().tolist(), b.position.cpu().tolist()
    spans: Dict[int, list] = {}
    for s, j in zip(seq, pos):
        span = spans.setdefault(s, [j, j])
        span[0], span[1] = min(span[0], j), max(span[1], j)
    return {s: (lo - 1, hi) for s, (lo, hi) in sorted(spans.items())}


def _micro_batch(data: Dict[str, Any], b: TokenBatch, vocab: int):
    """AReaL's packed micro-batch dict of the spans `b` computes (loss_mask restricted to them)
    and its logits [T, V] (rows `b` computes, zeros elsewhere), via AReaL's pack_tensor_dict."""
    from areal.utils.data import pack_tensor_dict
    spans = _spans(b)
    samples = list(spans)
    B, S = data["attention_mask"].shape
    width = max(hi - lo + 1 for lo, hi in spans.values())
    device = b.logprobs.device
    rows = {}
    for key, value in data.items():
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (B, S):
            out = value.new_zeros((len(samples), width, *value.shape[2:]))
            for r, s in enumerate(samples):
                lo, hi = spans[s]
                out[r, :hi - lo + 1] = value[s, lo:hi + 1]
            rows[key] = out.to(device)
        elif torch.is_tensor(value) and value.dim() == 1 and value.shape[0] == B:
            rows[key] = value[samples].to(device)
        else:
            rows[key] = value
    attention = torch.zeros(len(samples), width, dtype=torch.bool)
    present = torch.zeros(len(samples), width)
    local = {s: r for r, s in enumerate(samples)}
    for r, s in enumerate(samples):
        lo, hi = spans[s]
        attention[r, :hi - lo + 1] = True
    seq, pos = b.sequence_index.cpu(), b.position.cpu()
    r_of = torch.tensor([local[int(s)] for s in seq.tolist()], dtype=torch.int64)
    k_of = pos - 1 - torch.tensor([spans[int(s)][0] for s in seq.tolist()], dtype=torch.int64)
    present[r_of, k_of] = 1.0
    rows["attention_mask"] = attention.to(device)
    rows["loss_mask"] = rows["loss_mask"] * present.to(device).to(rows["loss_mask"].dtype)
    packed = pack_tensor_dict(rows)
    cu = packed["cu_seqlens"].cpu()
    flat = (cu[r_of] + k_of).to(device)
    logits = torch.zeros(int(cu[-1]), vocab, device=device, dtype=b.fields["_logits"].dtype)
    logits = logits.index_put((flat,), b.fields["_logits"])
    return packed, logits


def areal_train_batch(engine, input_, loss_fn, loss_weight_fn) -> Dict[str, float]:
    """`MegatronEngine.train_batch` with prefix reuse (module docstring)."""
    check_areal_version()
    from megatron.core import parallel_state as mpu
    from areal.engine.core import compute_total_loss_weight
    engine._ensure_ready()
    sequence_level = check_supported(engine, loss_fn)
    engine.optimizer_zero_grad()
    data, _ = engine._normalize_batch_input(input_)
    data = {k: (v.to(engine.device) if torch.is_tensor(v) and engine.device is not None else v)
            for k, v in data.items()}
    reuse = engine.config.prefix_reuse
    rollout = rollout_from_areal(data, min_shared_len=reuse.min_shared_len)
    adapter = PrefixReuseAdapter(engine.model[0] if len(engine.model) == 1 else list(engine.model),
                                 reuse.adapter_config(sequence_level_loss=sequence_level))
    prepared = adapter.prepare(rollout)
    total_loss_weight = compute_total_loss_weight(
        types.SimpleNamespace(mbs=[data]), loss_weight_fn,
        mpu.get_data_parallel_group(with_context_parallel=True))
    loss_multiplier = (mpu.get_data_parallel_world_size()
                       * engine.optimizer.get_loss_scale().item() * prepared.num_microbatches)
    vocab = adapter_vocab(adapter)

    def reuse_loss(b: TokenBatch):
        packed, logits = _micro_batch(data, b, vocab)
        loss = engine._compute_logprobs_and_loss(logits, packed, loss_fn, loss_weight_fn,
                                                 total_loss_weight, loss_multiplier=loss_multiplier)
        return loss, {}
    _run(prepared, reuse_loss, adapter)
    stats = engine.optimizer_step()
    stats["num_micro_batches"] = prepared.num_microbatches
    engine.prefix_reuse_report = prepared.report  # what was shared (a string, not a stat)
    return stats


def adapter_vocab(adapter: PrefixReuseAdapter) -> int:
    return adapter.dims.vocab_size


def _run(prepared, loss_fn, adapter) -> None:
    """The adapter's step with logits exposed to `loss_fn` (`TokenBatch.fields['_logits']`)."""
    import megatron_patches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    with megatron_patches.use_prefix_reuse_schedule():
        forward_backward = get_forward_backward_func()
    forward_backward(forward_step_func=prepared.forward_step(loss_fn, expose_logits=True),
                     data_iterator=prepared.step, model=adapter.models,
                     num_microbatches=prepared.num_microbatches, seq_length=0,
                     micro_batch_size=1, forward_only=False)


@functools.lru_cache(maxsize=None)
def engine_class(base: Optional[type] = None) -> type:
    """AReaL's engine class `base` (default `MegatronPPOActor`) whose `train_batch` runs the
    prefix-reuse step when `config.prefix_reuse.enabled` (module docstring)."""
    check_areal_version()
    if base is None:
        from areal.engine.megatron_engine import MegatronPPOActor as base

    class PrefixReuseMegatronEngine(base):
        """AReaL's Megatron engine with `prefix_reuse` (megatron_patches.frameworks.areal)."""

        def train_batch(self, input_, loss_fn, loss_weight_fn):
            reuse = getattr(self.config, "prefix_reuse", None)
            if reuse is None or not reuse.enabled:
                return super().train_batch(input_, loss_fn, loss_weight_fn)
            return areal_train_batch(self, input_, loss_fn, loss_weight_fn)
    PrefixReuseMegatronEngine.__name__ = f"PrefixReuse{base.__name__}"
    return PrefixReuseMegatronEngine


def install() -> type:
    """Make AReaL's trainer build the prefix-reuse actor: `areal.engine.MegatronPPOActor` becomes
    `engine_class()` (PPOTrainer's `_create_train_engine` imports it from there when the
    allocation backend is megatron). Returns the class; idempotent. With
    `actor.prefix_reuse.enabled=false` (or no key) the engine is AReaL's."""
    import areal.engine
    cls = engine_class()
    areal.engine.MegatronPPOActor = cls
    return cls
