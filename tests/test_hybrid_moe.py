"""MoE (`E`) layers in Megatron's `HybridModel` vs stock dense HybridModel (fp32).

Dense = stock Megatron over the dense packing of the reuse plan (docs/DESIGN.md "MoE"), both
twins in Megatron's DDP with finalize_model_grads, as tests/test_moe.py runs GPTModel MoE. Over
two SGD steps: loss, every aux loss Megatron logs, every gradient, the weights and the expert
bias within 1e-5 relative, for patterns with `E` layers before, between and after the attention
layers -- an `E` layer after the last `*` routes the prefix too: the prefix forward runs on to
its router (layers.prefix_stop) -- and at PP=2.
"""

import pytest

from dist_harness import run_distributed
from megatron_patches.training import worst_of
from test_moe import EQUAL_ROWS, STEPS, TOL, _run_steps, _spans_and_mixes

pytestmark = pytest.mark.megatron

STATS = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
             moe_aux_loss_coeff=[0.1, 0.05], moe_z_loss_coeff=0.01)
BIAS = dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05)


def _builder(pattern):
    def build(overrides):
        from megatron_patches.models.hybrid import build_hybrid_model
        from megatron_patches.models.tiny import TinyLlamaConfig
        from megatron_patches.training import prepare_for_training

        cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=48,
                              num_attention_heads=4, num_query_groups=2, vocab_size=256,
                              max_seq_len=512)
        model = build_hybrid_model(cfg, pattern, num_moe_experts=4, **overrides)
        return prepare_for_training(model, ddp=True)

    return build


CASES = {
    "attention then MoE": ("*E*E", STATS),
    "MoE after the last attention, past an MLP": ("*E*-E", STATS),
    "MoE first": ("E*E*", STATS),
    "expert bias after the last attention": ("*-*E", BIAS),
}


def _assert_equal(records):
    for record in records:
        assert _spans_and_mixes(record["plan"])
        assert record["dense_metrics"].keys() == record["reuse_metrics"].keys()
        assert worst_of(*(record[k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL, record
        assert all(b <= TOL for b in record["bias"]), record["bias"]


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_moe_reuse_equals_dense_over_two_steps(megatron_env, name):
    pattern, overrides = CASES[name]
    bias = overrides is BIAS
    records = _run_steps(overrides, EQUAL_ROWS if bias else STEPS, budget=12 if bias else 9,
                         build=_builder(pattern))
    _assert_equal(records)
    if bias:
        assert len(records[-1]["bias"]) == 1 and records[-1]["bias"][0] <= TOL
    else:
        assert {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"} <= set(
            records[0]["dense_metrics"])


def test_a_trailing_moe_layer_needs_the_prefix_to_reach_its_router(megatron_env, monkeypatch):
    """Stopping at the last attention layer's K/V (the stop before `E` layers were supported)
    leaves the trailing `E` router without the prefix's statistics: the suffix finds none."""
    from megatron_patches.runtime import layers
    from megatron_patches.runtime import stage_runner
    from prefix_schedule.runtime.cache import CacheProtocolError

    monkeypatch.setattr(stage_runner, "prefix_stop",
                        lambda model: (layers.last_kv_layer_number(model), False))
    with pytest.raises(CacheProtocolError, match="layer 5: no router statistics stored"):
        _run_steps(STATS, STEPS[:1], build=_builder("*E*-E"))


def _pp2_rank():
    """Dense twin vs reuse twin at PP=2 (the loss only on the last stage)."""
    import torch

    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, param_grads,
                                           reuse_step, zero_grads)
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch
    from test_moe import _metrics, _rel, _sgd_step

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    build = _builder("*E|*E")
    models = [build(STATS), build(STATS)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    last = parallel_state.is_pipeline_last_stage()
    _metrics()
    out = []
    for seed, shapes in STEPS:
        batch = make_batch(seed, shapes)
        plan = plan_microbatches(batch, token_budget=9, max_seq_len=512)
        for model in models:
            zero_grads(model)
        dense = dense_step(models[0], batch, LOSS, packing=plan)
        dense_metrics, dense_grads = _metrics(), param_grads(models[0])
        reuse = reuse_step(models[1], batch, plan, LOSS)
        reuse_metrics, reuse_grads = _metrics(), param_grads(models[1])
        assert dense_metrics.keys() == reuse_metrics.keys()
        for model, optimizer in zip(models, optimizers):
            _sgd_step(model, optimizer)
        weights = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
        out.append(dict(
            loss=abs(dense.loss - reuse.loss) / abs(dense.loss) if last else 0.0,
            grads=max_relative_diff(dense_grads, reuse_grads),
            metrics=worst_of(*(_rel(dense_metrics[k], reuse_metrics[k]) for k in dense_metrics)),
            weights=max_relative_diff(weights[0], weights[1]),
            experts=float(any("experts" in n for n in dense_grads))))
    return out


def test_hybrid_moe_pp2_reuse_equals_dense():
    for records in run_distributed(_pp2_rank, world_size=2, timeout_s=300):
        for record in records:
            assert record.pop("experts") == 1.0
            assert worst_of(*record.values()) <= TOL, record
