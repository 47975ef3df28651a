"""MoE with expert parallelism on gloo: EP=2 (2 processes), EP=2 x PP=2 and EP=2 x TP=2 (4
processes), TP=2 with expert TP=2 (2 processes).

Each rank holds its own groups (same shapes, different tokens: the expert-parallel ranks' plans
run the same action sequence, which the executor checks), the alltoall dispatcher exchanges
tokens between the expert-parallel ranks in every MoE layer. Dense = stock Megatron (DDP,
finalize_model_grads) over the dense packing of the same plan; over two SGD steps: loss, the
logged aux losses, every gradient and the weights within 1e-5 relative on every rank.
"""

import pytest
import torch

from dist_harness import run_distributed
from megatron_patches.training import worst_of
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

TOL = 1e-5
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type=["aux_loss",
                                                                                  "seq_aux_loss"],
           moe_aux_loss_coeff=[0.1, 0.05], moe_z_loss_coeff=0.01,
           moe_shared_expert_intermediate_size=48)
STEPS = ((5, [(26, [5, 8, 3]), (14, [6, 6])]), (6, [(17, [4, 5, 3]), (23, [3, 5, 2])]))
# TP > 1: dense rows of one length, a multiple of TP (no padding: Megatron normalises the
# per-token aux terms by each TP rank's own valid tokens, [Note: MoE under sequence
# parallelism]); groups still span and share microbatches
TP_STEPS = ((5, [(21, [6, 6, 6]), (21, [6, 6])]), (6, [(16, [5, 5, 5]), (16, [5, 5])]))


def _rel(a, b) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def _qwen3_moe_tiny():
    """The Qwen3-30B-A3B tiny twin (8 experts, top-2, qk-norm, head_dim 16, 4 layers)."""
    from megatron_patches.models.model_configs import MODELS
    from megatron_patches.models.tiny import TinyLlamaConfig

    spec = MODELS["qwen3-30b-a3b-tiny"]
    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
                          qk_layernorm=spec.qk_norm, rotary_base=spec.rope_theta,
                          layernorm_epsilon=spec.rms_norm_eps, vocab_size=spec.vocab_size,
                          max_seq_len=512)
    moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
               moe_router_topk=spec.moe_router_topk, moe_router_score_function="softmax",
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
               moe_token_dispatcher_type="alltoall")
    return cfg, moe


def ep_rank(ep: int, pp: int, qwen: bool = False, tp: int = 1, recompute=None,
            num_steps: int = 2) -> dict:
    """`recompute`: Megatron's recompute settings for both twins (tests/test_moe_recompute.py);
    `num_steps` of STEPS (TP_STEPS)."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_logging import (destroy_moe_metrics_tracker,
                                                           get_moe_metrics_tracker)
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, param_grads,
                                           prepare_for_training, reuse_step, zero_grads)
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp, ep=ep, tp=tp)
    cfg, moe = _qwen3_moe_tiny() if qwen else (TinyLlamaConfig(**MODEL), MOE)
    if tp > 1:  # Megatron-LM's rule for MoE with TP; experts TP-split too (ETP = TP)
        moe = dict(moe, sequence_parallel=True)
    moe = dict(moe, **(recompute or {}))
    models = [prepare_for_training(build_model(cfg, **moe), ddp=True) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    data_rank = parallel_state.get_data_parallel_rank()  # TP ranks share their data

    def metrics():
        tracker = get_moe_metrics_tracker()
        if tp > 1:  # each TP rank logs its shard's terms: compare what Megatron reports,
            tracker._sync_metrics(list(tracker.metrics))  # reduced over TP (and PP, DP)
        values = {k: e.values.clone() for k, e in tracker.metrics.items()}
        destroy_moe_metrics_tracker()
        return values

    out = {"steps": [], "experts": sum(1 for n, _ in models[0].named_parameters()
                                       if "local_experts" in n)}
    for seed, shapes in (TP_STEPS if tp > 1 else STEPS)[:num_steps]:
        batch = make_batch(seed + 100 * data_rank, shapes)  # each EP (DP) rank its own data
        plan = plan_microbatches(batch, token_budget=9, max_seq_len=512, row_multiple=tp)
        for model in models:
            zero_grads(model)
        dense = dense_step(models[0], batch, LOSS, packing=plan)
        dense_metrics, dense_grads = metrics(), param_grads(models[0])
        reuse = reuse_step(models[1], batch, plan, LOSS)
        reuse_metrics, reuse_grads = metrics(), param_grads(models[1])
        for model, optimizer in zip(models, optimizers):
            for p in model.parameters():
                p.grad = p.main_grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weights = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
        last = parallel_state.is_pipeline_last_stage()
        out["steps"].append(dict(
            loss=abs(dense.loss - reuse.loss) / abs(dense.loss) if last else 0.0,
            grads=max_relative_diff(dense_grads, reuse_grads),
            metrics=worst_of(*(_rel(dense_metrics[k], reuse_metrics[k]) for k in dense_metrics)),
            metric_names=sorted(dense_metrics), reuse_metric_names=sorted(reuse_metrics),
            weights=max_relative_diff(weights[0], weights[1])))
    return out


def _check(results):
    for rank, out in enumerate(results):
        assert out["experts"] > 0, f"rank {rank} holds no experts"
        for step in out["steps"]:
            assert step["metric_names"] == step["reuse_metric_names"]
            assert worst_of(*(step[k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL, (
                rank, step)


def test_expert_parallel_2(megatron_env):
    results = run_distributed(ep_rank, world_size=2, kwargs=dict(ep=2, pp=1), timeout_s=300)
    _check(results)
    assert all({"load_balancing_loss", "seq_load_balancing_loss", "z_loss"}
               <= set(out["steps"][0]["metric_names"]) for out in results)


def test_qwen3_30b_a3b_tiny_twin_expert_parallel_2(megatron_env):
    results = run_distributed(ep_rank, world_size=2, kwargs=dict(ep=2, pp=1, qwen=True),
                              timeout_s=300)
    _check(results)


def test_expert_parallel_2_x_pipeline_2(megatron_env):
    results = run_distributed(ep_rank, world_size=4, kwargs=dict(ep=2, pp=2), timeout_s=600)
    _check(results)


def test_tensor_parallel_2_with_expert_tensor_parallel_2(megatron_env):
    """TP=2 with sequence parallelism: each TP rank routes its shard of every row (prefix and
    suffix rows alike); experts split over the same 2 ranks (ETP=2)."""
    results = run_distributed(ep_rank, world_size=2, kwargs=dict(ep=1, pp=1, tp=2),
                              timeout_s=300)
    _check(results)
    assert all("z_loss" in out["steps"][0]["metric_names"] for out in results)


def test_expert_parallel_2_x_tensor_parallel_2(megatron_env):
    results = run_distributed(ep_rank, world_size=4, kwargs=dict(ep=2, pp=1, tp=2),
                              timeout_s=600)
    _check(results)


def mismatch_rank() -> str:
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import prepare_for_training, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, ep=2)
    model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL), **MOE), ddp=True)
    shapes = STEPS[0][1] if parallel_state.get_expert_model_parallel_rank() == 0 else STEPS[1][1]
    batch = make_batch(3, shapes)
    try:
        reuse_step(model, batch, plan_microbatches(batch, token_budget=9, max_seq_len=512), LOSS)
    except ValueError as error:
        assert all(p.main_grad.abs().max() == 0 for p in model.parameters())
        return str(error)
    return "no error"


def test_expert_parallel_ranks_with_different_plans_are_refused(megatron_env):
    """The token exchanges of two different action sequences would pair wrongly (or hang)."""
    results = run_distributed(mismatch_rank, world_size=2, timeout_s=120)
    assert all("same number of groups and microbatches" in r for r in results), results
