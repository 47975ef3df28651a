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
- returned: verl's output dict (`model_output.log_probs` per sample as verl lays them out, `loss`,
  `metrics`).
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
        rows["loss_mask"].append(full("response_mask"))
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


def verl_forward_backward(engine, data, loss_function, *, forward_only: bool = False,
                          config: Optional[AdapterConfig] = None) -> dict:
    """`MegatronEngine.forward_backward_batch` with prefix reuse (module docstring)."""
    check_verl_version()
    from verl.utils import tensordict_utils as tu
    if engine.tf_config is not None and engine.tf_config.calculate_per_token_loss:
        raise ValueError("verl's per-token loss regime (calculate_per_token_loss=True) is not "
                         "wired to the adapter yet; run verl's engine with it off")
    for what, on in (("dynamic_context_parallel", engine.engine_config.dynamic_context_parallel),
                     ("use_fused_kernels", engine.engine_config.use_fused_kernels),
                     ("context_parallel_size > 1", engine.engine_config.context_parallel_size > 1)):
        if on:
            raise ValueError(f"verl with {what} is not supported with prefix reuse; turn it off")
    batch_num_tokens = data["response_mask"].sum().to(torch.float32)
    group = engine.get_data_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(batch_num_tokens, group=group)
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(),
                         dp_size=engine.get_data_parallel_size())
    rollout = rollout_from_verl(data)
    adapter = PrefixReuseAdapter(engine.module, config)
    loss_fn = None if loss_function is None else verl_loss_fn(engine, data, loss_function)
    result = adapter.forward_backward(rollout, loss_fn, forward_only=forward_only)
    if result.logprobs is None:
        return {}
    shifted = [torch.cat([lp[1:], lp.new_zeros(1)]) for lp in result.logprobs]  # j -> j+1
    out = {"log_probs": torch.nested.as_nested_tensor(shifted, layout=torch.jagged)}
    losses = [r["loss"] for r in result.losses_reduced if "loss" in r]
    metrics = [r.get("metrics", {}) for r in result.losses_reduced]
    return {"model_output": out, "loss": losses, "metrics": metrics, "report": result.report}


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

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            return verl_forward_backward(self, data, loss_function, forward_only=forward_only,
                                         config=self.prefix_reuse_config)
    return PrefixReuseMegatronEngine
