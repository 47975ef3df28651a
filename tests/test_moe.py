"""MoE in prefix-reuse steps vs stock Megatron dense with the same packing (fp32, EP=1).

Two twin models (same seed), each wrapped in Megatron's DDP with its finalize_model_grads (which
also updates the aux-loss-free expert bias and resets the global aux-loss state): the dense twin
runs stock `forward_backward_no_pipelining` over the dense packing of the reuse plan (microbatch
b = the full rows of the trajectories of reuse microbatch b, docs/DESIGN.md "MoE"), the reuse
twin the prefix-reuse schedule. Over two optimizer steps: loss, every aux loss Megatron logs,
every gradient, the weights and the expert bias within 1e-5 relative.
"""

import pytest
import torch

from prefix_schedule.planning.planner import plan_microbatches
from megatron_patches.training import worst_of
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

TOL = 1e-5
SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_token_dispatcher_type="allgather")
# group 0 spans three microbatches, microbatch 2 holds groups 0 and 1 (budget 9)
STEPS = ((5, [(26, [5, 8, 3]), (14, [6, 6])]), (6, [(17, [4, 5, 3]), (23, [3, 5, 2])]))
# equal-length dense rows per microbatch (stock Megatron 0.19.2's expert-bias count fails with a
# padding mask: routing_map [N, E] & ~padding_mask [N]), still spanning and mixing groups
EQUAL_ROWS = ((7, [(20, [6, 6, 6]), (20, [6, 6, 6])]), (8, [(15, [5, 5, 5]), (15, [5])]))

CASES = {
    "aux_loss+z_loss+shared": dict(moe_router_load_balancing_type="aux_loss",
                                   moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                                   moe_shared_expert_intermediate_size=48),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss",
                            moe_aux_loss_coeff=0.1),
    "all_three+alltoall": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss",
                                                               "global_aux_loss"],
                               moe_aux_loss_coeff=[0.1, 0.05, 0.02], moe_z_loss_coeff=0.01,
                               moe_token_dispatcher_type="alltoall"),
    "dense_last_layer": dict(moe_layer_freq=[1, 0], moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01),
    "expert_bias": dict(moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05),
}


def _twin(overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import prepare_for_training

    model = build_model(TinyLlamaConfig(**SMALL), **{**MOE, **overrides})
    return prepare_for_training(model, ddp=True)


def _metrics() -> dict:
    from megatron.core.transformer.moe.moe_logging import (destroy_moe_metrics_tracker,
                                                           get_moe_metrics_tracker)

    values = {name: entry.values.clone() for name, entry in get_moe_metrics_tracker().metrics.items()}
    destroy_moe_metrics_tracker()  # the next model may have another number of layers
    return values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def _sgd_step(model, optimizer):
    for p in model.parameters():  # DDP keeps the gradient in main_grad
        p.grad = p.main_grad
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _expert_bias(model):
    from megatron_patches.runtime.moe import routers

    return [r.expert_bias.clone() for r in routers(model) if r.expert_bias is not None]


def _run_steps(overrides, steps, budget=9, build=None, **plan_kwargs):
    """Dense twin vs reuse twin (`build(overrides)`, default `_twin`) over `steps`; returns
    per-step differences."""
    from megatron_patches.training import (dense_step, max_relative_diff, param_grads,
                                           reuse_step, zero_grads)

    build = build or _twin
    dense_model, reuse_model = build(overrides), build(overrides)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                  for m in (dense_model, reuse_model)]
    _metrics()
    records = []
    for seed, shapes in steps:
        batch = make_batch(seed, shapes)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512, **plan_kwargs)
        for model in (dense_model, reuse_model):
            zero_grads(model)
        dense = dense_step(dense_model, batch, LOSS, packing=plan)
        dense_metrics, dense_grads = _metrics(), param_grads(dense_model)
        reuse = reuse_step(reuse_model, batch, plan, LOSS)
        reuse_metrics, reuse_grads = _metrics(), param_grads(reuse_model)
        for model, optimizer in zip((dense_model, reuse_model), optimizers):
            _sgd_step(model, optimizer)
        weights = [dict(m.named_parameters()) for m in (dense_model, reuse_model)]
        records.append(dict(
            plan=plan, dense_metrics=dense_metrics, reuse_metrics=reuse_metrics,
            loss=abs(dense.loss - reuse.loss) / abs(dense.loss),
            grads=max_relative_diff(dense_grads, reuse_grads),
            router_grads=[_rel(dense_grads[n], reuse_grads[n]) for n in dense_grads
                          if n.endswith("router.weight")],
            metrics=worst_of(*(_rel(dense_metrics[k], reuse_metrics[k]) for k in dense_metrics)),
            weights=max_relative_diff({n: w.detach() for n, w in weights[0].items()},
                                      {n: w.detach() for n, w in weights[1].items()}),
            bias=[_rel(a, b) for a, b in zip(_expert_bias(dense_model),
                                             _expert_bias(reuse_model))],
        ))
    return records


def _spans_and_mixes(plan) -> bool:
    groups_per_mb = [{s.group for s in mb.segments} for mb in plan.microbatches]
    spans = any(sum(g in m for m in groups_per_mb) > 1 for g in set().union(*groups_per_mb))
    return spans and any(len(m) > 1 for m in groups_per_mb)


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_reuse_equals_dense_packing_over_two_steps(megatron_env, case):
    overrides = CASES[case]
    records = _run_steps(overrides, EQUAL_ROWS if case == "expert_bias" else STEPS,
                         budget=12 if case == "expert_bias" else 9)
    for record in records:
        assert _spans_and_mixes(record["plan"])
        assert record["dense_metrics"].keys() == record["reuse_metrics"].keys()
        assert record["loss"] <= TOL
        assert record["grads"] <= TOL, record
        assert record["metrics"] <= TOL, record
        assert record["weights"] <= TOL
        assert all(b <= TOL for b in record["bias"]), record["bias"]
    expected = {"aux_loss": {"load_balancing_loss"}, "seq_aux_loss": {"seq_load_balancing_loss"},
                "global_aux_loss": {"global_load_balancing_loss"}}
    names = set(records[0]["dense_metrics"])
    kinds = overrides.get("moe_router_load_balancing_type")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        assert expected.get(kind, set()) <= names
    if overrides.get("moe_z_loss_coeff"):
        assert "z_loss" in names
    if case == "expert_bias":  # the bias moved, identically
        assert len(records[-1]["bias"]) == 2


def test_dense_packing_matters(megatron_env):
    """The aux loss is per microbatch: one trajectory per dense microbatch is another loss. So
    the equality above pins the packing (and the test can tell packings apart)."""
    from megatron_patches.training import dense_step, param_grads, zero_grads

    model = _twin(CASES["aux_loss+z_loss+shared"])
    batch = make_batch(*STEPS[0])
    plan = plan_microbatches(batch, token_budget=9, max_seq_len=512)
    zero_grads(model)
    dense_step(model, batch, LOSS, packing=plan)
    packed = param_grads(model)
    zero_grads(model)
    dense_step(model, batch, LOSS)  # one trajectory per microbatch
    single = param_grads(model)
    assert max(_rel(packed[n], single[n]) for n in packed if n.endswith("router.weight")) > 1e-3


def test_prefix_multiplicity_is_needed(megatron_env, monkeypatch):
    """Counting a prefix once (multiplicity 1) breaks the expert-bias statistics: the test is
    sensitive to the logical accounting."""
    from prefix_schedule.runtime.step import ReuseStep

    monkeypatch.setattr(ReuseStep, "prefix_multiplicity", lambda self, group: 1)
    records = _run_steps(CASES["expert_bias"], EQUAL_ROWS[:1], budget=12)
    assert max(records[0]["bias"]) > 1e-3


def test_prefix_router_gradient_is_applied_in_phase_c(megatron_env, monkeypatch):
    """Dropping the prefix's accumulated aux-loss / z-loss gradient (Phase C) breaks equality."""
    from prefix_schedule.runtime.router_stats import RouterStats

    monkeypatch.setattr(RouterStats, "backward_pairs", lambda self: iter(()))
    records = _run_steps(CASES["aux_loss+z_loss+shared"], STEPS[:1])
    assert records[0]["metrics"] <= TOL  # forward values still equal
    assert max(records[0]["router_grads"]) > 1e-4


def test_prefix_chunks(megatron_env):
    """Chunked prefixes: each chunk records its own router statistics; suffixes read their sum
    and every chunk's Phase C gets the group's accumulated share."""
    records = _run_steps(CASES["all_three+alltoall"], STEPS[:1], prefix_chunk_tokens=8)
    assert records[0]["plan"].prefix_chunk_tokens == 8
    assert worst_of(*(records[0][k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL


def test_expert_tensor_parallel_size_is_judged_only_with_moe(megatron_env):
    """Megatron sets expert_tensor_parallel_size to the TP size for dense models too; with MoE,
    expert TP is supported and TP > 1 needs sequence parallelism."""
    import types

    from megatron_patches.config.config_support import check_config_supported
    from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config
    from megatron_patches.runtime.moe import check_moe_supported

    dense = make_transformer_config(TinyLlamaConfig(**SMALL))
    dense.expert_tensor_parallel_size = 2
    check_config_supported(dense)
    check_moe_supported(dense)
    moe = dict(num_moe_experts=4, expert_tensor_parallel_size=2, tensor_model_parallel_size=1,
               sequence_parallel=False, context_parallel_size=1,
               moe_router_load_balancing_type="aux_loss", recompute_granularity=None)
    with pytest.raises(ValueError, match="expert TP equal to TP"):
        check_moe_supported(types.SimpleNamespace(**moe))
    tp2 = dict(moe, tensor_model_parallel_size=2, sequence_parallel=True)
    check_moe_supported(types.SimpleNamespace(**tp2))  # tests/test_moe_parallel.py
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        check_moe_supported(types.SimpleNamespace(**dict(tp2, sequence_parallel=False)))


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0), "sinkhorn"),
    (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
    (dict(moe_router_force_load_balancing=True), "moe_router_force_load_balancing"),
    (dict(moe_enable_routing_replay=True), "moe_enable_routing_replay"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
     "recompute"),
])
def test_refused_before_compute(megatron_env, overrides, message):
    from megatron_patches.training import reuse_step

    model = _twin({"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1,
                   **overrides})
    batch = make_batch(*STEPS[0])
    plan = plan_microbatches(batch, token_budget=9, max_seq_len=512)
    with pytest.raises(ValueError, match=message):
        reuse_step(model, batch, plan, LOSS)
    assert all(p.main_grad.abs().max() == 0 for p in model.parameters())


def test_qwen3_30b_a3b_tiny_twin_trains_reuse_equal_dense(megatron_env):
    """The paper's MoE model at tiny sizes (qk-norm, head_dim != hidden / heads, RoPE theta 1e6,
    softmax over the top-k logits = norm_topk_prob, aux_loss): two steps, reuse == dense."""
    from megatron_patches.models.model_configs import MODELS, check_trainable
    from megatron_patches.models.tiny import build_model
    from megatron_patches.training import prepare_for_training
    from test_moe_parallel import _qwen3_moe_tiny

    check_trainable(MODELS["qwen3-30b-a3b-tiny"])
    cfg, moe = _qwen3_moe_tiny()

    def twin(overrides):
        return prepare_for_training(build_model(cfg, **{**moe, **overrides}), ddp=True)

    records = _run_steps({}, STEPS, build=twin)
    assert records[0]["dense_metrics"]["load_balancing_loss"].numel() == cfg.num_layers
    for record in records:
        assert worst_of(*(record[k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL, record


def test_fused_attention_moe_model_has_the_same_parameters(megatron_env):
    """The bench's fair dense baseline: MoE layers with the fused-SDPA core attention."""
    from megatron_patches.models.tiny import FusedSDPACoreAttention, TinyLlamaConfig, build_model

    fused = build_model(TinyLlamaConfig(**SMALL), fused_attention=True, **MOE)
    local = build_model(TinyLlamaConfig(**SMALL), **MOE)
    assert all(isinstance(layer.self_attention.core_attention, FusedSDPACoreAttention)
               for layer in fused.decoder.layers)
    assert fused.state_dict().keys() == local.state_dict().keys()


def test_prefix_trees_refused_before_compute(megatron_env):
    """MoE x prefix trees: the node statistics' multiplicity is not built; refused, no compute."""
    from megatron_patches.training import reuse_step
    from tree_batches import make_tree_batch

    model = _twin({"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1})
    batch = make_tree_batch(3, [dict(depth=2, branching=2, node_len=6, suffix_len=4)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512)
    assert any(w.nodes is not None for w in plan.prefixes)
    with pytest.raises(ValueError, match="MoE model with prefix trees"):
        reuse_step(model, batch, plan, LOSS)
    assert all(p.main_grad.abs().max() == 0 for p in model.parameters())
