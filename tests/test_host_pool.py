"""The offload host pool under varying tensor sizes ([Note: pinned host pool] in
runtime/host_pool.py): it never pins past its bound, blocks never overlap, a block's reuse waits
for the copies still using it, and offload with it stays bitwise equal to no offload."""

import random

import pytest
import torch

from prefix_schedule.runtime.offload import PinnedHostPool, PrefixActivationOffloader

H, F = 32, 64  # width, inner width


def test_varying_sizes_never_pin_past_the_bound_and_blocks_never_overlap():
    rng = random.Random(0)
    cap = 40_000
    pool = PinnedHostPool(capacity_bytes=cap)
    live = []  # (block, fill byte)
    served = refused = 0
    for i in range(400):
        if live and (rng.random() < 0.45 or len(live) > 6):
            block, fill = live.pop(rng.randrange(len(live)))
            assert bool((block == fill).all()), "another block was written over this one"
            pool.give(block)
        else:
            block = pool.take(rng.choice([100, 700, 1500, 3000, 5000, 9000, 15000]))
            if block is None:
                refused += 1
                continue
            served += 1
            block.fill_(i % 251)
            live.append((block, i % 251))
        assert pool.allocated_bytes <= cap and pool.in_use_bytes <= cap
    assert served > 150 and refused > 0  # the bound bit, and most requests were served anyway
    assert all(s.numel() & (s.numel() - 1) == 0 for s in pool._slabs), \
        "slabs are powers of two: torch's pinned allocator pins exactly those bytes"
    for block, _ in live:
        pool.give(block)
    assert pool.in_use_bytes == 0
    assert pool.take(16_384) is not None, "freed extents merge back into a whole slab"


def test_a_returned_block_is_reused_and_a_negative_bound_refused():
    pool = PinnedHostPool(capacity_bytes=100)
    block = pool.take(60)
    assert pool.take(60) is None
    pool.give(block)
    again = pool.take(60)
    assert again.data_ptr() == block.data_ptr() and pool.allocated_bytes == 64
    small = PinnedHostPool(capacity_bytes=1000)
    first = small.take(500)  # the 512-byte piece; the 256-byte one is left
    small.give(first)
    assert small.take(200).data_ptr() == first.data_ptr(), "a larger free block serves a smaller"
    assert small.allocated_bytes == 512
    with pytest.raises(ValueError, match="capacity_bytes"):
        PinnedHostPool(capacity_bytes=-1)


class _Event:
    def __init__(self):
        self.synchronized = 0

    def query(self):
        return False  # still running

    def synchronize(self):
        self.synchronized += 1


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_reuse_waits_for_the_copy_on_the_taking_stream_not_the_host():
    pool = PinnedHostPool(capacity_bytes=4096)
    block = pool.take(1000)
    event, stream = _Event(), _Stream()
    pool.give(block, event)  # a copy still reads the block
    assert pool.take(1000, stream).data_ptr() == block.data_ptr()
    assert stream.waited == [event] and event.synchronized == 0
    pool2 = PinnedHostPool(capacity_bytes=4096)
    block = pool2.take(1000)
    pool2.give(block, event)
    pool2.take(500)  # no stream: the host waits
    assert event.synchronized == 1


def _grads(lengths, offloader=None, order=(), device="cpu"):
    """Prefixes of `lengths` tokens through one MLP: forward each (offloaded under its own unit
    when `offloader`), backward in `order` (units overlap as under PP)."""
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(H, F, generator=gen).to(device).requires_grad_()
    w2 = torch.randn(F, H, generator=gen).to(device).requires_grad_()
    xs = [torch.randn(n, H, generator=gen).to(device).requires_grad_() for n in lengths]
    losses, peak = {}, 0
    for step in order:
        if step >= 0:  # forward of unit `step`
            if offloader is None:
                losses[step] = (torch.relu(xs[step] @ w1) @ w2).square().sum()
            else:
                with offloader.capture(step):
                    losses[step] = (torch.relu(xs[step] @ w1) @ w2).square().sum()
        else:
            unit = -step - 1
            if offloader is not None:
                offloader.prefetch(unit)
            losses.pop(unit).backward()
        if offloader is not None:
            peak = max(peak, offloader.pool.allocated_bytes)
    return [w1.grad, w2.grad] + [x.grad for x in xs], peak


def test_offload_with_varying_prefix_lengths_stays_in_its_bound_and_bitwise_exact():
    lengths = [16, 24, 8, 40, 12, 32]  # x and r of each are offloaded: 2-10 KiB apiece
    order = [0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, -6]  # two units in flight, as under PP
    cap = 24 * 1024
    expected, _ = _grads(lengths, order=order)
    offloader = PrefixActivationOffloader("cpu", min_bytes=0, pool=PinnedHostPool(cap))
    got, peak = _grads(lengths, offloader, order)
    assert peak <= cap, f"the pool pinned {peak} bytes past its bound {cap}"
    assert offloader.stats["offloaded_bytes"] > 2 * cap, "the pool's blocks were reused"
    assert offloader.pool.in_use_bytes == 0 and offloader.pending_units() == ()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.gpu
def test_offload_on_cuda_with_varying_lengths_is_bitwise_and_bounded():
    """Pinned pool, side stream, non_blocking copies: the same bits as without offload."""
    lengths = [16, 24, 8, 40, 12, 32]
    order = [0, 1, -1, 2, -2, 3, -3, 4, -4, 5, -5, -6]
    lengths = [n * 64 for n in lengths]
    expected, _ = _grads(lengths, order=order, device="cuda")
    offloader = PrefixActivationOffloader("cuda", min_bytes=0,
                                          pool=PinnedHostPool(1 << 21, pin=True))
    got, peak = _grads(lengths, offloader, order, device="cuda")
    torch.cuda.synchronize()
    assert peak <= 1 << 21 and offloader.stats["offloaded_bytes"] > 1 << 21
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
