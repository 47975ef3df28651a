"""The FLOP model with Gated DeltaNet layers (`ModelDims.linear_attention_freq`), by hand."""
import dataclasses

import pytest

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, dense_flops, ideal_speedup, reuse_flops
from prefix_schedule.planning.planner import plan_microbatches
from test_flops import TINY, group

# TINY with layer 1 GDN, layer 2 attention (freq 2); GDN HK=1, HV=2, dk=dv=2, W=4:
# qk = 2, v = 4: in_proj 2*4*(4 + 8 + 4) = 128, conv 2*4*(4 + 4) = 64, rule 6*2*2*2 = 48,
# out_proj 2*4*4 = 32 -> mixer 240 + out 32 + MLP 128 = 400 per token, no pairs.
GDN = dataclasses.replace(TINY, linear_attention_freq=2, linear_num_key_heads=1,
                          linear_num_value_heads=2, linear_key_head_dim=2,
                          linear_value_head_dim=2, linear_conv_kernel_dim=4)


def test_dense_row_by_hand():
    # s=3: GDN layer 3*400, attention layer 3*224 + 16*6, output 3*80.
    assert dense_flops(GDN, [3]) == 3 * (1200 + 672 + 96 + 240)


def test_reuse_by_hand_and_a_gdn_suffix_ignores_the_cached_length():
    batch = GroupBatch(groups=[group(3, 2, 1)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=8)
    # Prefix (2 tokens): GDN layer in full 2*400, then the attention layer's QKV 2*64 = 928.
    # Suffix n=2 over 2 cached: GDN 2*400 (no pairs) + attention 2*224 + 16*7 + output 2*80.
    # Suffix n=1: 400 + 224 + 16*3 + 80.
    assert reuse_flops(GDN, plan) == 3 * (928 + (800 + 448 + 112 + 160) + (400 + 224 + 48 + 80))
    last_gdn = dataclasses.replace(GDN, linear_attention_freq=3)  # both layers GDN
    # a GDN last layer: the prefix runs its in_proj, conv and rule (240 per token), no out_proj
    assert reuse_flops(last_gdn, plan) == 3 * (2 * 400 + 2 * 240 + (2 * 800 + 160)
                                                + (2 * 400 + 80))
    assert ideal_speedup(GDN, batch, plan) > 1


def test_validation():
    with pytest.raises(ValueError, match="linear_attention_freq"):
        dataclasses.replace(TINY, linear_attention_freq=0)


def test_qwen35_layout_pays_off_at_prefix_1024():
    """3:1 GDN : attention at prefix 1024 / suffix 64 / G=8: the prefix is most of the FLOPs."""
    qwen = ModelDims(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                     num_query_groups=2, kv_channels=256, vocab_size=151936,
                     gated_linear_unit=True, linear_attention_freq=4)
    batch = GroupBatch(groups=[group(1024, *[64] * 8), group(1024, *[64] * 8)])
    plan = plan_microbatches(batch, token_budget=8 * 64, max_seq_len=2048)
    assert 4.0 < ideal_speedup(qwen, batch, plan) < 8.0
