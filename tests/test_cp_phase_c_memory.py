"""Phase C of a CP prefix ([Note: CP Phase C memory] in runtime/cp.py): the reduce-scatter of a
chunk's accumulated fp32 gK/gV to this rank's rows holds at most the accumulators plus the one
rank-major send buffer, and stays exact (2 gloo ranks, the single-tensor reduce-scatter NCCL
runs too; gloo's internal input copy, which NCCL does not make, is left out of the count)."""

import weakref

import pytest

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dist_harness import run_distributed

PREFIX, LAYERS, HEADS, DIM = 37, 4, 2, 16  # 37 tokens: padded to 40 at CP=2
TIMEOUT_S = 120


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages alive among `tracked` and every op's outputs, sampled after
    each op (a tensor counts while any Python reference to it, or to a view of it, lives)."""

    def __init__(self, tracked):
        super().__init__()
        self.refs = [weakref.ref(t) for t in tracked]
        self.peak = self.now()

    def now(self) -> int:
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor)]
        self.peak = max(self.peak, self.now())
        return out


def _grads_of(rank, length=PREFIX, seed=100):
    gen = torch.Generator().manual_seed(seed + rank)
    return [torch.randn(length, HEADS, DIM, generator=gen) for _ in range(2 * LAYERS)]


def _phase_c_rank(lengths=(PREFIX,), owners=()):
    """Fill a CP prefix chunk's cache as Phase A and B would (gK/gV = this rank's own), run its
    Phase C, and report the peak live bytes inside the reduce-scatter and the local gradients."""
    import torch.distributed as dist

    import prefix_schedule.runtime.cp as cp_module
    from prefix_schedule.runtime.cache import PrefixKVCache
    from prefix_schedule.runtime.cp import CPGroup

    cp = CPGroup(dist.group.WORLD)
    collective = cp_module._REDUCE_SCATTER

    def reduce_scatter(out, ranked, group=None):
        assert ranked.is_contiguous() and out.is_contiguous()
        assert ranked.shape == (out.shape[0] * dist.get_world_size(group), *out.shape[1:])
        # NCCL writes `out` only; gloo's implementation copies the input first: not ours
        with _disable_current_modes():
            return collective(out, ranked, group=group)

    cp_module._REDUCE_SCATTER = reduce_scatter
    layout = cp.layout(lengths, owners)
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    spans = list(zip(starts, starts[1:])) if len(lengths) > 1 else None
    cache, keys, peaks = PrefixKVCache(), [], []
    for layer in range(LAYERS):
        key, value = (torch.randn(layout.local_len, 1, HEADS, DIM, requires_grad=True)
                      for _ in range(2))
        keys += [key, value]
        to_local = cp.gradient_to_local(layout, key.device, spans=spans)

        def measured(grads, shapes, to_local=to_local):
            with LiveBytes([g for g in grads if g is not None]) as live:
                out = to_local(grads, shapes)
            peaks.append(live.peak)
            return out

        graph_k, graph_v = key * 1, value * 1  # a packed row's members share its local graph
        for group, n in enumerate(lengths):
            whole = [torch.zeros(n, HEADS, DIM) for _ in range(2)]
            cache.store(group, layer, graph_k, graph_v, full=whole, to_local=measured)
    for group, n in enumerate(lengths):
        mine = _grads_of(dist.get_rank(), n, seed=100 + 10 * group)
        for layer in range(LAYERS):
            k, v = cache.read(group, layer)
            ((k * mine[2 * layer]).sum() + (v * mine[2 * layer + 1]).sum()).backward()
    del mine, k, v
    cache.backward(0, packed=[(g, 0) for g in range(1, len(lengths))])
    return {"peak": peaks[0], "grads": [t.grad for t in keys], "full_len": layout.full_len,
            "local_index": layout.local_index(), "real_index": layout.real_index(),
            "send_rows": layout.all_index().numel() if spans else layout.full_len}


@pytest.mark.parametrize("lengths,owners", [((PREFIX,), ()), ((20, 17), (0, 1)),
                                            ((20, 17), ())], ids=["one", "packed_whole",
                                                                  "packed_split"])
def test_cp_phase_c_reduce_scatter_holds_at_most_two_copies_and_is_exact(lengths, owners):
    """Also a packed row's members ([Note: packed CP prefix rows]): whole prefixes reduce to
    their owner, split ones to their zigzag rows, through one buffer as for one prefix."""
    results = run_distributed(_phase_c_rank, world_size=2, timeout_s=TIMEOUT_S,
                              kwargs={"lengths": lengths, "owners": owners})
    summed = []
    for t in range(2 * LAYERS):
        parts = [_grads_of(0, n, 100 + 10 * g)[t] + _grads_of(1, n, 100 + 10 * g)[t]
                 for g, n in enumerate(lengths)]
        summed.append(torch.cat(parts))
    accumulators = 2 * LAYERS * sum(lengths) * HEADS * DIM * 4  # one copy of the fp32 gK/gV
    for r in results:
        send_buffer = accumulators * r["send_rows"] // sum(lengths)
        # accumulators + the rank-major send buffer, + row indices (int64, built once per step:
        # here a few per row); the old path (padded rows, their concatenation, the rank-major
        # copy, the result) peaked at 4.8 copies: 181568 bytes
        indices = 16 * r["send_rows"] * 8
        assert r["peak"] <= accumulators + send_buffer + indices, (r["peak"], accumulators)
        for got, whole in zip(r["grads"], summed):
            padded = torch.zeros(r["full_len"], HEADS, DIM)
            padded[r["real_index"]] = whole
            assert torch.equal(got[:, 0], padded[r["local_index"]])
