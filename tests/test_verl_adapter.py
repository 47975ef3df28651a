"""verl 0.9.1 through the adapter, against verl's OWN dense engine step (make test-frameworks).

Both sides run verl's real code: `MegatronEngine.forward_backward_batch` (its micro-batch
preparation, forward step, BSHD preprocessing, log-prob processor, `postprocess_micro_batch_func`
with the `x num_micro_batch` factor) for dense, and `verl.workers.utils.losses.ppo_loss` with
`postprocess_micro_batch_func` inside the prefix-reuse step for reuse; same TinyLlama GPTModel
(megatron-core, local layer spec), same batch. fp32, gradients within 1e-5.

Stubbed, because it needs CUDA or a checkpoint on disk (named here, nothing else):
- TE attention's padding mask: verl's BSHD path passes a [b, s] padding mask that only
  Transformer Engine's attention reads; the local attention gets the causal mask alone (verl pads
  on the right, so no real token attends to padding: the same computation);
- verl's accelerator platform: verl ships CUDA/NPU/ROCm platforms only; a CPU one (device
  "cpu", gloo) is set through verl's own `set_platform` hook, the CUDA platform's other methods
  kept;
- verl's engine construction (`MegatronEngine.__init__`/`initialize`: HF checkpoint, mbridge, CUDA
  device mesh): the engine object gets its config (a real `McoreEngineConfig`), the model and a
  stand-in for `HFModelConfig` (mtp off, a LlamaConfig, pad id 0) directly.
"""
import os
import types
from functools import partial

import pytest
import torch

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    import verl  # noqa: F401  (make test-frameworks: a broken install fails, never skips)
else:
    verl = pytest.importorskip("verl", reason="verl is installed by `make test-frameworks`")

from framework_data import SMALL, assert_grads_equal, grads_of  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def cpu_platform():
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class PlatformCPU(PlatformCUDA):  # see the module docstring
        @property
        def device_name(self) -> str:
            return "cpu"

        def current_device(self):
            return "cpu"

        def communication_backend_name(self) -> str:
            return "gloo"
    previous = platform_manager._current_platform
    platform_manager.set_platform(PlatformCPU())
    yield
    platform_manager._current_platform = previous


def _model():
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = False  # verl's default regime

    def te_padding_mask_stub(module, args, kwargs):  # see the module docstring
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            kwargs["attention_mask"] = None
        return args, kwargs
    model.register_forward_pre_hook(te_padding_mask_stub, with_kwargs=True)
    return model


def _engine(cls, model):
    from transformers import LlamaConfig
    from verl.workers.config import McoreEngineConfig
    engine = cls.__new__(cls)  # see the module docstring: no checkpoint, no CUDA mesh
    engine.engine_config = McoreEngineConfig(use_remove_padding=False)
    engine.model_config = types.SimpleNamespace(
        mtp=types.SimpleNamespace(enable=False, enable_train=False),
        hf_config=LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=256),
        tokenizer=types.SimpleNamespace(pad_token_id=0))
    engine.tf_config, engine.module = model.config, [model]
    engine.enable_routing_replay, engine.mini_layer_topk_idx_list = False, []
    return engine


def _verl_batch(seed, groups=((36, 4), (30, 4), (44, 3))):  # 11 samples
    """verl's actor batch as the trainer hands it (left-padded prompts, right-padded responses,
    per response token masks/log-probs/advantages, `uid` per sample), in verl's no-padding form."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g, (p, n) in enumerate(groups):
        prompt = torch.randint(1, 256, (p,), generator=gen)
        adv = torch.randn(n, generator=gen)
        for k in range(n):
            r = int(torch.randint(5, 11, (1,), generator=gen))
            samples.append((prompt, torch.randint(1, 256, (r,), generator=gen), float(adv[k]), f"uid{g}"))
    B, P = len(samples), max(s[0].numel() for s in samples)
    R = max(s[1].numel() for s in samples)
    prompts, responses = torch.zeros(B, P, dtype=torch.int64), torch.zeros(B, R, dtype=torch.int64)
    attn = torch.zeros(B, P + R, dtype=torch.int64)
    resp_mask, adv = torch.zeros(B, R), torch.zeros(B, R)
    for b, (prompt, resp, a, _) in enumerate(samples):
        prompts[b, P - prompt.numel():], responses[b, :resp.numel()] = prompt, resp
        attn[b, P - prompt.numel():P + resp.numel()] = 1
        resp_mask[b, :resp.numel()] = (torch.rand(resp.numel(), generator=gen) > 0.1).float()
        adv[b] = a * resp_mask[b]
    data = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn, "response_mask": resp_mask,
        "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
        "old_log_probs": -torch.rand(B, R, generator=gen) * 3 - 0.5, "advantages": adv,
        "ref_log_prob": -torch.rand(B, R, generator=gen) * 3 - 0.5,
        "temperature": torch.ones(B)}, batch_size=[B])
    data["uid"] = NonTensorStack(*[s[3] for s in samples])
    data = left_right_2_no_padding(data)
    # verl's default: dynamic batch size, micro-batches balanced by token count
    tu.assign_non_tensor(data, use_dynamic_bsz=True, global_batch_size=B, max_token_len_per_gpu=120)
    return data


def _loss_function():
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    config = McoreActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=2,
                              ppo_mini_batch_size=4, rollout_n=1, use_kl_loss=True)
    return partial(ppo_loss, config)


def test_verl_version_is_pinned():
    from megatron_patches.frameworks.verl import check_verl_version
    check_verl_version()  # the installed one
    with pytest.raises(ValueError, match="verl==0.9.1"):
        check_verl_version("0.10.0")


def test_verl_default_balancing_splits_groups_the_adapter_keeps_them(megatron_env):
    from verl.workers.engine.utils import prepare_micro_batches
    from megatron_patches.frameworks import PrefixReuseAdapter
    from megatron_patches.frameworks.verl import rollout_from_verl
    data = _verl_batch(1)
    micro, _ = prepare_micro_batches(data, dp_group=None)
    where = {}
    for m, mb in enumerate(micro):
        for uid in list(mb["uid"]):
            where.setdefault(uid, set()).add(m)
    assert any(len(mbs) > 1 for mbs in where.values()), "verl's balancing kept every group whole"
    prepared = PrefixReuseAdapter(_model()).prepare(rollout_from_verl(data))
    uids = list(data["uid"])
    for group, sources in zip(prepared.step.batch.groups, prepared.sources):
        assert len({uids[i] for i in sources}) == 1
    assert sorted(len(g.trajectories) for g in prepared.step.batch.groups) == [3, 4, 4]  # one group per uid


def _response_logprobs(data, output):
    """Per sample, the log-probs of its response tokens at response_mask (verl's layout:
    entry j of a sample's log_probs is log p(token j+1))."""
    out = []
    width = data["prompts"].shape[1]
    for b, lp in enumerate(output["model_output"]["log_probs"].unbind()):
        r = int(data["attention_mask"][b, width:].sum())
        p = lp.numel() - r
        keep = data["response_mask"][b, :r] > 0
        out.append(lp[p - 1:p - 1 + r][keep])
    return out


def test_verl_log_prob_pass_reuse_equals_verl_dense(megatron_env):
    """verl's compute_log_prob shape: forward_only, no loss; reuse runs Phase A + B only."""
    import megatron_patches
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from megatron_patches.frameworks.verl import register_engine
    model = _model()
    data = _verl_batch(3)
    with megatron_patches.use_prefix_reuse_schedule(False):
        dense = _engine(MegatronEngineWithLMHead, model).forward_backward_batch(
            data.clone(), None, forward_only=True)
    reuse = _engine(register_engine(), model).forward_backward_batch(data.clone(), None,
                                                                     forward_only=True)
    for d, r in zip(_response_logprobs(data, dense), _response_logprobs(data, reuse)):
        assert torch.isfinite(d).all() and (d != 0).all()
        torch.testing.assert_close(r, d, rtol=1e-5, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_verl_engine_reuse_equals_verl_dense(megatron_env):
    import megatron_patches
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from megatron_patches.frameworks.verl import register_engine
    from megatron_patches.training import zero_grads
    model = _model()
    data = _verl_batch(2)
    with megatron_patches.use_prefix_reuse_schedule(False):
        dense = _engine(MegatronEngineWithLMHead, model).forward_backward_batch(
            data.clone(), _loss_function())
    dense_grads = grads_of(model)
    zero_grads(model)
    reuse = _engine(register_engine(), model).forward_backward_batch(data.clone(), _loss_function())
    assert len(dense["loss"]) != len(reuse["loss"])  # different microbatch counts
    assert abs(sum(dense["loss"]) - sum(reuse["loss"])) <= 1e-5 * abs(sum(dense["loss"]))
    assert_grads_equal(dense_grads, grads_of(model))
    for d, r in zip(_response_logprobs(data, dense), _response_logprobs(data, reuse)):
        torch.testing.assert_close(r, d, rtol=1e-5, atol=1e-5)
