"""The FLOP model with Mamba-2 layers and HybridModel patterns (`ModelDims.hybrid_pattern`): by
hand, and the projections and conv of the real tiny Megatron Mamba layer counted by
torch.utils.flop_counter."""
import dataclasses

import pytest
import torch

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, dense_flops, ideal_speedup, reuse_flops
from prefix_schedule.planning.flops_layers import mixer_forward, mixer_to_cache
from prefix_schedule.planning.planner import plan_microbatches
from test_flops import TINY, group
from test_flops_gdn import GDN

# TINY (h=4, f=8, a=2, g=1, d=2, V=10) as a HybridModel. Per token: `*` QKV 64 + proj 32 = 96
# (+ 16 per pair), `-` 128. Mamba H=2, P=2, N=2, G=1, W=4, Q=2: d_inner 4, B+C 4:
# in_proj 2*4*(8 + 4 + 2) = 112, conv 2*4*(4 + 4) = 64, chunk state + read 4*2*2*2 = 32 per
# token, 2*1*2 + 2*2*2 = 12 per causal pair inside a chunk of 2, out_proj 2*4*4 = 32.
MAMBA = dict(mamba_num_heads=2, mamba_head_dim=2, mamba_state_dim=2, mamba_num_groups=1,
             mamba_conv_kernel_dim=4, mamba_chunk_size=2)


def hybrid(pattern, **overrides):
    return dataclasses.replace(TINY, num_layers=len(pattern), hybrid_pattern=pattern,
                               **{**MAMBA, **overrides})


def test_mamba_mixer_by_hand():
    dims = hybrid("M")
    # 3 tokens: chunks of 2 and 1 -> 3 + 1 = 4 pairs; 3*(112 + 64 + 32) + 4*12 = 672, out 3*32.
    assert mixer_to_cache(dims, "M", 3, 0) == 672
    assert mixer_forward(dims, "M", 3, 0) == 672 + 96
    assert mixer_forward(dims, "M", 3, 50) == 672 + 96  # resumes the state: no cached pairs
    # a longer chunk: 3 tokens in one chunk of 4 -> 6 pairs
    assert mixer_to_cache(dataclasses.replace(dims, mamba_chunk_size=4), "M", 3, 0) == 672 + 2 * 12


def test_hybrid_dense_and_reuse_by_hand():
    dims = hybrid("M*-")
    # dense s=3: M 672 + 96, `*` 3*96 + 16*6, `-` 3*128, output 3*80
    assert dense_flops(dims, [3]) == 3 * (768 + 288 + 96 + 384 + 240)
    batch = GroupBatch(groups=[group(3, 2, 1)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=8)
    # prefix (2 tokens): M in full (2*208 + 3*12 + 2*32 = 516), then the `*` QKV 2*64; the
    # trailing `-` never runs on it. Suffix n=2 over 2 cached: M 516, `*` 2*96 + 16*7, `-` 256,
    # output 160. Suffix n=1: M 208 + 12 + 32 = 252, `*` 96 + 16*3, `-` 128, output 80.
    prefix = 516 + 128
    suffixes = (516 + 192 + 112 + 256 + 160) + (252 + 96 + 48 + 128 + 80)
    assert reuse_flops(dims, plan) == 3 * (prefix + suffixes)
    # Mamba last among the caching layers: the prefix stops after its scan (no out_proj)
    late = hybrid("*M-")
    assert reuse_flops(late, plan) - reuse_flops(dims, plan) == 3 * (
        (2 * 96 + 16 * 3 + 2 * 208 + 36) - (516 + 128))


def test_patterns_match_the_gpt_counts():
    """`*-*-` is TINY's GPTModel; `G-*-` its GDN variant (linear_attention_freq=2)."""
    batch = GroupBatch(groups=[group(5, 3, 2, 4), group(4, 1, 2)])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=12)
    gpt = dataclasses.replace(TINY, num_layers=2)
    for pattern, dims in (("*-*-", gpt), ("G-*-", GDN)):
        twin = dataclasses.replace(dims, num_layers=4, hybrid_pattern=pattern,
                                   linear_attention_freq=None)
        assert reuse_flops(twin, plan) == reuse_flops(dims, plan)
        assert ideal_speedup(twin, batch, plan) == ideal_speedup(dims, batch, plan)


def test_moe_layer_after_the_last_cache_counts_its_router():
    dims = hybrid("*E", num_experts=4, moe_router_topk=1)
    batch = GroupBatch(groups=[group(3, 2, 2)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=8)
    # prefix: `*` in full 2*96 + 16*3, then E's router 2*2*4*4 = 64; each suffix n=2 over 2
    # cached: `*` 192 + 16*7, E router 32 + 1 expert 128 per token, output 160
    assert reuse_flops(dims, plan) == 3 * ((192 + 48 + 64) + 2 * (192 + 112 + 2 * 160 + 160))


def test_attention_output_gate_widens_qkv():
    gated = dataclasses.replace(TINY, num_layers=1, attention_output_gate=True)
    plain = dataclasses.replace(TINY, num_layers=1)
    assert dense_flops(gated, [3]) - dense_flops(plain, [3]) == 3 * 3 * 2 * 4 * 4  # 2*h*a*d


@pytest.mark.parametrize("kwargs, message", [
    (dict(hybrid_pattern="M*X"), "one symbol per layer"),
    (dict(hybrid_pattern="M*"), "has 2 layers"),
    (dict(hybrid_pattern="---"), "nothing of a prefix"),
    (dict(hybrid_pattern="*-E"), "give num_experts"),
    (dict(hybrid_pattern="G*-", linear_attention_freq=2), "not both"),
    (dict(hybrid_pattern="M*-", mamba_num_heads=3, mamba_num_groups=2), "multiple"),
    (dict(mamba_chunk_size=0), "mamba_chunk_size"),
])
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, num_layers=3, **kwargs)


def test_nemotron_h_like_layout_pays_off_at_prefix_1024():
    pattern = "M-M-M*-M-M-M*-M-M-"
    dims = ModelDims(num_layers=len(pattern), hidden_size=4096, ffn_hidden_size=21504,
                     num_attention_heads=32, num_query_groups=8, vocab_size=131072,
                     gated_linear_unit=False, hybrid_pattern=pattern, mamba_num_heads=128,
                     mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8)
    batch = GroupBatch(groups=[group(1024, *[64] * 8), group(1024, *[64] * 8)])
    plan = plan_microbatches(batch, token_budget=8 * 64, max_seq_len=2048)
    assert 4.0 < ideal_speedup(dims, batch, plan) < 8.0


@pytest.mark.megatron
def test_real_mamba_layer_projections_and_conv(megatron_env):
    """torch's FLOP counter on Megatron's MambaMixer (local spec, the CPU kernels): in_proj and
    out_proj matmuls and the depthwise conv equal the model's non-scan terms."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig

    shape = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)
    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, vocab_size=256, max_seq_len=64)
    model = build_hybrid_model(cfg, "M", **shape)
    mixer = next(m for m in model.modules() if isinstance(m, MambaMixer))
    length = 24
    with FlopCounterMode(display=False) as counter:
        mixer(torch.randn(length, 1, 64))
    counts = counter.get_flop_counts()

    def module_flops(suffix):
        return sum(n for name, ops in counts.items() if name.endswith(suffix) for n in ops.values())

    conv = sum(n for op, n in counts["Global"].items() if "convolution" in str(op))
    dims = ModelDims(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, gated_linear_unit=True,
                     hybrid_pattern="M", mamba_conv_kernel_dim=mixer.d_conv,
                     mamba_chunk_size=mixer.chunk_size, **shape)
    inner, bc = 8 * 16, 2 * 2 * 16
    assert module_flops("in_proj") == length * 2 * 64 * (2 * inner + bc + 8)
    assert module_flops("out_proj") == length * 2 * inner * 64
    assert conv == length * 2 * mixer.d_conv * (inner + bc)
    # the scan by hand: 24 tokens in one chunk of 128 -> 300 pairs x (2*G*N + 2*H*P), 4*H*P*N
    scan = 300 * (2 * 2 * 16 + 2 * 8 * 16) + length * 4 * 8 * 16 * 16
    assert mixer_to_cache(dims, "M", length, 0) == module_flops("in_proj") + conv + scan
    assert mixer_forward(dims, "M", length, 0) == mixer_to_cache(dims, "M", length, 0) + \
        module_flops("out_proj")
