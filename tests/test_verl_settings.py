"""Every verl 0.9.1 loss setting through the prefix-reuse engine == verl's OWN dense engine step,
or refused before compute (make test-frameworks).

Reference: stock `MegatronEngineWithLMHead.forward_backward_batch` (verl's micro-batching, BSHD
preprocessing, logits processor with temperature and entropy, `ppo_loss`), driven through verl's
own `BaseEngine.train_batch` / `infer_batch`, its `TrainingWorker._postprocess_output` (what the
worker returns to the trainer) and the trainer's `no_padding_2_padding` (what it stores as
old/ref log-probs and entropy). Compared per setting: every gradient (fp32, 1e-5, NaN/inf fail),
the summed loss, every SUM-aggregated metric (pg_loss, entropy_loss, kl_loss), grad_norm, and
the per-token log-probs / entropy at every response position.

Stubs (named): those of tools/benchlib/verl_harness.py (TE padding mask, CPU platform, engine
construction without checkpoint / CUDA mesh), and here the optimizer (the engines are built
without verl's optimizer: `optimizer_zero_grad` does nothing, `optimizer_step` returns the
gradient norm without stepping, so the gradients stay to compare) and the worker around
`_postprocess_output` (DP group None at DP=1, no FLOP counter).
"""
import os
import sys
import types
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
GROUPS = ((36, 4), (30, 4), (44, 4))  # 12 samples, prompts shared inside each group


def _trees():
    from megatron_patches.frameworks import AdapterConfig
    return AdapterConfig(min_shared_len=4, node_overhead_tokens=0, min_gain=1.0)


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


def _grad_norm(model):
    return torch.sqrt(sum((p.main_grad if hasattr(p, "main_grad") else p.grad).float().pow(2).sum()
                          for p in model.parameters()))


def _engine(cls, model, **engine_kw):
    engine = harness.verl_engine(cls, model, vocab_size=SMALL["vocab_size"])
    for key, value in engine_kw.items():
        object.__setattr__(engine.engine_config, key, value)
    engine.prefix_reuse_config = _trees()  # share spans >= 4 tokens, every group reused
    engine.optimizer_zero_grad = lambda: None  # stub: no verl optimizer (module docstring)
    engine.optimizer_step = lambda: _grad_norm(model)
    return engine


def _loss(**actor):
    from functools import partial
    from verl.workers.config import McoreActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss
    policy = PolicyLossConfig(**actor.pop("policy_loss", {}))
    config = McoreActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=2,
                              ppo_mini_batch_size=4, rollout_n=1, policy_loss=policy, **actor)
    return partial(ppo_loss, config=config)


def _batch(seed, *, temperature=1.0, **meta):
    """verl's actor batch whose groups share their prompt AND their first 8 response tokens:
    the reuse plan caches loss tokens in prefix-tree nodes, so a sequence's loss tokens span
    micro-batches unless the setting needs them in one (per-sequence normalisers)."""
    from verl.utils import tensordict_utils as tu
    data = harness.verl_batch(GROUPS, seed=seed, vocab_size=SMALL["vocab_size"],
                              response_lens=(10, 16), shared_response=8)
    data["temperature"] = torch.full((len(data),), float(temperature))
    tu.assign_non_tensor(data, **meta)
    return data


def _worker_view(output):
    """What verl's TrainingWorker hands the trainer (its own _postprocess_output)."""
    from verl.workers.engine_workers import TrainingWorker
    worker = types.SimpleNamespace(engine=types.SimpleNamespace(get_data_parallel_group=lambda: None),
                                   device_name="cpu", flops_counter=None)
    return TrainingWorker._postprocess_output(worker, dict(output), global_token_num=None,
                                              delta_time=1.0, forward_only=False,
                                              images_seqlens=None)


def _summed_metrics(metrics):
    from verl.utils.metric import AggregationType, Metric
    out = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if all(isinstance(v, Metric) and v.aggregation == AggregationType.SUM for v in values):
            out[key] = sum(float(v.aggregate()) for v in values)
        elif key in ("loss", "grad_norm", "kl_coef"):
            out[key] = float(value[0] if isinstance(value, list) else value)
    return out


def _run(cls, model, data, loss_function, *, train, **engine_kw):
    from verl.workers.engine.base import BaseEngine
    engine = _engine(cls, model, **engine_kw)
    if train:
        return BaseEngine.train_batch(engine, data, loss_function), engine
    return BaseEngine.infer_batch(engine, data), engine


def _both(data, loss_function, *, train=True, reuse_engine_kw=None, **engine_kw):
    import megatron_patches
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from megatron_patches.frameworks.verl import register_engine
    from megatron_patches.training import zero_grads
    model = _model()
    with megatron_patches.use_prefix_reuse_schedule(False):
        dense, _ = _run(MegatronEngineWithLMHead, model, data.clone(), loss_function,
                        train=train, **engine_kw)
    dense_grads = grads_of(model) if train else None
    zero_grads(model)
    reuse, engine = _run(register_engine(), model, data.clone(), loss_function, train=train,
                         **{**engine_kw, **(reuse_engine_kw or {})})
    ideal = float(engine.prefix_reuse_report.split("(FLOP-ideal): ")[1].rstrip("x"))
    assert ideal > 1.5, engine.prefix_reuse_report  # the groups were shared, not run dense
    return model, dense, dense_grads, reuse


def _padded(data, output, key):
    """The trainer's step 4 (ray_trainer._compute_old_log_prob): verl's no_padding_2_padding."""
    from verl.workers.utils.padding import no_padding_2_padding
    return no_padding_2_padding(output["model_output"][key], data)


def _assert_close(reuse, dense, what):
    assert torch.isfinite(dense).all() and torch.isfinite(reuse).all(), what
    torch.testing.assert_close(reuse, dense, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


CASES = {
    "vanilla-token-mean": dict(),
    "dual-clip": dict(clip_ratio_c=1.2),
    "kl-low_var_kl": dict(use_kl_loss=True, kl_loss_type="low_var_kl"),
    "kl-k1": dict(use_kl_loss=True, kl_loss_type="k1"),
    "kl-mse": dict(use_kl_loss=True, kl_loss_type="mse"),
    "kl-abs": dict(use_kl_loss=True, kl_loss_type="abs"),
    "kl-k3+": dict(use_kl_loss=True, kl_loss_type="k3+"),
    "token-sum": dict(loss_agg_mode="token-sum"),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16),
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True),
    "gspo": dict(policy_loss=dict(loss_mode="gspo"), loss_agg_mode="seq-mean-token-mean"),
    "sapo": dict(policy_loss=dict(loss_mode="sapo")),
    "gpg": dict(policy_loss=dict(loss_mode="gpg")),
    "dro": dict(policy_loss=dict(loss_mode="dro", dro_beta=0.5)),
    "cispo": dict(policy_loss=dict(loss_mode="cispo")),
    "dppo_tv": dict(policy_loss=dict(loss_mode="dppo_tv")),
    "dppo_kl": dict(policy_loss=dict(loss_mode="dppo_kl")),
}
BATCHES = {  # batch-side settings: (batch kwargs, engine settings)
    "temperature-0.7+entropy": (dict(temperature=0.7, calculate_entropy=True), {}),
    "entropy_coeff": (dict(calculate_entropy=True), {}),
    "fixed-micro-batches": (dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=3), {}),
    # verl's THD path (use_remove_padding=True) packs for TE's attention, which needs CUDA: the
    # dense reference runs verl's BSHD path (the same computation, causal per sequence); the
    # reuse engine runs configured as verl's Megatron default, use_remove_padding=True.
    "use_remove_padding=True": (dict(), dict(reuse_engine_kw=dict(use_remove_padding=True))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_verl_loss_setting_reuse_equals_verl_dense(megatron_env, name):
    loss_function = _loss(**CASES[name])
    model, dense, dense_grads, reuse = _both(_batch(5), loss_function)
    assert_grads_equal(dense_grads, grads_of(model))
    d, r = _summed_metrics(_worker_view(dense)["metrics"]), _summed_metrics(_worker_view(reuse)["metrics"])
    assert set(d) == set(r) and {"loss", "grad_norm"} <= set(d), (d, r)
    for key in d:
        assert r[key] == pytest.approx(d[key], rel=1e-5, abs=1e-7), (key, d[key], r[key])


@pytest.mark.parametrize("name", list(BATCHES))
def test_verl_batch_setting_reuse_equals_verl_dense(megatron_env, name):
    meta, engine_kw = BATCHES[name]
    coeff = 0.01 if "entropy" in name else 0.0
    loss_function = _loss(entropy_coeff=coeff, use_kl_loss=True)
    data = _batch(6, **meta)
    model, dense, dense_grads, reuse = _both(data, loss_function, **engine_kw)
    assert_grads_equal(dense_grads, grads_of(model))
    d, r = _summed_metrics(_worker_view(dense)["metrics"]), _summed_metrics(_worker_view(reuse)["metrics"])
    assert set(d) == set(r), (d, r)
    if meta.get("calculate_entropy"):
        assert "actor/entropy_loss" in d
    for key in d:
        assert r[key] == pytest.approx(d[key], rel=1e-5, abs=1e-7), (key, d[key], r[key])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_verl_log_prob_pass_contract(megatron_env, temperature):
    """The old-log-prob pass as ray_trainer asks for it (calculate_entropy=True, no loss):
    verl's worker post-processing and the trainer's no_padding_2_padding on both outputs; every
    response position (masked-out ones too) equal; metrics a dict of lists."""
    data = _batch(7, temperature=temperature, calculate_entropy=True, compute_loss=False)
    model, dense, _, reuse = _both(data, None, train=False)
    for key in ("log_probs", "entropy"):
        _assert_close(_padded(data, reuse, key), _padded(data, dense, key), key)
    assert isinstance(reuse["metrics"], dict) and isinstance(reuse["loss"], list)
    view = _worker_view(reuse)
    assert set(view.keys()) >= {"log_probs", "entropy"}
    assert all(p.grad is None for p in model.parameters())


REFUSED = {
    "policy_loss.loss_mode=clip_cov": (dict(policy_loss=dict(loss_mode="clip_cov")), {}),
    "policy_loss.loss_mode=kl_cov": (dict(policy_loss=dict(loss_mode="kl_cov")), {}),
    "policy_loss.loss_mode=geo_mean": (dict(policy_loss=dict(loss_mode="geo_mean")), {}),
    "policy_loss.loss_mode=bypass_mode": (dict(policy_loss=dict(loss_mode="bypass_mode")), {}),
    "without loss_scale_factor": (dict(loss_agg_mode="seq-mean-token-sum-norm"), {}),
    "without global_batch_size": (dict(loss_agg_mode="seq-mean-token-mean"),
                                  dict(global_batch_size=None)),
    "per-sample temperature": ({}, dict(temperature="mixed")),
    "calculate_sum_pi_squared=True": ({}, dict(calculate_sum_pi_squared=True)),
    "distillation_use_topk=True": ({}, dict(distillation_use_topk=True)),
    "mrope": ({}, dict(position_ids="3d")),
    "model.use_fused_kernels=True": ({}, dict(engine=dict(use_fused_kernels=True))),
    "megatron.context_parallel_size > 1": ({}, dict(engine=dict(context_parallel_size=2))),
    "megatron.dynamic_context_parallel=True": ({}, dict(engine=dict(dynamic_context_parallel=True))),
    "loss function distillation_ppo_loss": ({}, dict(loss="distillation")),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_verl_setting_refused_before_compute(megatron_env, name):
    from verl.utils import tensordict_utils as tu
    from megatron_patches.frameworks.verl import register_engine
    actor, meta = REFUSED[name]
    data = _batch(8)
    if meta.get("temperature") == "mixed":
        data["temperature"] = torch.linspace(0.5, 1.0, len(data))
    elif meta.get("position_ids") == "3d":
        pos = data["position_ids"]
        data["position_ids"] = torch.nested.as_nested_tensor(
            [torch.stack([p] * 3) for p in pos.unbind()], layout=torch.jagged)
    elif meta and "engine" not in meta and "loss" not in meta:
        tu.assign_non_tensor(data, **meta)
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    loss = _loss(**actor)
    if meta.get("loss") == "distillation":
        from functools import partial
        from verl.trainer.distillation import distillation_ppo_loss
        loss = partial(distillation_ppo_loss, config=loss.keywords["config"])
    engine = _engine(register_engine(), model, **meta.get("engine", {}))
    with pytest.raises(ValueError, match=name.replace(">", ">").replace("(", r"\(")):
        engine.forward_backward_batch(data, loss)
    assert not calls and all(p.grad is None for p in model.parameters())
