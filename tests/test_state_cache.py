"""The recurrent-state part of PrefixKVCache ([Note: recurrent prefix state]), no model:
d(state) accumulates in fp32 over reads, Phase C backpropagates it through the stored graph
together with gK/gV, chunks chain, and misuse raises."""

import pytest
import torch

from prefix_schedule.runtime.cache import CacheProtocolError, PrefixKVCache


def _state(x, w):
    return (x * w).sum(0, keepdim=True)  # a "final state" computed from the prefix


def test_state_gradient_accumulates_in_fp32_and_drives_phase_c_with_kv():
    x = torch.randn(5, 3, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.bfloat16)
    k = (x * 2).reshape(5, 1, 1, 3)  # attention K/V of another layer, same prefix graph
    cache = PrefixKVCache()
    cache.store_state(0, 1, "rule", _state(x, w), num_tokens=5)
    cache.store(0, 2, k, k)
    reads = [cache.read_state(0, 1, "rule") for _ in range(3)]
    assert all(r.dtype == torch.bfloat16 for r in reads)
    for i, r in enumerate(reads):
        (r.float() * (i + 1)).sum().backward()
    entry = cache._entries[(0, 0)][1].states["rule"]
    assert entry.grad.dtype == torch.float32 and torch.equal(entry.grad, torch.full((1, 3), 6.0))
    pk, pv = cache.read(0, 2)
    (pk.float().sum() + pv.float().sum()).backward()
    cache.backward(0)
    expected = 6 * w.float() + 4  # d(state) through (x * w).sum(0), d(K) + d(V) through 2x
    assert torch.allclose(x.grad.float(), expected, rtol=1e-2, atol=5e-2)  # bf16 grads
    with pytest.raises(CacheProtocolError, match="already freed"):
        cache.read_state(0, 1, "rule")


def test_chunks_chain_and_bad_reads_raise():
    cache = PrefixKVCache()
    x = torch.randn(4, 2, requires_grad=True)
    cache.store_state(3, 1, "conv", x[:2].clone(), chunk=0, num_tokens=6)
    cache.store_state(3, 1, "conv", x[2:].clone(), chunk=1, num_tokens=4)
    assert torch.equal(cache.read_state(3, 1, "conv"), x[2:])  # the chain's last chunk
    assert torch.equal(cache.read_state(3, 1, "conv", before_chunk=1), x[:2])
    with pytest.raises(ValueError, match="state exists only at a unit's end"):
        cache.read_state(3, 1, "conv", chunks=(0, 1), length=7)
    with pytest.raises(CacheProtocolError, match="no state 'rule'"):
        cache.read_state(3, 1, "rule")
    with pytest.raises(CacheProtocolError, match="holds recurrent state, not K/V"):
        cache.read(3, 1)
    with pytest.raises(CacheProtocolError, match="stored twice"):
        cache.store_state(3, 1, "conv", x[:2], chunk=0, num_tokens=6)
    k = torch.zeros(2, 1, 1, 2)
    cache.store(3, 2, k, k)
    with pytest.raises(CacheProtocolError, match="holds K/V, not state"):
        cache.read_state(3, 2, "conv", chunks=(0,))
    assert cache.nbytes() > 0


def test_full_recompute_injects_and_rebinds_the_state_gradient():
    """[Note: prefix full recompute]: Phase A stored the state without a graph; a re-run's
    output, through inject_state_grad, hands the recomputed state its accumulated fp32 gradient
    (cast to the state's dtype) in the output's backward; rebind_state makes the re-run's state
    the one Phase C backpropagates. Wrong shapes and K/V entries raise."""
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(5, 3).bfloat16().float()  # d(state) * w exact in bf16 and fp32

    def _state(x, w):  # a bf16 state (like a conv tail) computed from the prefix
        return (x * w).sum(0, keepdim=True).bfloat16()
    cache = PrefixKVCache()
    with torch.no_grad():
        cache.store_state(0, 1, "rule", _state(x, w), num_tokens=5)
    cache.store(0, 2, x.reshape(5, 1, 1, 3), x.reshape(5, 1, 1, 3))
    read = cache.read_state(0, 1, "rule")
    assert read.dtype == torch.bfloat16
    read.float().mul(2.0).sum().backward()  # a suffix: d(state) = 2, kept in fp32
    state = _state(x, w)  # the re-run, with its graph
    out = cache.inject_state_grad(0, 1, "rule", x * 3, state)
    out.float().sum().backward()
    assert torch.equal(x.grad, 3 + 2 * w)  # d(out) + d(state) through the state
    with pytest.raises(CacheProtocolError, match="shape"):
        cache.inject_state_grad(0, 1, "rule", x, state[:, :2])
    with pytest.raises(CacheProtocolError, match="holds K/V"):
        cache.inject_state_grad(0, 2, "rule", x, state)
    with pytest.raises(CacheProtocolError, match="no state 'conv'"):
        cache.rebind_state(0, 1, "conv", state)
    x.grad = None
    cache.rebind_state(0, 1, "rule", _state(x, w))
    cache.backward(0)
    assert torch.equal(x.grad, 2 * w)
    assert cache.live_groups() == ()
