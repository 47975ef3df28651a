"""verl 0.9.1: its Megatron engine's step through the adapter, under verl's own loss code.

`PrefixReuseMegatronEngine` is verl's `MegatronEngineWithLMHead` with `forward_backward_batch`
running the prefix-reuse step; it is registered in verl's EngineRegistry as backend
"megatron_prefix_reuse" (the switch: that backend name where verl picks its engine, or the class
itself). What changes against `MegatronEngine.forward_backward_batch`:
- micro-batches: the adapter's plan, never verl's length-balancing `prepare_micro_batches`
  (which splits a group, `uid`, over micro-batches); groups stay whole;
- verl's loss function (e.g. `verl.workers.utils.losses.ppo_loss`) and its
  `postprocess_micro_batch_func` (the `x num_micro_batch` factor) run unchanged, on a per-micro-
  batch TensorDict of the samples it touches, with `num_micro_batch` = the reuse step's count and
  `response_mask` restricted to the positions the micro-batch computes (token sums partition
  exactly; verl's global `batch_num_tokens` / `dp_size` normalisers stay);
- log-probs (and entropy, when the batch asks `calculate_entropy`) at EVERY response position,
  the logits divided by the batch's `temperature` as verl's logits processor does;
- returned: verl's output dict assembled by verl's own `postprocess_batch_func`
  (`model_output.log_probs` / `entropy` nested per sample in verl's layout, `loss` a list,
  `metrics` a dict of lists), so `BaseEngine.train_batch` and the worker post-process it as
  they do the stock engine's.
Every setting is checked first (verl_settings.py: exact, or a ValueError naming it).
Refused with the supported range: another verl version. verl is imported lazily: this module
imports without it (the test environment is `make test-frameworks`).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.rollout import RolloutBatch, TokenBatch

__all__ = ["SUPPORTED_VERL", "check_verl_version", "rollout_from_verl", "verl_loss_fn",
           "verl_forward_backward", "register_engine"]

SUPPORTED_VERL = ("0.9.1",)
"""verl releases this module was tested with (make test-frameworks)."""


def check_verl_version(version: Optional[str] = None) -> None:
    """ValueError unless verl (or `version`) is a supported release."""
    if version is None:
        import verl
        version = verl.__version__
    if version not in SUPPORTED_VERL:
        raise ValueError(f"verl {version} is not supported by megatron_patches.frameworks.verl: "
                         f"it is tested with verl=={SUPPORTED_VERL[0]} (supported: "
                         f"{', '.join(SUPPORTED_VERL)}); install that release or run verl's own "
                         "engine without prefix reuse")


_LOSS_FIELDS = ("prompts", "responses", "attention_mask", "response_mask", "old_log_probs",
                "advantages", "ref_log_prob", "rollout_is_weights")
_NON_TENSOR = ("dp_size", "batch_num_tokens", "global_batch_size", "max_response_len")


def _uids(data):
    if "uid" not in data.keys():
        return None
    value = data["uid"]
    return list(value.tolist() if hasattr(value, "tolist") else value)


def _lengths(data):
    prompt_width = data["prompts"].shape[1]
    attention = data["attention_mask"].bool()
    return attention[:, :prompt_width].sum(1), attention[:, prompt_width:].sum(1), prompt_width


def rollout_from_verl(data) -> RolloutBatch:
    """verl's padded RL batch (`prompts` left-padded, `responses`, `attention_mask`,
    `response_mask` / `old_log_probs` / `advantages` / `ref_log_prob` per response token, `uid`
    per sample) -> RolloutBatch (token-aligned: response token r is token prompt_len + r)."""
    for key in ("prompts", "responses", "attention_mask", "response_mask"):
        if key not in data.keys():
            raise ValueError(f"verl batch has no {key!r}; give the actor's padded RL batch")
    uid = _uids(data)
    if uid is None:
        raise ValueError("verl batch has no 'uid' (the group id of each sample); the adapter "
                         "looks for shared prefixes inside groups")
    p_lens, r_lens, width = _lengths(data)
    rows = {"tokens": [], "loss_mask": [], "advantages": [], "old_logprobs": [], "ref_logprobs": []}
    has = {"old_logprobs": "old_log_probs" in data.keys(), "ref_logprobs": "ref_log_prob" in data.keys()}
    for b in range(len(p_lens)):
        p, r = int(p_lens[b]), int(r_lens[b])
        prompt = data["prompts"][b, width - p:]
        rows["tokens"].append(torch.cat([prompt, data["responses"][b, :r]]).cpu())

        def full(name):
            return torch.cat([torch.zeros(p), data[name][b, :r].float().detach().cpu()])
        rows["loss_mask"].append(torch.cat([torch.zeros(p), torch.ones(r)]))  # every response token
        rows["advantages"].append(full("advantages") if "advantages" in data.keys() else 0.0)
        for ours, theirs in (("old_logprobs", "old_log_probs"), ("ref_logprobs", "ref_log_prob")):
            rows[ours].append(full(theirs) if has[ours] else None)
    return RolloutBatch(tokens=rows["tokens"], loss_mask=rows["loss_mask"], group_ids=list(uid),
                        advantages=rows["advantages"],
                        old_logprobs=rows["old_logprobs"] if has["old_logprobs"] else None,
                        ref_logprobs=rows["ref_logprobs"] if has["ref_logprobs"] else None)


def _micro_batch(data, b: TokenBatch, lengths):
    """The samples `b` touches, as verl's micro-batch TensorDict, response_mask restricted to
    the response positions `b` computes; and verl's model_output (nested per-sample log-probs,
    entry j = log p(token j+1), with gradient at the positions `b` computes)."""
    p_lens, r_lens, _ = lengths
    samples = torch.unique(b.sequence_index).cpu()
    local = {int(s): i for i, s in enumerate(samples.tolist())}
    from verl.utils import tensordict_utils as tu
    micro = data.select(*[k for k in _LOSS_FIELDS if k in data.keys()])[samples]
    micro["input_ids"] = torch.cat([micro["prompts"], micro["responses"]], dim=1)  # its device
    for key in _NON_TENSOR:
        tu.assign_non_tensor(micro, **{key: tu.get_non_tensor_data(data=data, key=key, default=None)})
    seq_lens = (p_lens + r_lens)[samples]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), seq_lens.cumsum(0)])
    rows = torch.tensor([local[int(s)] for s in b.sequence_index.tolist()], dtype=torch.int64)
    flat = (offsets[rows] + b.position.cpu() - 1).to(b.logprobs.device)
    values = torch.zeros(int(offsets[-1]), device=b.logprobs.device).index_put((flat,), b.logprobs)
    output = {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets.to(values.device))}
    if b.entropy is not None:
        ent = torch.zeros_like(values).index_put((flat,), b.entropy)
        output["entropy"] = torch.nested.nested_tensor_from_jagged(ent, offsets.to(values.device))
    response = b.position.cpu() - p_lens[b.sequence_index.cpu()]
    present = torch.zeros_like(micro["response_mask"], dtype=torch.float32)
    inside = response >= 0
    present[rows[inside], response[inside]] = 1.0
    micro["response_mask"] = micro["response_mask"] * present.to(micro["response_mask"].dtype)
    tu.assign_non_tensor(micro, num_micro_batch=b.num_microbatches)
    return micro, output


def verl_loss_fn(engine, data, loss_function):
    """The adapter's loss_fn that runs verl's `loss_function` through verl's own
    `engine.postprocess_micro_batch_func` (module docstring)."""
    lengths = _lengths(data)

    def loss_fn(b: TokenBatch):
        micro, output = _micro_batch(data, b, lengths)
        return engine.postprocess_micro_batch_func(output=output, data=micro, forward_only=False,
                                                   loss_function=loss_function)
    return loss_fn


def _batch_num_tokens(engine, data) -> float:
    """verl's `forward_backward_batch` normaliser: `loss_mask` tokens summed over DP ranks."""
    loss_mask = data["loss_mask"] if "loss_mask" in data.keys() else data["response_mask"]
    count = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(torch.float32)
    group = engine.get_data_parallel_group()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(count, group=group)
    return count.item()


def _shifted(per_sequence):
    """Ours: entry j is about token j; verl's: entry j is about token j+1 (last entry 0)."""
    return [torch.cat([t[1:], t.new_zeros(1)]) for t in per_sequence]


def _verl_output(data, result, losses_reduced, forward_only, has_loss):
    """verl's output dict, assembled by verl's OWN `postprocess_batch_func` (metrics a dict of
    lists, `loss` a list, `model_output` nested per sample in the batch's order): the reuse
    micro-batches' outputs (their partial model outputs dropped) plus one entry holding the
    per-sample log-probs (and entropy) of the whole batch."""
    from verl.workers.engine.utils import postprocess_batch_func
    model_output = {"log_probs": torch.nested.as_nested_tensor(_shifted(result.logprobs),
                                                               layout=torch.jagged)}
    if result.entropy is not None:
        model_output["entropy"] = torch.nested.as_nested_tensor(_shifted(result.entropy),
                                                                layout=torch.jagged)
    if has_loss:
        micro = [{k: v for k, v in r.items() if k != "model_output"} for r in losses_reduced]
    else:  # verl's postprocess_micro_batch_func without a loss: loss 1.0, no metrics
        micro = [{"loss": 1.0, "metrics": {}} for _ in range(result.num_microbatches)]
    identity = [list(range(len(result.logprobs)))]
    return postprocess_batch_func(output_lst=[{"model_output": model_output}] + micro,
                                  indices=identity, data=data)


def verl_forward_backward(engine, data, loss_function, *, forward_only: bool = False,
                          config: Optional[AdapterConfig] = None) -> dict:
    """`MegatronEngine.forward_backward_batch` with prefix reuse (module docstring); every
    setting checked by verl_settings.reuse_settings before any compute."""
    check_verl_version()
    import dataclasses
    from megatron.core import parallel_state
    from verl.utils import tensordict_utils as tu
    from megatron_patches.frameworks.verl_settings import reuse_settings
    settings = reuse_settings(engine, data, loss_function)
    config = config or AdapterConfig()
    settings["sequence_level_loss"] = settings["sequence_level_loss"] or config.sequence_level_loss
    config = dataclasses.replace(config, **settings)
    tu.assign_non_tensor(data, sp_size=engine.engine_config.context_parallel_size)
    tu.assign_non_tensor(data, batch_num_tokens=_batch_num_tokens(engine, data),
                         dp_size=engine.get_data_parallel_size())
    rollout = rollout_from_verl(data)
    adapter = PrefixReuseAdapter(engine.module, config)
    loss_fn = None if loss_function is None else verl_loss_fn(engine, data, loss_function)
    result = adapter.forward_backward(rollout, loss_fn, forward_only=forward_only)
    tu.assign_non_tensor(data, num_micro_batch=result.num_microbatches)
    engine.prefix_reuse_report = result.report
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    return _verl_output(data, result, result.losses_reduced, forward_only,
                        loss_function is not None)


def register_engine():
    """Register `PrefixReuseMegatronEngine` as verl backend "megatron_prefix_reuse"; returns
    the class (idempotent)."""
    check_verl_version()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    engines = EngineRegistry._engines.get("language_model", {}).get("megatron_prefix_reuse")
    if engines:
        return next(iter(engines.values()))

    @EngineRegistry.register(model_type="language_model", backend="megatron_prefix_reuse",
                             device=["cuda", "cpu"])
    class PrefixReuseMegatronEngine(MegatronEngineWithLMHead):
        """verl's Megatron engine with the prefix-reuse step (megatron_patches.frameworks.verl)."""

        prefix_reuse_config: Optional[AdapterConfig] = None
        prefix_reuse_report: str = ""

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            return verl_forward_backward(self, data, loss_function, forward_only=forward_only,
                                         config=self.prefix_reuse_config)
    return PrefixReuseMegatronEngine
