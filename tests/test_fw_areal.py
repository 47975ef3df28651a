"""AReaL 1.0.4 with `prefix_reuse` == AReaL's OWN dense engine step (make test-frameworks).

Both sides are AReaL's `MegatronPPOActor.train_batch` on the same TinyLlama GPTModel
(megatron-core, local layer spec) and the same batch: dense with the config key off (AReaL's
`_prepare_mb_list`, `forward_backward_batch`, `_compute_logprobs_and_loss`, `len(mb_list)`
factor), reuse with `prefix_reuse.enabled=True` (megatron_patches.frameworks.areal: the same
`_compute_logprobs_and_loss` and `grpo_loss_fn` per reuse micro-batch). Loss settings as
`MegatronPPOActor._ppo_update` binds them. fp32, every gradient within 1e-5 relative, NaN/inf
fail. Stubs (CUDA / checkpoint / Megatron-Bridge only) are named in
tools/benchlib/areal_harness.py: Megatron-Bridge and mbridge import stubs, the engine built
without `initialize` (no checkpoint, no CUDA process groups, no DDP), the optimizer (records
gradients), the [B, S] padding mask of AReaL's BSHD path.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from benchlib import areal_harness as harness  # noqa: E402

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    harness.install_import_stubs()
    import areal.engine.megatron_engine  # noqa: F401  (make test-frameworks: fails, never skips)
elif not harness.areal_available():
    pytest.skip(harness.AREAL_MISSING, allow_module_level=True)
else:
    harness.install_import_stubs()

from framework_data import SMALL, assert_grads_equal  # noqa: E402

pytestmark = pytest.mark.megatron
GROUPS = ((36, 4), (30, 3), (44, 4))  # (prompt tokens, samples) per prompt: 11 samples


def _model():
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = False  # AReaL's regime (2-tuple losses)
    harness.stub_padding_mask(model)
    return model


def _engines(**config):
    from megatron_patches.frameworks.areal import engine_class
    model = _model()
    cls = engine_class()
    dense = harness.areal_engine(model, harness.actor_config(prefix_reuse=False, **config), cls=cls)
    reuse = harness.areal_engine(model, harness.actor_config(prefix_reuse=True, **config), cls=cls)
    return dense, reuse


def _step(engine, batch, loss):
    from areal.utils import stats_tracker
    stats_tracker.export_all(reduce_group=None)  # as AReaL's trainer after each step: a clean tracker
    stats = engine.train_batch({k: v.clone() for k, v in batch.items()}, loss_fn=loss,
                               loss_weight_fn=harness.loss_weight_fn)
    return stats, engine.optimizer.grads[-1]


def _check(batch, loss, **config):
    dense, reuse = _engines(**config)
    d_stats, d_grads = _step(dense, batch, loss)
    r_stats, r_grads = _step(reuse, batch, loss)
    assert " 0 tokens saved" not in reuse.prefix_reuse_report, reuse.prefix_reuse_report
    assert torch.isfinite(torch.tensor(d_stats["grad_norm"])) and d_stats["grad_norm"] > 0, d_stats
    assert_grads_equal(d_grads, r_grads)
    assert abs(d_stats["grad_norm"] - r_stats["grad_norm"]) <= 1e-5 * d_stats["grad_norm"]
    return d_stats, r_stats


def test_areal_version_is_pinned():
    from megatron_patches.frameworks.areal import check_areal_version
    check_areal_version()
    with pytest.raises(ValueError, match="areal==1.0.4"):
        check_areal_version("1.1.0")


def test_config_key_in_areal_dataclass_style():
    from areal.api.cli_args import PPOActorConfig
    from megatron_patches.frameworks.areal import PrefixReuseConfig, with_prefix_reuse
    cls = with_prefix_reuse(PPOActorConfig)
    assert issubclass(cls, PPOActorConfig)
    config = cls(experiment_name="e", trial_name="t")
    assert config.prefix_reuse == PrefixReuseConfig() and not config.prefix_reuse.enabled
    with pytest.raises(ValueError, match="min_shared_len"):
        PrefixReuseConfig(min_shared_len=1)


@pytest.mark.parametrize("mode", ["ppo", "dual_clip_asym", "temperature", "decoupled",
                                  "prox_loglinear", "rejection_token", "sapo", "distill"])
def test_reuse_equals_areal_dense_step(megatron_env, mode):
    """Each per-token loss mode AReaL's actor ships, reuse == AReaL's own dense engine step."""
    from areal.api.cli_args import RejectionSamplingConfig
    extra, config, settings = ("prox_logp",), {}, {}
    if mode == "dual_clip_asym":
        settings = dict(eps_clip_higher=0.28, c_clip=3.0)
    elif mode == "temperature":
        config = dict(temperature=0.7)
    elif mode == "decoupled":
        settings = dict(use_decoupled_loss=True)
    elif mode == "prox_loglinear":  # proximal log-probs approximated from per-token versions
        extra = ("versions",)
        settings = dict(use_decoupled_loss=True, prox_logp_method="loglinear", current_version=3)
    elif mode == "rejection_token":
        settings = dict(rejection_sampling=RejectionSamplingConfig(level="token", action="mask",
                                                                   metric="ratio", upper=1.5))
    elif mode == "sapo":
        settings = dict(use_sapo_loss=True)
    elif mode == "distill":
        extra = ("prox_logp", "teacher_logp")
    batch = harness.areal_batch(GROUPS, seed=3, vocab_size=SMALL["vocab_size"], extra=extra)
    d_stats, r_stats = _check(batch, harness.grpo_loss(**settings), **config)
    assert r_stats["num_micro_batches"] > 0


def test_sequence_level_gspo(megatron_env):
    """GSPO (importance_sampling_level='sequence'): the adapter keeps every loss token of a
    sequence in one micro-batch; == AReaL's dense step."""
    batch = harness.areal_batch(GROUPS, seed=4, vocab_size=SMALL["vocab_size"])
    _check(batch, harness.grpo_loss(importance_sampling_level="sequence"))


def test_refusals_name_the_setting(megatron_env):
    batch = harness.areal_batch(GROUPS, seed=5, vocab_size=SMALL["vocab_size"])
    _, reuse = _engines()
    with pytest.raises(ValueError, match="m2_threshold"):
        _step(reuse, batch, harness.grpo_loss(m2_threshold=0.1))
    reuse.config.enable_tree_training = True
    with pytest.raises(ValueError, match="enable_tree_training"):
        _step(reuse, batch, harness.grpo_loss())
    reuse.config.enable_tree_training = False
    reuse.config.is_critic = True
    with pytest.raises(ValueError, match="is_critic"):
        _step(reuse, batch, harness.grpo_loss())
    assert not reuse.optimizer.grads, "a refused step computed"


def test_install_makes_areal_trainer_build_the_reuse_actor():
    """PPOTrainer._create_train_engine does `from areal.engine import MegatronPPOActor`."""
    import areal.engine
    from megatron_patches.frameworks.areal import engine_class, install
    original = areal.engine.MegatronPPOActor
    try:
        assert install() is engine_class()
        from areal.engine import MegatronPPOActor
        assert MegatronPPOActor is engine_class() and issubclass(MegatronPPOActor, original)
    finally:
        areal.engine.MegatronPPOActor = original
