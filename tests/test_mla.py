"""Multi-latent attention (DeepSeek-V3 tiny twin, megatron_patches/runtime/mla_hooks.py) in
prefix-reuse steps vs stock Megatron dense (fp32, loss and every gradient within 1e-5
relative; a NaN/inf gradient fails): PP=1 (yarn RoPE + mscale, plain RoPE, prefix chunks),
PP=2, TP=2, and the MoE layout (dense first layer, sigmoid grouped routing with expert bias,
shared expert) at EP=2. The dense reference runs Megatron's own MLA with its local core
attention (megatron_patches/models/mla.py); the reuse step replaces RoPE and core attention
through the mla-reuse-hook, which the tests check ran."""

import pytest
import torch

from dist_harness import run_distributed
from test_equivalence import LOSS, assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

TOL = 1e-5
SHAPES = [(33, [6, 9, 4]), (17, [8, 3]), (12, [1, 5])]


class _Spy:
    """Counts the mla-reuse-hook's answered sites (a test that the hook really ran)."""

    def __init__(self):
        from megatron.core.transformer import multi_latent_attention
        from megatron_patches.runtime import mla_hooks

        self.module, self.sites = multi_latent_attention, {}
        self.inner = mla_hooks.mla_reuse_hook

    def __call__(self, module, site):
        answer = self.inner(module, site)
        if answer is not None:
            self.sites[site] = self.sites.get(site, 0) + 1
        return answer

    def __enter__(self):
        self.module._mla_reuse_hook = self
        return self

    def __exit__(self, *exc):
        self.module._mla_reuse_hook = self.inner


def _model(**kwargs):
    from mla_models import mla_model
    from megatron_patches.training import scale_grads_by_token_count

    model = mla_model(**kwargs)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


@pytest.fixture(scope="module")
def yarn_model(megatron_env):
    return _model()


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole prefix", "prefix chunks of 7"])
def test_mla_yarn_reuse_equals_dense(yarn_model, chunk):
    batch = make_batch(5, SHAPES)
    kwargs = {} if chunk is None else {"prefix_chunk_tokens": chunk}
    with _Spy() as spy:
        dense, dg, reuse, rg, plan = run_both(yarn_model, batch, 16, **kwargs)
    assert len(plan.prefixes) == 3 and spy.sites["rope"] > 0 and spy.sites["core"] > 0
    if chunk:
        assert len(plan.prefix_units()) > 3
    assert_equal_step(dense, dg, reuse, rg)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)],
    ids=["selective core_attn", "full uniform"])
def test_mla_recompute_reuse_equals_dense(megatron_env, recompute):
    """Megatron's recompute re-runs MLA's core attention (selective) or whole layers (full,
    [Note: prefix full recompute]) through the same mla-reuse-hook."""
    model = _model(**recompute)
    assert_equal_step(*run_both(model, make_batch(7, SHAPES), 16)[:4])


def test_mla_plain_rope_reuse_equals_dense(megatron_env):
    model = _model(rope_type="rope")
    assert type(model.decoder.layers[0].self_attention.rotary_pos_emb).__name__ == "RotaryEmbedding"
    assert_equal_step(*run_both(model, make_batch(6, SHAPES), 12)[:4])


def test_without_the_rope_hook_suffixes_sit_at_the_wrong_positions(yarn_model, monkeypatch):
    """The equality above needs the suffix's RoPE positions: the test can fail."""
    from megatron.core.transformer import multi_latent_attention
    from megatron_patches.runtime import mla_hooks
    from megatron_patches.training import max_relative_diff

    monkeypatch.setattr(multi_latent_attention, "_mla_reuse_hook", lambda m, site: (
        None if site == "rope" else mla_hooks.mla_reuse_hook(m, site)))
    _, dg, _, rg, _ = run_both(yarn_model, make_batch(5, SHAPES), 16)
    assert max_relative_diff(dg, rg) > 1e-2


def test_mla_softmax_scale_carries_yarn_mscale(yarn_model):
    import math

    attention = yarn_model.decoder.layers[0].self_attention
    m = 0.1 * 1.0 * math.log(40.0) + 1.0  # DeepSeek-V3: factor 40, mscale_all_dim 1
    assert attention.core_attention.softmax_scale == pytest.approx(m * m / math.sqrt(16 + 8))


def mla_rank(tp: int = 1, pp: int = 1, ep: int = 1, moe: bool = False) -> dict:
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, prepare_for_training, reuse_step,
                                           zero_grads)
    from mla_models import mla_model
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=tp, pp=pp, ep=ep)
    num_layers = 4 if pp > 1 else 3
    models = [prepare_for_training(mla_model(moe=moe, num_layers=num_layers), ddp=True)
              for _ in range(2)]
    data_rank = parallel_state.get_data_parallel_rank()
    # equal dense rows per microbatch (stock Megatron's expert-bias count fails with a padding
    # mask, tests/test_moe.py); groups still span and share microbatches
    shapes = [(20, [6, 6, 6]), (20, [6, 6, 6])] if moe else SHAPES
    batch = make_batch(9 + 100 * data_rank, shapes)
    plan = plan_microbatches(batch, token_budget=12 if moe else 16, max_seq_len=512)
    for model in models:
        zero_grads(model)
    with _Spy() as spy:
        dense = dense_step(models[0], batch, LOSS, packing=plan if moe else None)
        dense_grads = param_grads(models[0])
        reuse = reuse_step(models[1], batch, plan, LOSS)
        reuse_grads = param_grads(models[1])
    last = parallel_state.is_pipeline_last_stage()
    return dict(loss=abs(dense.loss - reuse.loss) / abs(dense.loss) if last else 0.0,
                tokens=(dense.num_tokens, reuse.num_tokens) if last else (1, 1),
                grads=max_relative_diff(dense_grads, reuse_grads), sites=spy.sites,
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
                experts=sum("local_experts" in n for n, _ in models[0].named_parameters()))


def _check(results, moe=False):
    for rank, out in enumerate(results):
        assert not out["missing"], (rank, out["missing"][:5])
        assert out["tokens"][0] == out["tokens"][1] > 0
        assert out["loss"] <= TOL and out["grads"] <= TOL, (rank, out)
        assert out["sites"].get("core", 0) > 0 and out["sites"].get("rope", 0) > 0, (rank, out)
        assert not moe or out["experts"] > 0


def test_mla_pipeline_parallel_2(megatron_env):
    _check(run_distributed(mla_rank, world_size=2, kwargs=dict(pp=2), timeout_s=300))


def test_mla_tensor_parallel_2(megatron_env):
    _check(run_distributed(mla_rank, world_size=2, kwargs=dict(tp=2), timeout_s=300))


def test_mla_deepseek_v3_tiny_moe_expert_parallel_2(megatron_env):
    _check(run_distributed(mla_rank, world_size=2, kwargs=dict(ep=2, moe=True), timeout_s=300),
           moe=True)


def test_capacity_predictor_and_adapter_refuse_mla_by_name(yarn_model, capsys):
    """Never costed as GQA: the capacity tool, the predictor and the framework adapter's FLOP
    model each refuse an MLA model, naming it."""
    from megatron_patches.frameworks.adapter import dims_of_model
    from tools_import import tool

    with pytest.raises(ValueError, match="multi-latent attention"):
        dims_of_model(yarn_model)
    for name, args in (("capacity", ["--model", "deepseek-v3"]),
                       ("predict", ["--model", "deepseek-v3-tiny", "--gpus", "8", "--gpu", "h20",
                                    "--prefix-len", "1024"])):
        with pytest.raises(SystemExit) as info:
            tool(name).main(args)
        assert info.value.code == 2
        assert "multi-latent attention is not modelled" in capsys.readouterr().err, name
