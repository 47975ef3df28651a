"""Analytic FLOP model: hand-computed tiny cases, and speedup 1 where reuse changes nothing."""
from types import SimpleNamespace

import pytest

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.flops import ModelDims, dense_flops, ideal_speedup, reuse_flops
from prefix_schedule.planning.planner import plan_microbatches

# L=2, h=4, f=8, a=2, g=1, V=10, d=h/a=2. Per token and layer: QKV 2*4*(2*2+2*1*2) = 64,
# out proj 2*4*4 = 32, MLP 2*4*8 + 2*8*4 = 128 -> 224; output layer 2*4*10 = 80 per token;
# attention 4*a*d = 16 per unmasked (query, key) pair per layer.
TINY = ModelDims(num_layers=2, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                 num_query_groups=1, vocab_size=10, gated_linear_unit=False)


def group(prefix_len, *suffix_lens):
    return Group(prefix=list(range(1, prefix_len + 1)),
                 trajectories=[Trajectory(suffix=[7] * n, advantages=1.0) for n in suffix_lens])


def test_kv_channels_default_and_validation():
    assert TINY.kv_channels == 2
    with pytest.raises(ValueError, match="give kv_channels explicitly"):
        ModelDims(num_layers=1, hidden_size=5, ffn_hidden_size=8, num_attention_heads=2,
                  num_query_groups=1, vocab_size=10, gated_linear_unit=False)
    with pytest.raises(ValueError, match="not a multiple of num_query_groups"):
        ModelDims(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                  num_query_groups=3, vocab_size=10, gated_linear_unit=False)


def test_dense_row_by_hand():
    # s=3: 6 causal pairs. forward = 2 layers * (3*224 + 16*6) + 3*80 = 1776; x3 for fwd+bwd.
    assert dense_flops(TINY, [3]) == 3 * 1776
    assert dense_flops(TINY, [3, 4]) == 3 * (1776 + 2 * (4 * 224 + 16 * 10) + 4 * 80)
    with pytest.raises(ValueError, match="int >= 1"):
        dense_flops(TINY, [0])


def test_gated_unit_and_explicit_kv_channels_by_hand():
    gated = ModelDims(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                      num_query_groups=1, vocab_size=10, gated_linear_unit=True, kv_channels=3)
    # QKV 2*4*(2*3+2*1*3) = 96, proj 2*6*4 = 48, MLP 2*4*8*2 + 2*8*4 = 192 -> 336; attn 4*2*3 = 24.
    assert dense_flops(gated, [1]) == 3 * (336 + 24 + 80)


def test_reuse_of_one_group_by_hand():
    batch = GroupBatch(groups=[group(3, 2, 1)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=8)
    # Prefix (2 tokens): layer 1 in full (2*224 + 16*3) + last layer's QKV (2*64) = 624.
    # Suffix n=2 over 2 cached keys: pairs 2*2 + 3 = 7 -> 2*(2*224 + 16*7) + 2*80 = 1280.
    # Suffix n=1 over 2 cached keys: pairs 2 + 1 = 3 -> 2*(224 + 16*3) + 80 = 624.
    assert reuse_flops(TINY, plan) == 3 * (624 + 1280 + 624)
    # Dense rows of 4 and 3 tokens: 2*(4*224 + 16*10) + 4*80 = 2432 and 1776.
    assert dense_flops(TINY, [4, 3]) == 3 * (2432 + 1776)
    assert ideal_speedup(TINY, batch, plan) == pytest.approx((2432 + 1776) / (624 + 1280 + 624))


def test_one_layer_prefix_costs_only_its_qkv():
    one = ModelDims(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                    num_query_groups=1, vocab_size=10, gated_linear_unit=False)
    plan_like = SimpleNamespace(prefixes=[SimpleNamespace(length=5)], microbatches=[])
    assert reuse_flops(one, plan_like) == 3 * 5 * 64


@pytest.mark.parametrize("batch", [
    GroupBatch(groups=[group(5, 3)]),          # a group of one runs dense
    GroupBatch(groups=[group(1, 3, 2, 4)]),    # a one-token prefix caches nothing
])
def test_speedup_is_one_when_nothing_is_cached(batch):
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=16)
    assert plan.prefixes == ()
    assert ideal_speedup(TINY, batch, plan) == 1.0


def test_speedup_grows_with_group_size():
    speedups = []
    for size in (2, 4, 8):
        batch = GroupBatch(groups=[group(32, *[4] * size)])
        speedups.append(ideal_speedup(TINY, batch, plan_microbatches(batch, token_budget=64, max_seq_len=64)))
    assert 1.0 < speedups[0] < speedups[1] < speedups[2]


def test_speedup_rejects_a_plan_of_another_batch():
    batch = GroupBatch(groups=[group(3, 2, 1)])
    other = GroupBatch(groups=[group(3, 2)])
    with pytest.raises(ValueError, match="leaves out group 0, trajectory 1"):
        ideal_speedup(TINY, batch, plan_microbatches(other, token_budget=16, max_seq_len=8))
    with pytest.raises(ValueError, match="does not match the batch"):
        ideal_speedup(TINY, other, plan_microbatches(batch, token_budget=16, max_seq_len=8))


def test_moe_by_hand():
    # TINY with E=4 experts, top-2, expert width 3, shared width 5 (not gated): per token and
    # layer the MLP is router 2*4*4 = 32 + 2 experts * (2*4*3 + 2*3*4 = 48) + shared 2*4*5 +
    # 2*5*4 = 80 -> 208 (instead of 128): layer linear 64 + 32 + 208 = 304.
    moe = ModelDims(num_layers=2, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                    num_query_groups=1, vocab_size=10, gated_linear_unit=False, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=3, moe_shared_ffn_hidden_size=5)
    assert dense_flops(moe, [3]) == 3 * (2 * (3 * 304 + 16 * 6) + 3 * 80)
    # a prefix of 3 cached tokens: layer 1 in full; the last layer up to its router
    # (QKV 64 + out proj 32 + router 32 per token, and the 6 causal pairs' products)
    prefix = 3 * 304 + 16 * 6 + 3 * (64 + 32 + 32) + 16 * 6
    plan = SimpleNamespace(prefixes=[SimpleNamespace(length=3)], microbatches=[])
    assert reuse_flops(moe, plan) == 3 * prefix
    with pytest.raises(ValueError, match="topk"):
        ModelDims(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                  num_query_groups=1, vocab_size=10, gated_linear_unit=False, num_experts=4,
                  moe_router_topk=5)
