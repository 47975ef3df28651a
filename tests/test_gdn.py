"""Gated DeltaNet (Qwen3-Next / Qwen3.5 layout) with prefix reuse == stock Megatron dense.

GDN layers cache a recurrent state and a conv tail per group instead of K/V ([Note: recurrent
prefix state] in prefix_schedule/runtime/state_cache.py); attention layers (with
attention_output_gate and partial RoPE) cache K/V. Every case: loss and every fp32 parameter
gradient within 1e-5 relative of stock dense on the same data. On CPU the fla kernels are the
CPU layer's torch stand-ins (megatron_patches/gdn_cpu.py) on both sides.
"""

import zlib

import pytest
import torch

from test_equivalence import assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


def _gdn_model(num_layers=4, linear_attention_freq=2, **overrides):
    from megatron_patches.gdn import build_gdn_model
    from megatron_patches.models import TinyLlamaConfig
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
