"""verl 0.9.1's Megatron engine step on CPU, shared by tests/test_verl_adapter.py and
`tools/bench.py --adapter verl`: the engine objects, verl's actor batch, verl's loss.

Both sides run verl's real code: `MegatronEngine.forward_backward_batch` (its micro-batch
preparation, forward step, BSHD preprocessing, log-prob processor, `postprocess_micro_batch_func`
with the `x num_micro_batch` factor) for dense, and `verl.workers.utils.losses.ppo_loss` with
`postprocess_micro_batch_func` inside the prefix-reuse step for reuse
(megatron_patches/frameworks/verl.py).

Stubbed, because it needs CUDA or a checkpoint on disk (named here, nothing else):
- TE attention's padding mask (`stub_te_padding_mask`): verl's BSHD path passes a [b, s] padding
  mask that only Transformer Engine's attention reads; the local attention gets the causal mask
  alone (verl pads on the right, so no real token attends to padding: the same computation);
- verl's accelerator platform (`cpu_platform`): verl ships CUDA/NPU/ROCm platforms only; a CPU
  one (device "cpu", gloo) is set through verl's own `set_platform` hook, the CUDA platform's
  other methods kept;
- verl's engine construction (`verl_engine`; `MegatronEngine.__init__`/`initialize`: HF
  checkpoint, mbridge, CUDA device mesh): the engine object gets its config (a real
  `McoreEngineConfig`), the model and a stand-in for `HFModelConfig` (mtp off, a LlamaConfig,
  pad id 0) directly.
verl is imported inside the functions: this module imports without it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import types
from functools import partial
from typing import Sequence, Tuple

import torch

__all__ = ["VERL_MISSING", "verl_available", "cpu_platform", "stub_te_padding_mask",
           "verl_engine", "verl_batch", "ppo_loss_function"]

VERL_MISSING = ("verl is not importable in this Python: verl 0.9.1 lives in the frameworks "
                "environment; build it with `make test-frameworks` and run "
                "`.venv-frameworks/bin/python tools/bench.py --adapter verl ...`")


def verl_available() -> bool:
    return importlib.util.find_spec("verl") is not None


@contextlib.contextmanager
def cpu_platform():
    """verl's platform set to a CPU one for the block (module docstring)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        def current_device(self):
            return "cpu"

        def communication_backend_name(self) -> str:
            return "gloo"
    previous = platform_manager._current_platform
    platform_manager.set_platform(PlatformCPU())
    try:
        yield
    finally:
        platform_manager._current_platform = previous


def stub_te_padding_mask(model):
    """Drop the [b, s] padding mask verl's BSHD path hands the model (module docstring); returns
    the hook's handle."""
    def te_padding_mask_stub(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            kwargs["attention_mask"] = None
        return args, kwargs
    return model.register_forward_pre_hook(te_padding_mask_stub, with_kwargs=True)


def verl_engine(cls, model, *, vocab_size: int):
    """An engine of class `cls` (verl's MegatronEngineWithLMHead, or the registered
    prefix-reuse one) around `model`, without a checkpoint or a CUDA mesh (module docstring)."""
    from transformers import LlamaConfig
    from verl.workers.config import McoreEngineConfig
    engine = cls.__new__(cls)
    engine.engine_config = McoreEngineConfig(use_remove_padding=False)
    engine.model_config = types.SimpleNamespace(
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
        hf_config=LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=vocab_size),
        tokenizer=types.SimpleNamespace(pad_token_id=0))
    engine.tf_config, engine.module = model.config, [model]
    engine.enable_routing_replay, engine.mini_layer_topk_idx_list = False, []
    return engine


def verl_batch(groups: Sequence[Tuple[int, int]], *, seed: int, vocab_size: int = 256,
               response_lens: Tuple[int, int] = (5, 11), max_token_len_per_gpu: int = 120,
               mask_drop: float = 0.1, shared_response: int = 0, padded: bool = False):
    """verl's actor batch as the trainer hands it, `groups` = (prompt length, samples) per
    prompt: left-padded prompts, right-padded responses of a length drawn from
    [response_lens[0], response_lens[1]), per response token masks (a fraction `mask_drop`
    masked out) / log-probs / advantages, `uid` per sample (`shared_response` > 0: a group's
    responses start with the same that many tokens, so a group's shared prefix holds response
    tokens, the loss tokens a prefix tree caches); in verl's no-padding form with
    verl's default dynamic batch size (micro-batches balanced to `max_token_len_per_gpu`)."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g, (p, n) in enumerate(groups):
        prompt = torch.randint(1, vocab_size, (p,), generator=gen)
        adv = torch.randn(n, generator=gen)
        head = torch.randint(1, vocab_size, (shared_response,), generator=gen)
        for k in range(n):
            r = int(torch.randint(*response_lens, (1,), generator=gen))
            response = torch.randint(1, vocab_size, (r,), generator=gen)
            response[:min(r, shared_response)] = head[:r]
            samples.append((prompt, response, float(adv[k]), f"uid{g}"))
    B, P = len(samples), max(s[0].numel() for s in samples)
    R = max(s[1].numel() for s in samples)
    prompts, responses = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, R, dtype=torch.int64)
    attn = torch.zeros(B, P + R, dtype=torch.int64)
    resp_mask, adv = torch.zeros(B, R), torch.zeros(B, R)
    for b, (prompt, resp, a, _) in enumerate(samples):
        prompts[b, P - prompt.numel():], responses[b, :resp.numel()] = prompt, resp
        attn[b, P - prompt.numel():P + resp.numel()] = 1
        resp_mask[b, :resp.numel()] = (torch.rand(resp.numel(), generator=gen) > mask_drop).float()
        adv[b] = a * resp_mask[b]
    data = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn, "response_mask": resp_mask,
        "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
        "old_log_probs": -torch.rand(B, R, generator=gen) * 3 - 0.5, "advantages": adv,
        "ref_log_prob": -torch.rand(B, R, generator=gen) * 3 - 0.5,
        "temperature": torch.ones(B)}, batch_size=[B])
    data["uid"] = NonTensorStack(*[s[3] for s in samples])
    if padded:  # as the rollout hands it to the trainer (before left_right_2_no_padding)
        return data
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, use_dynamic_bsz=True, global_batch_size=B,
                         max_token_len_per_gpu=max_token_len_per_gpu)
    return data


def ppo_loss_function():
    """verl's own `ppo_loss` with a KL loss term, as its actor config builds it."""
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    config = McoreActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=2,
                              ppo_mini_batch_size=4, rollout_n=1, use_kl_loss=True)
    return partial(ppo_loss, config)
