"""Gated DeltaNet (Qwen3-Next / Qwen3.5 layout) with prefix reuse == stock Megatron dense.

GDN layers cache a recurrent state and a conv tail per group instead of K/V ([Note: recurrent
prefix state] in prefix_schedule/runtime/state_cache.py); attention layers (with
attention_output_gate and partial RoPE) cache K/V. Every case: loss and every fp32 parameter
gradient within 1e-5 relative of stock dense on the same data. On CPU the fla kernels are the
CPU layer's torch stand-ins (megatron_patches/support/gdn_cpu.py) on both sides.
"""

import zlib

import pytest
import torch

from test_equivalence import assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


def _gdn_model(num_layers=4, linear_attention_freq=2, **overrides):
    from megatron_patches.models.gdn import build_gdn_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(**{**SHAPE, "num_layers": num_layers})
    model = build_gdn_model(cfg, linear_attention_freq=linear_attention_freq, **overrides)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    weak_decay(model)
    return model


def weak_decay(model, seed=7):
    """Decay rates a trained model has (exp(g) ~ 0.9 per token), so the prefix state reaches the
    suffixes: Megatron's init draws A in [1, 16] (exp(g) ~ e^-8 per token), where the state is
    forgotten within a few tokens and d(A_log), d(dt_bias) sit at fp32 rounding noise."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                a = torch.empty(module.A_log.shape).uniform_(0.02, 0.3, generator=gen)
                module.A_log.copy_(a.log())
                module.dt_bias.copy_(torch.empty(module.dt_bias.shape).uniform_(
                    -4.0, -2.0, generator=gen))


@pytest.fixture(scope="module")
def qwen_next(megatron_env):
    """GDN, attention, GDN, attention: Qwen3-Next's gated attention with partial RoPE."""
    return _gdn_model(attention_output_gate=True, rotary_percent=0.5)


CASES = {
    "several groups, packed rows": ([(33, [6, 9, 4]), (17, [8, 3]), (50, [5, 7, 6, 2])], 20),
    "one group over many microbatches": ([(40, [9, 7, 12, 5, 8, 11])], 16),
    "prefix shorter than the conv window": ([(1, [7, 5]), (2, [4, 6]), (12, [3, 3])], 16),
    "suffix length 1": ([(24, [1, 1, 3, 1])], 8),
    "prefix and suffix across the rule's 64-token chunks": ([(90, [70, 5])], 80),
    "group of one runs dense beside cached groups": ([(30, [6]), (20, [5, 4])], 64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gdn_reuse_equals_dense(qwen_next, name):
    shapes, budget = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) % 1000, shapes)
    dense, dense_grads, reuse, reuse_grads, plan = run_both(qwen_next, batch, budget)
    assert any(len({s.group for s in mb.segments}) > 1 for mb in plan.microbatches) or \
        name != "several groups, packed rows", "the case must pack several groups in a row"
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)


def test_gdn_prefix_chunks_resume_from_the_previous_chunk_state(qwen_next):
    """A chunked prefix: chunk c starts from chunk c-1's state and conv tail (chunk lengths 5
    and 3: one shorter than the conv window), and its backward feeds chunk c-1's d(state)."""
    for chunk_tokens in (5, 3):
        batch = make_batch(11 + chunk_tokens, [(23, [6, 4, 5]), (9, [3, 7])])
        assert_equal_step(*run_both(qwen_next, batch, 12, prefix_chunk_tokens=chunk_tokens)[:4])


def test_gdn_with_selective_core_attention_recompute(megatron_env):
    """The attention layers' core attention re-runs in backward (inside a reuse context) next to
    GDN layers. (`gdn_norm_out` recompute needs Transformer Engine's FP8 state even in stock
    dense Megatron: not runnable on CPU.)"""
    model = _gdn_model(recompute_granularity="selective", recompute_modules=["core_attn"])
    batch = make_batch(3, [(30, [7, 4, 9]), (12, [5])])
    assert_equal_step(*run_both(model, batch, 12)[:4])


def test_gdn_moe_layers(megatron_env):
    """GDN with MoE MLPs (Qwen3-Next / Qwen3.5-MoE layout): dropless routing, aux loss with the
    prefix counted G times ([Note: logical prefix tokens])."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    destroy_moe_metrics_tracker()  # sized by an earlier model's layer count
    model = _gdn_model(num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
                       moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
                       attention_output_gate=True)
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import dense_step, reuse_step
    from test_equivalence import LOSS, _grads

    batch = make_batch(5, [(26, [5, 8, 3]), (14, [6, 6])])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, LOSS, packing=plan)  # MoE statistics are per microbatch
    dense_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, plan, LOSS)
    assert_equal_step(dense, dense_grads, reuse, _grads(model))


@pytest.mark.parametrize("last", ["gdn", "attention"])
def test_gdn_last_layer_kind(megatron_env, last):
    """The prefix forward stops after the last layer's cached state (a GDN last layer) or K/V."""
    pattern = [1, 0, 1, 1] if last == "gdn" else [1, 1, 1, 0]
    model = _gdn_model(linear_attention_freq=pattern)
    batch = make_batch(9, [(21, [5, 5, 5]), (19, [5, 5, 5])])
    assert_equal_step(*run_both(model, batch, 11)[:4])


def test_gdn_tree_read_inside_a_unit_is_refused_before_compute(qwen_next):
    """A trajectory following a node with children stops one token before the node's end:
    without StepPlan.state_reads no state exists there."""
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import reuse_step
    from test_equivalence import LOSS
    from tree_batches import make_tree_batch

    qwen_next.zero_grad(set_to_none=True)
    batch = make_tree_batch(7, [dict(depth=2, branching=2, node_len=6, suffix_len=4, inner=1)])
    with pytest.raises(ValueError, match="state_reads=True"):
        reuse_step(qwen_next, batch, plan_microbatches(batch, token_budget=12, max_seq_len=512),
                   LOSS)
    assert all(p.grad is None for p in qwen_next.parameters())


@pytest.mark.parametrize("shape", [
    dict(depth=2, branching=2, node_len=6, suffix_len=4, inner=1),
    dict(depth=3, branching=2, node_len=5, suffix_len=3, inner=1, per_leaf=2, node_loss=True),
])
@pytest.mark.parametrize("chunk", [None, 4])
def test_gdn_prefix_trees_equal_dense(qwen_next, shape, chunk):
    """Prefix trees: every node's units start from their parent unit's state and conv tail,
    readers of a node with children stop at the unit StepPlan.state_reads cuts; == dense."""
    from prefix_schedule.planning.planner import plan_microbatches

    from tree_batches import make_tree_batch

    batch = make_tree_batch(8, [shape, dict(shape, depth=2)])
    *result, plan = run_both(qwen_next, batch, 16, prefix_chunk_tokens=chunk, state_reads=True)
    assert_equal_step(*result)
    uncut = plan_microbatches(batch, token_budget=16, max_seq_len=512, prefix_chunk_tokens=chunk)
    assert len(plan.prefix_units()) > len(uncut.prefix_units())  # really cut inside nodes


def test_gdn_deterministic_mode_runs_the_torch_rule_per_segment(megatron_env):
    """deterministic_mode: Megatron's GDN takes F.conv1d and its torch chunked rule (no varlen);
    the hook then runs the rule per segment. Otherwise (the fla contract, here the CPU layer's
    stand-in) one varlen call with one initial state per packed sequence."""
    from megatron.core.ssm.gated_delta_net.gdn import torch_chunk_gated_delta_rule

    model = _gdn_model(deterministic_mode=True)
    gdn = model.decoder.layers[0].self_attention
    assert gdn.gated_delta_rule is torch_chunk_gated_delta_rule
    batch = make_batch(8, [(33, [6, 9, 4]), (17, [8, 3])])
    assert_equal_step(*run_both(model, batch, 20)[:4])


@pytest.mark.gpu
def test_fla_varlen_rule_with_per_sequence_initial_states(megatron_env, monkeypatch):
    """fla's chunk_gated_delta_rule (bf16, cu_seqlens, [N, HV, K, V] initial states) against the
    torch rule per sequence in fp32: outputs, final states and dq/dk/dv/dg/dbeta/dh0
    (tools/gpu_check_gdn.py, also run by tools/gpu_check.py)."""
    from pathlib import Path

    from megatron.core.ssm.gated_delta_net import common

    if not common.HAVE_FLA:
        pytest.skip("flash-linear-attention is not installed")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_check_gdn

    result = gpu_check_gdn.check_kernel(torch.device("cuda"), dry_run=False)
    assert result["ok"], result
