"""Nemotron-H MoE (Nemotron 3 Nano layout: Mamba-2 `M`, attention `*` without positions and
MoE `E` layers in a HybridModel pattern) with prefix reuse == stock dense HybridModel (fp32).

The tiny twin keeps Nano's layer kinds and routing at tiny width: sigmoid router scores with an
expert bias (aux-loss-free balancing, updated after each step), top-k scaled by a routed scaling
factor, a shared expert, squared-ReLU (non-gated) experts and MLPs, no RoPE. Dense = stock
Megatron over the dense packing of the reuse plan, both twins in DDP; over two SGD steps:
loss, every gradient, the weights and the expert biases within 1e-5 (tests/test_hybrid_moe.py's
checks), Mamba prefix states reaching the suffixes (slow decay, as tests/test_mamba.py)."""
import pytest
import torch

from test_hybrid_moe import _assert_equal
from test_moe import EQUAL_ROWS, _run_steps

pytestmark = pytest.mark.megatron

NANO_TINY_PATTERN = "MEM*EME"  # Nano: M E M E M * E ... (Mamba/MoE pairs, sparse attention)
MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)


def nano_moe():
    from megatron.core.activations import squared_relu

    return dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                moe_router_load_balancing_type="none", moe_router_topk_scaling_factor=2.5,
                moe_shared_expert_intermediate_size=32, moe_ffn_hidden_size=24,
                activation_func=squared_relu, gated_linear_unit=False)


def build(overrides):
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import prepare_for_training

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=48, num_attention_heads=4,
                          num_query_groups=2, vocab_size=256, max_seq_len=512)
    model = build_hybrid_model(cfg, NANO_TINY_PATTERN, num_moe_experts=4,
                               position_embedding_type="none", **MAMBA, **overrides)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # slow decay: the prefix state reaches the suffixes
        for module in model.modules():
            if isinstance(module, MambaMixer):
                module.chunk_size = 16
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(
                    0.05, 0.5, generator=gen).log())
                module.dt_bias.copy_(torch.empty(module.dt_bias.shape).uniform_(
                    -3.0, -1.0, generator=gen))
    return prepare_for_training(model, ddp=True)


def test_nano_moe_reuse_equals_dense_over_two_steps(megatron_env):
    records = _run_steps(nano_moe(), EQUAL_ROWS, budget=12, build=build)
    _assert_equal(records)
    assert len(records[-1]["bias"]) == 3  # one expert bias per `E` layer, equal after 2 steps
    assert all(r["grads"] <= 1e-5 for r in records)


def nano_ep_rank(ep: int) -> dict:
    """One step under expert parallelism: each EP (data-parallel) rank its own groups."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step)
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch

    megatron_patches.install()
    initialize_distributed(seed=1234, ep=ep)
    overrides = dict(nano_moe(), moe_token_dispatcher_type="alltoall")
    models = [build(overrides) for _ in range(2)]
    seed, shapes = EQUAL_ROWS[0]
    batch = make_batch(seed + 100 * parallel_state.get_data_parallel_rank(), shapes)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    dense = dense_step(models[0], batch, LOSS, packing=plan)
    reuse = reuse_step(models[1], batch, plan, LOSS)
    dg, rg = param_grads(models[0]), param_grads(models[1])
    return dict(loss=abs(dense.loss - reuse.loss) / abs(dense.loss),
                grads=max_relative_diff(dg, rg), missing=missing_grads(dense=dg, reuse=rg),
                experts=sum("local_experts" in n for n in dg), prefixes=len(plan.prefixes))


@pytest.mark.slow
def test_nano_moe_ep2_reuse_equals_dense():
    from dist_harness import run_distributed

    for rank, out in enumerate(run_distributed(nano_ep_rank, world_size=2, args=(2,),
                                               timeout_s=300)):
        assert out["experts"] > 0 and out["prefixes"] > 0 and not out["missing"], (rank, out)
        assert out["loss"] <= 1e-5 and out["grads"] <= 1e-5, (rank, out)
