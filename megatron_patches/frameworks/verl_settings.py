"""Which verl 0.9.1 settings the prefix-reuse step runs exactly, and how; the rest refused.

`reuse_settings(engine, data, loss_function)` reads verl's engine config, the batch's meta
fields and the actor config inside verl's loss (`partial(ppo_loss, config=...)`, as
`ActorRolloutRefWorker.init_model` builds it) and returns the adapter's settings, or raises a
ValueError naming the setting BEFORE any compute. Why each mode is exact (verl 0.9.1's
`verl/trainer/ppo/core_algos.py`, `verl/workers/utils/losses.py`):

- token-level losses (`policy_loss.loss_mode` vanilla -- dual-clip is its `clip_ratio_c` --,
  dppo_tv, dppo_kl, gpg, dro, cispo) aggregated with `token-mean` (over verl's global
  `batch_num_tokens`), `token-sum`, `seq-mean-token-sum` (over the global `global_batch_size`)
  or `seq-mean-token-sum-norm` with a fixed `loss_scale_factor`: a sum of per-token terms with
  global weights, which the reuse micro-batches partition exactly; the entropy bonus and the KL
  loss (every `kl_loss_type` but "full", which verl itself does not implement) are aggregated
  the same way;
- per-sequence normalisers (`seq-mean-token-mean`, GSPO's and SAPO's sequence ratio) divide by
  a sequence's token count INSIDE the micro-batch: exact only if all of a sequence's loss
  tokens are in one micro-batch, so these run with `AdapterConfig(sequence_level_loss=True)`;
- `rollout.temperature`: verl divides the logits by the batch's `temperature`; the adapter does
  the same (one value per batch; per-sample temperatures refused).

Refused (each with its reason): clip_cov / kl_cov (they pick tokens by a top-k over the
micro-batch), geo_mean (a mean over the micro-batch's sequences), bypass_mode and any other
registered mode (not checked), `seq-mean-token-sum-norm` without `loss_scale_factor` (its
normaliser is the micro-batch's padded width), sequence modes without a global
`global_batch_size`, losses other than `ppo_loss` (distillation, SFT, value), multimodal
inputs, mrope (3-D) position ids, top-k distillation, `calculate_sum_pi_squared`, router
replay, MTP, and the engine settings listed in `_ENGINE_REFUSED`.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["TOKEN_LOSS_MODES", "SEQUENCE_LOSS_MODES", "reuse_settings", "actor_config_of"]

TOKEN_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gpg", "dro", "cispo")
"""verl 0.9.1 policy losses that are per-token terms aggregated by `agg_loss`."""
SEQUENCE_LOSS_MODES = ("gspo", "sapo")
"""Policy losses with a per-sequence ratio over the sequence's tokens in the micro-batch."""
_REFUSED_LOSS_MODES = {
    "clip_cov": "it clips the tokens of a top-k covariance over each micro-batch",
    "kl_cov": "it penalises the tokens of a top-k covariance over each micro-batch",
    "geo_mean": "its loss is a mean over the micro-batch's sequences (torch.mean)",
}
_SEQUENCE_AGG = ("seq-mean-token-mean",)
_TOKEN_AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _refuse(setting: str, why: str, fix: str) -> ValueError:
    return ValueError(f"prefix reuse with verl: {setting} is refused: {why}; {fix} (or turn "
                      "prefix reuse off)")


def actor_config_of(loss_function):
    """The ActorConfig inside verl's `partial(ppo_loss, config=...)`; ValueError for any other
    loss (None: a log-prob pass)."""
    if loss_function is None:
        return None
    from verl.workers.utils.losses import ppo_loss
    func = loss_function.func if isinstance(loss_function, functools.partial) else loss_function
    if func is not ppo_loss:
        name = getattr(func, "__qualname__", type(func).__name__)
        raise _refuse(f"loss function {name}", "only verl's ppo_loss is checked against verl's "
                      "dense step (distillation_ppo_loss, sft_loss, value_loss are not)",
                      "train with verl's ppo_loss (no distillation)")
    config = loss_function.keywords.get("config") if loss_function.keywords else None
    return config if config is not None else loss_function.args[0]


def _meta(data, key, default=None):
    from verl.utils import tensordict_utils as tu
    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _check_engine(engine) -> None:
    ec = engine.engine_config
    refused = [
        ("calculate_per_token_loss=True", engine.tf_config is not None
         and engine.tf_config.calculate_per_token_loss, "verl's per-token regime is not wired"),
        ("megatron.dynamic_context_parallel=True", ec.dynamic_context_parallel,
         "its scheduler replaces verl's micro-batches and reuse's plan"),
        ("model.use_fused_kernels=True", ec.use_fused_kernels,
         "the fused forward computes log-probs inside the model, not from the logits"),
        ("megatron.context_parallel_size > 1", ec.context_parallel_size > 1,
         "context parallelism is not planned by the verl adapter"),
        ("model.mtp.enable=True", bool(getattr(getattr(engine.model_config, "mtp", None),
                                               "enable", False)), "the MTP loss is not planned"),
        ("router_replay", getattr(engine, "enable_routing_replay", False),
         "recorded routes follow verl's micro-batches"),
    ]
    for setting, on, why in refused:
        if on:
            raise _refuse(setting, why, f"unset {setting.split('=')[0].split(' ')[0]}")


def _check_batch(data) -> None:
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    if _meta(data, "pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING:
        raise _refuse("pad_mode", "verl's engine runs the no-padding layout only", "use it")
    if "multi_modal_inputs" in data.keys() and len(data["multi_modal_inputs"]) > 0:
        raise _refuse("multi_modal_inputs", "vision inputs are not passed to the reuse forward",
                      "train a text-only model")
    if "position_ids" in data.keys() and data["position_ids"].dim() > 2:
        raise _refuse("3-D (mrope) position_ids", "the reuse forward uses 1-D positions",
                      "train a model with 1-D rotary positions")
    for key, why in (("distillation_use_topk", "top-k distillation needs the teacher's logits"),
                     ("distillation_only", "distillation is not planned"),
                     ("calculate_sum_pi_squared", "sum(pi^2) is not computed by the reuse step"),
                     ("enable_routing_replay", "recorded routes follow verl's micro-batches")):
        if _meta(data, key, False):
            raise _refuse(f"{key}=True", why, f"set {key} off")


def _temperature(data) -> float:
    value = data["temperature"] if "temperature" in data.keys() else _meta(data, "temperature", 1.0)
    if torch.is_tensor(value):
        flat = (value.values() if value.is_nested else value).float().reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            raise _refuse("per-sample temperature", "the adapter divides a batch's logits by one "
                          "temperature", "give every sample rollout.temperature")
        value = float(flat[0]) if flat.numel() else 1.0
    value = float(value)
    return value if value > 0 else 1e-8  # verl: "avoid non-positive temperature"


def _check_loss(config, data) -> bool:
    """True when the loss needs a sequence's loss tokens in one micro-batch."""
    mode = config.policy_loss.get("loss_mode", "vanilla")
    agg = config.loss_agg_mode
    if mode in _REFUSED_LOSS_MODES:
        raise _refuse(f"policy_loss.loss_mode={mode}", _REFUSED_LOSS_MODES[mode],
                      "use one of " + ", ".join(TOKEN_LOSS_MODES + SEQUENCE_LOSS_MODES))
    if mode not in TOKEN_LOSS_MODES + SEQUENCE_LOSS_MODES:
        raise _refuse(f"policy_loss.loss_mode={mode}", "not checked against verl's dense step",
                      "use one of " + ", ".join(TOKEN_LOSS_MODES + SEQUENCE_LOSS_MODES))
    if agg not in _TOKEN_AGG + _SEQUENCE_AGG:
        raise _refuse(f"loss_agg_mode={agg}", "not a verl 0.9.1 mode the adapter knows",
                      "use " + ", ".join(_TOKEN_AGG + _SEQUENCE_AGG))
    if agg == "seq-mean-token-sum-norm" and config.loss_scale_factor is None:
        raise _refuse("loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor",
                      "verl then divides by each micro-batch's padded response width, which "
                      "depends on how samples are batched", "set actor.loss_scale_factor")
    sequence = mode in SEQUENCE_LOSS_MODES or agg in _SEQUENCE_AGG
    if (sequence or agg.startswith("seq-")) and _meta(data, "global_batch_size") is None:
        raise _refuse(f"loss_agg_mode={agg} without global_batch_size", "verl then divides by "
                      "the micro-batch's sequence count", "let verl's trainer set it")
    if config.use_kl_loss and config.kl_loss_type == "full":
        raise _refuse("kl_loss_type=full", "verl 0.9.1 does not implement it", "use low_var_kl")
    return sequence


def reuse_settings(engine, data, loss_function) -> dict:
    """AdapterConfig fields for this verl step (module docstring); ValueError to refuse."""
    _check_engine(engine)
    _check_batch(data)
    config = actor_config_of(loss_function)
    sequence = _check_loss(config, data) if config is not None else False
    return {"temperature": _temperature(data), "sequence_level_loss": sequence,
            "compute_entropy": bool(_meta(data, "calculate_entropy", False))}
