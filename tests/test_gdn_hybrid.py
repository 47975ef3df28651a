"""Gated DeltaNet in HybridModel patterns (`G`) and under pipeline parallelism, vs stock dense.

fp32, loss and every gradient within 1e-5 relative ([Note: recurrent prefix state]). PP=2 runs
put a stage with only GDN layers (GPTModel and HybridModel): it caches states and no K/V.
"""

import zlib

import pytest
import torch

from dist_harness import DistributedRunError, run_distributed
from test_equivalence import LOSS, TOL, assert_equal_step, make_batch
from test_gdn import weak_decay

pytestmark = pytest.mark.megatron

SHAPES = [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])]


def _hybrid(pattern, **kwargs):
    from megatron_patches.models.gdn import GDN_TINY_SHAPE
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_hybrid_model(cfg, pattern, **{**GDN_TINY_SHAPE, **kwargs})
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    weak_decay(model)
    return model


def _gpt(pattern, **kwargs):
    from test_gdn import _gdn_model

    return _gdn_model(num_layers=len(pattern), linear_attention_freq=list(pattern), **kwargs)


def _dense_and_reuse(model, batch, budget, **plan_kwargs):
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import dense_step, param_grads, reuse_step

    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, LOSS)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512, **plan_kwargs)
    reuse = reuse_step(model, batch, plan, LOSS)
    return dense, dense_grads, reuse, param_grads(model)


CASES = {
    "Qwen3.5 layout, 3 GDN : 1 attention": ("G-G-G-*-", {}),
    "GDN last, after attention": ("*-G-", {}),
    "GDN only": ("G-G-", {}),
    "prefix chunks": ("G-*-", {"prefix_chunk_tokens": 12}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_gdn_reuse_equals_dense(megatron_env, name):
    pattern, plan_kwargs = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) % 1000, SHAPES)
    assert_equal_step(*_dense_and_reuse(_hybrid(pattern), batch, 12, **plan_kwargs))


def test_hybrid_gdn_with_moe_layers(megatron_env):
    """`G` with MoE `E` layers, dense reference packed like the reuse plan (per-microbatch
    router statistics)."""
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import dense_step, param_grads, reuse_step

    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # sized by an earlier model's layer count
    model = _hybrid("G-GE*E", num_moe_experts=4, moe_aux_loss_coeff=0.01,
                    moe_router_load_balancing_type="aux_loss")
    batch = make_batch(6, SHAPES)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, LOSS, packing=plan)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, plan, LOSS)
    assert_equal_step(dense, dense_grads, reuse, param_grads(model))


def _pp2_rank(kind, pattern):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import max_relative_diff, missing_grads

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = _hybrid(pattern) if kind == "hybrid" else _gpt(pattern)
    dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(model, make_batch(4, SHAPES), 10)
    kinds = sorted({type(layer.self_attention).__name__ for layer in model.decoder.layers
                    if type(layer.self_attention).__name__ != "IdentityOp"})
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(), kinds=kinds,
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                nonzero=not missing_grads(dense=dense_grads, reuse=reuse_grads))


@pytest.mark.parametrize("kind, pattern", [("gpt", (1, 1, 1, 0)), ("hybrid", "G-G|-*G")])
def test_pp2_with_a_gdn_only_stage(kind, pattern):
    try:
        results = run_distributed(_pp2_rank, world_size=2, args=(kind, pattern), timeout_s=300)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert results[0]["kinds"] == ["GatedDeltaNet"], "stage 0 must hold only GDN layers"
    dense_loss, reuse_loss = results[-1]["losses"]
    assert results[-1]["tokens"][0] == results[-1]["tokens"][1] > 0
    assert abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss)
    for r in results:
        assert r["nonzero"] and r["grad_diff"] <= TOL, r


def _tp2_dp2_rank():
    """TP=2 x DP=2: GDN heads split over the TP ranks, groups placed on the DP ranks; Megatron's
    DDP (fp32 main grads, all-reduce) around both the dense and the reuse step of the rank's
    placed groups."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, prepare_for_training, reuse_step,
                                           zero_grads)
    from prefix_schedule.planning.placement import place_groups
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=2)
    model = prepare_for_training(_gpt((1, 0, 1, 0), attention_output_gate=True), ddp=True)
    batch = make_batch(51, SHAPES + [(9, [4, 4, 6])])
    placement = place_groups(batch, dp_size=parallel_state.get_data_parallel_world_size(),
                             token_budget=12, max_seq_len=512)
    local = placement.ranks[parallel_state.get_data_parallel_rank()].batch
    zero_grads(model)
    dense = dense_step(model, local, LOSS)
    dense_grads = param_grads(model)
    zero_grads(model)
    reuse = reuse_step(model, local, plan_microbatches(local, token_budget=12, max_seq_len=512),
                       LOSS)
    reuse_grads = param_grads(model)
    gdn = model.module.decoder.layers[0].self_attention
    return dict(local_heads=gdn.num_v_heads_local_tp, groups=len(local.groups),
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                nonzero=not missing_grads(dense=dense_grads, reuse=reuse_grads))


def test_tp2_dp2_gdn_reuse_equals_dense():
    try:
        results = run_distributed(_tp2_dp2_rank, world_size=4, timeout_s=400)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert all(r["local_heads"] == 2 for r in results), results  # 4 value heads over TP=2
    assert all(r["groups"] > 0 for r in results), "placement left a DP rank empty"
    for r in results:
        dense_loss, reuse_loss = r["losses"]
        assert r["tokens"][0] == r["tokens"][1] > 0
        assert abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss), r
        assert r["nonzero"] and r["grad_diff"] <= TOL, r
