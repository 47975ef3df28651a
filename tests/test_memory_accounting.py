"""Device-memory accounting and prefix-activation offload on a tiny torch model, against bytes
counted by hand (no Megatron): [Note: device-memory accounting] in runtime/memory.py and
[Note: prefix activation offload] in runtime/offload.py."""

import torch

from prefix_schedule.runtime.cache import PrefixKVCache
from prefix_schedule.runtime.memory import DeviceMemoryMeter
from prefix_schedule.runtime.offload import (PinnedHostPool, PrefixActivationOffloader,
                                             prefetch_points)

T, H, F = 16, 32, 64  # tokens, width, inner width
F32 = 4


def _weights():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(H, F, generator=gen).requires_grad_(),
            torch.randn(F, H, generator=gen).requires_grad_())


def _input():
    return torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _forward(x, w1, w2):
    # mm saves x (and w1: a parameter), relu saves its output r, the second mm saves r again
    # (the same storage) and w2: held for backward = x + r
    return (torch.relu(x @ w1) @ w2).square().sum()


HELD = T * H * F32 + T * F * F32 + T * H * F32  # x, r, and y (square saves its input)


def test_saved_activations_counted_once_per_storage_parameters_excluded():
    w1, w2 = _weights()
    x = _input()
    with DeviceMemoryMeter(exclude=[w1, w2]) as meter:
        loss = _forward(x, w1, w2)
        assert meter.saved_bytes == HELD
        loss.backward()
        assert meter.saved_bytes == 0
    assert meter.peak_bytes == HELD
    assert meter.host_bytes == meter.peak_host_bytes == 0


def test_offloaded_bytes_are_host_until_prefetched_and_the_math_is_bitwise_the_same():
    w1, w2 = _weights()
    x = _input()
    _forward(x, w1, w2).backward()
    expected = (x.grad.clone(), w1.grad.clone(), w2.grad.clone())
    for t in (x, w1, w2):
        t.grad = None
    offloader = PrefixActivationOffloader("cpu", params=[w1, w2], min_bytes=0)
    with DeviceMemoryMeter(exclude=[w1, w2], sources=[offloader.resident_tensors]) as meter:
        with offloader.capture(("unit", 0)):
            loss = _forward(x, w1, w2)
        assert meter.device_bytes() == 0, "dormant activations must not count as device"
        assert meter.host_bytes == HELD
        assert offloader.stats["kept_params"] == 2, "w1 and w2 are saved but never copied"
        assert offloader.stats["offloaded_bytes"] == HELD, "r is saved twice, copied once"
        offloader.prefetch(("unit", 0))
        assert meter.host_bytes == 0 and meter.device_bytes() == HELD
        loss.backward()
        assert meter.device_bytes() == 0
    assert meter.peak_host_bytes == HELD
    assert offloader.pool.in_use_bytes == 0 and offloader.pending_units() == ()
    for got, want in zip((x.grad, w1.grad, w2.grad), expected):
        assert torch.equal(got, want)


def test_backward_without_prefetch_fetches_and_returns_every_host_block():
    w1, w2 = _weights()
    x = _input()
    offloader = PrefixActivationOffloader("cpu", params=[w1, w2], min_bytes=0)
    with offloader.capture(7):
        loss = _forward(x, w1, w2)
    assert offloader.pool.in_use_bytes == HELD
    loss.backward()
    assert offloader.pool.in_use_bytes == 0
    assert list(offloader.resident_tensors()) == []


def test_a_full_pool_leaves_tensors_on_the_device():
    w1, w2 = _weights()
    x = _input()
    pool = PinnedHostPool(capacity_bytes=T * F * F32)  # room for r or for x (+ y), not all
    offloader = PrefixActivationOffloader("cpu", params=[w1, w2], min_bytes=0, pool=pool)
    with DeviceMemoryMeter(exclude=[w1, w2], sources=[offloader.resident_tensors]) as meter:
        with offloader.capture(0):
            loss = _forward(x, w1, w2)
        assert meter.host_bytes + meter.device_bytes() == HELD
        assert meter.host_bytes <= pool.capacity_bytes and offloader.stats["pool_full"] >= 1
        loss.backward()
    assert x.grad is not None


def test_cache_kv_and_fp32_gradient_buffers_by_hand():
    L, heads, dim = 12, 2, 8  # bf16 K/V rows, fp32 gK/gV
    cache = PrefixKVCache()
    k = torch.randn(L, 1, heads, dim, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(L, 1, heads, dim, dtype=torch.bfloat16, requires_grad=True)
    with DeviceMemoryMeter(sources=[cache.tensors]) as meter:
        cache.store(0, 1, k * 1, v * 1)  # the graph's K/V; the leaves are views of them
        assert meter.device_bytes() == 2 * L * heads * dim * 2
        pk, pv = cache.read(0, 1)
        (pk.float().sum() + pv.float().sum()).backward()
        assert meter.device_bytes() == 2 * L * heads * dim * 2 + 2 * L * heads * dim * 4
        assert cache.holds_storage(pk) and not cache.holds_storage(k)
        cache.backward(0)
        assert meter.device_bytes() == 0 and not cache.holds_storage(pk)


def test_phases_keep_their_own_peaks():
    w1, w2 = _weights()
    with DeviceMemoryMeter(exclude=[w1, w2]) as meter:
        meter.phase("A", True)
        loss = _forward(_input(), w1, w2)
        meter.phase("A", False)
        meter.phase("B", True)
        loss.backward()
        meter.phase("B", False)
    assert meter.phase_peaks == {"A": HELD, "B": HELD}


def test_prefetch_points():
    kinds = ["PF", "SF", "SB", "PB", "SF", "PB", "PB"]
    keys = [None, None, None, (0, 0), None, (1, 0), (2, 0)]
    assert prefetch_points(kinds, keys) == {3: [(0, 0)], 5: [(1, 0)], 6: [(2, 0)]}
    assert prefetch_points(kinds, keys, lookahead=1) == {2: [(0, 0)], 4: [(1, 0)], 5: [(2, 0)]}
    assert prefetch_points(["PB"], [(3, 1)], lookahead=1) == {0: [(3, 1)]}
