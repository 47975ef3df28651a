"""gpt-oss attention (learnable sinks, softmax_type='learnable'; sliding window on alternate
layers, window_size=(W, 0) + window_attn_skip_freq=2) with prefix reuse == stock Megatron dense
(local DotProductAttention: Megatron's own SoftmaxOne and sliding-window mask), fp32, every
gradient within 1e-5 (the sinks' included), NaN/inf fail."""
import zlib

import pytest
import torch

from test_equivalence import assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

WINDOW = 5
SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
GPTOSS_ATTENTION = dict(window_size=(WINDOW, 0), window_attn_skip_freq=2,
                        softmax_type="learnable", add_qkv_bias=True)


def build(**overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(**SHAPE), **{**GPTOSS_ATTENTION, **overrides})
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():  # sinks of order 1, not Megatron's 0.02 init
        if name.endswith("softmax_offset"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def model(megatron_env):
    return build()


def test_layers_alternate_window_and_full(model):
    from megatron_patches.runtime.hooks import _sink_and_window

    got = [_sink_and_window(layer.self_attention)[1] for layer in model.decoder.layers]
    assert got == [WINDOW, None, WINDOW, None]  # Megatron: layer_number % 2 != 0 is windowed
    assert all(layer.self_attention.core_attention.softmax_offset.requires_grad
               for layer in model.decoder.layers)


CASES = {  # (groups: (prefix, suffixes), token budget, prefix_chunk_tokens)
    "prefix longer than the window, several groups": ([(23, [6, 9, 4]), (17, [8, 3])], 20, None),
    "prefix shorter than the window": ([(3, [7, 5]), (4, [9, 2])], 16, None),
    "1-token suffixes": ([(14, [1, 1, 3, 1]), (2, [1, 1])], 8, None),
    "prefix chunks": ([(27, [6, 9, 4]), (13, [8, 3, 5])], 12, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reuse_equals_dense(model, name):
    shapes, budget, chunk = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) % 1000, shapes)
    kwargs = {} if chunk is None else {"prefix_chunk_tokens": chunk}
    dense, dg, reuse, rg, plan = run_both(model, batch, budget, **kwargs)
    assert plan.prefixes, "no group went through the cache"
    sinks = [n for n in dg if n.endswith("softmax_offset")]
    assert len(sinks) == 4 and all(dg[n].abs().max() > 0 for n in sinks)
    assert_equal_step(dense, dg, reuse, rg)
