"""The predicted prefix cache of hybrid models (planning/memory_model_state.py): a fixed-size
state per prefix unit for GDN and Mamba-2 layers, by hand and against the bytes PrefixKVCache
holds in a real tiny hybrid reuse step (tools/memory_probe.py's cache_peak_bytes)."""
import dataclasses

import pytest

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.memory_model_state import prefix_cache_shape
from prefix_schedule.planning.planner import plan_microbatches
from test_equivalence import make_batch
from test_flops import TINY
from tools_import import tool

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)
MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)


def test_state_bytes_by_hand():
    dims = dataclasses.replace(TINY, num_layers=4, hybrid_pattern="G*M-", **GDN, **MAMBA,
                               mamba_conv_kernel_dim=4)
    shape = prefix_cache_shape(dims, act_bytes=2)
    # GDN: rule 4*16*16 = 1024 fp32, conv tail 3 x (2*2*16 + 4*16 = 128) = 384 bf16;
    # Mamba: SSD 8*16*16 = 2048 fp32, conv tail 3 x (128 + 2*2*16 = 192) = 576 bf16
    assert (shape.kv_layers, shape.state_layers) == (1, 2)
    assert shape.state_bytes == 4 * 1024 + 2 * 384 + 4 * 2048 + 2 * 576
    assert shape.state_grad_bytes == 4 * (1024 + 384 + 2048 + 576)
    assert prefix_cache_shape(dims, act_bytes=2, tp=2).state_bytes == shape.state_bytes / 2
    assert prefix_cache_shape(dims, layers=range(1, 2)).state_layers == 0  # the `*` stage
    gpt = dataclasses.replace(TINY, num_layers=4, linear_attention_freq=4, **GDN)
    assert (prefix_cache_shape(gpt).kv_layers, prefix_cache_shape(gpt).state_layers) == (1, 3)
    with pytest.raises(ValueError, match="tp=0"):
        prefix_cache_shape(dims, tp=0)


@pytest.mark.megatron
@pytest.mark.parametrize("pattern", ["G-M-", "GM", "G*M-"])
def test_state_bytes_equal_the_real_cache(megatron_env, pattern):
    """One group (fp32): the cache's peak is the unit's states plus their fp32 gradients, and an
    attention layer's K/V and fp32 gK/gV per cached token, to the byte."""
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.runtime.step import ReuseStep

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=256)
    model = build_hybrid_model(cfg, pattern, **GDN, **MAMBA)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(5, [(40, [6, 9, 4])])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=256)
    step = ReuseStep(batch, plan)
    report = tool("memory_probe").measure_reuse(
        model, step, lambda s: reuse_step(model, batch, plan, LOSS, step=s))
    dims = dataclasses.replace(TINY, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               num_layers=len(pattern), hybrid_pattern=pattern, **GDN, **MAMBA)
    shape = prefix_cache_shape(dims, act_bytes=4)
    kv = 2 * 16  # K/V heads x head width
    per_token = shape.kv_layers * (2 * kv * 4 + 2 * kv * 4)  # K and V leaves, fp32 gK/gV
    assert shape.kv_layers == pattern.count("*")
    assert report.cache_peak_bytes == shape.state_bytes + shape.state_grad_bytes + \
        39 * per_token  # the 40-token prompt's cached 39


@pytest.mark.megatron
def test_cached_conv_tails_own_their_storage(megatron_env, monkeypatch):
    """A GDN / Mamba conv tail is cached as a copy: a view of the conv window would keep the whole
    prefix window alive with the cache (and on the device under offload, which keeps every
    storage the cache shares), though the cache counts only the tail."""
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.runtime.cache import PrefixKVCache

    stored = []
    original = PrefixKVCache.store_state

    def record(self, group, layer, name, tensor, **kw):
        stored.append((name, tensor))
        return original(self, group, layer, name, tensor, **kw)

    monkeypatch.setattr(PrefixKVCache, "store_state", record)
    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=256)
    model = build_hybrid_model(cfg, "G*M-", **GDN, **MAMBA)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(5, [(40, [6, 9, 4])])
    reuse_step(model, batch, plan_microbatches(batch, token_budget=16, max_seq_len=256), LOSS)
    tails = [t for name, t in stored if name == "conv"]
    assert len(tails) == 2  # one GDN and one Mamba layer, one group
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tails)
