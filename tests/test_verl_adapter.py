"""verl 0.9.1 through the adapter, against verl's OWN dense engine step (make test-frameworks).

Both sides run verl's real code: `MegatronEngine.forward_backward_batch` (its micro-batch
preparation, forward step, BSHD preprocessing, log-prob processor, `postprocess_micro_batch_func`
with the `x num_micro_batch` factor) for dense, and `verl.workers.utils.losses.ppo_loss` with
`postprocess_micro_batch_func` inside the prefix-reuse step for reuse; same TinyLlama GPTModel
(megatron-core, local layer spec), same batch. fp32, gradients within 1e-5.

The engine objects, verl's batch and loss, and the stubs (named there: TE attention's padding
mask, a CPU platform through verl's `set_platform` hook, the engine's construction without a
checkpoint or CUDA mesh) are tools/benchlib/verl_harness.py's, shared with
`tools/bench.py --adapter verl`.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    import verl  # noqa: F401  (make test-frameworks: a broken install fails, never skips)
else:
    verl = pytest.importorskip("verl", reason="verl is installed by `make test-frameworks`")

from framework_data import SMALL, assert_grads_equal, grads_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from benchlib import verl_harness as harness  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def cpu_platform():
    with harness.cpu_platform():
        yield


def _model():
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = False  # verl's default regime
    harness.stub_te_padding_mask(model)
    return model


def _engine(cls, model):
    return harness.verl_engine(cls, model, vocab_size=SMALL["vocab_size"])


def _verl_batch(seed, groups=((36, 4), (30, 4), (44, 3))):  # 11 samples
    return harness.verl_batch(groups, seed=seed, vocab_size=SMALL["vocab_size"])


def _loss_function():
    return harness.ppo_loss_function()


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
