"""Attention sinks (softmax_type='learnable') and sliding windows (window_size=(W, 0)) in the
two-part shared-prefix attention, against a float64 reference written here from the definitions
(HF gpt-oss's form: the sink logit concatenated to each query's scores and dropped after the
softmax; a token at position p sees positions p - W ... p). Shares no code with
prefix_schedule.attention."""
import math

import pytest
import torch

from prefix_schedule.attention import PackedMeta, causal_attention, shared_prefix_attention

BACKENDS = ("torch", "math")


def reference(q, k, v, prefix_k, prefix_v, lengths, slots, scale, sink=None, window=None):
    """Per suffix: keys [prefix; suffix], positions 0..P+n-1, explicit loops over queries."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n, slot in zip(lengths, slots):
        keys = torch.cat([prefix_k[slot].double(), k[start:start + n]]).repeat_interleave(rep, 1)
        vals = torch.cat([prefix_v[slot].double(), v[start:start + n]]).repeat_interleave(rep, 1)
        p = prefix_k[slot].shape[0]
        for t in range(n):
            pos = p + t
            lo = 0 if window is None else max(0, pos - window)
            scores = torch.einsum("hd,khd->hk", q[start + t], keys[lo:pos + 1]) * scale
            if sink is not None:
                scores = torch.cat([scores, sink.double()[:, None]], dim=1)
            probs = torch.softmax(scores, dim=1)[:, :pos + 1 - lo]
            outs.append(torch.einsum("hk,khd->hd", probs, vals[lo:pos + 1]))
        start += n
    return torch.stack(outs)


def _inputs(lengths, prefix_lens, slots, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    q, k, v = mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d)
    pk = [mk(p, hkv, d) for p in prefix_lens]
    pv = [mk(p, hkv, d) for p in prefix_lens]
    sink = mk(hq)
    return q, k, v, pk, pv, sink


def _grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad((out.double() * w).sum(), tensors, allow_unused=True)


def _assert_close(ours, ref, tol):
    for a, b in zip(ours, ref):
        if a is None or b is None:  # an empty prefix is not in the reference's graph
            assert (a if a is not None else b).numel() == 0
            continue
        if a.numel() == 0:
            continue
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        err = (a.double() - b.double()).abs().max().item()
        assert err <= tol * max(1.0, b.abs().max().item()), err


CASES = [  # (suffix lengths, prefix lengths, slots, window)
    ([3, 1, 5], [7, 4], [0, 0, 1], None),
    ([1, 1, 1], [6, 0, 2], [0, 1, 2], None),
    ([3, 1, 5], [7, 4], [0, 0, 1], 2),     # window shorter than the prefixes and some suffixes
    ([1, 1, 1, 1], [9, 3], [0, 0, 1, 1], 4),  # 1-token suffixes
    ([4, 6], [3, 2], [0, 1], 20),          # window longer than prefix + suffix
    ([5, 2], [8, 0], [0, 1], 0),           # W = 0: each token sees itself only
    ([9, 3], [2, 5], [0, 1], 3),           # suffix longer than the window
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_sink", [True, False])
@pytest.mark.parametrize("lengths, prefix_lens, slots, window", CASES)
def test_float64_matches_reference(backend, with_sink, lengths, prefix_lens, slots, window):
    q, k, v, pk, pv, sink = _inputs(lengths, prefix_lens, slots)
    s = sink if with_sink else None
    meta = PackedMeta.from_lengths(lengths, slots)
    out = shared_prefix_attention(q, k, v, pk, pv, meta, scale=0.3, backend=backend, sink=s,
                                  window=window)
    ref = reference(q, k, v, pk, pv, lengths, slots, 0.3, sink=s, window=window)
    _assert_close([out], [ref], 1e-12)
    tensors = [q, k, v, *pk, *pv] + ([sink] if with_sink else [])
    _assert_close(_grads(out, tensors), _grads(ref, tensors), 1e-12)


@pytest.mark.parametrize("window", [None, 2, 5])
def test_float32_gradients_within_1e5(window):
    lengths, prefix_lens, slots = [6, 1, 9], [12, 5], [0, 0, 1]
    q, k, v, pk, pv, sink = _inputs(lengths, prefix_lens, slots, dtype=torch.float32, d=16)
    meta = PackedMeta.from_lengths(lengths, slots)
    out = shared_prefix_attention(q, k, v, pk, pv, meta, backend="torch", sink=sink, window=window)
    ref = reference(q, k, v, pk, pv, lengths, slots, 0.25, sink=sink, window=window)
    tensors = [q, k, v, *pk, *pv, sink]
    _assert_close([out], [ref], 1e-5)
    _assert_close(_grads(out, tensors), _grads(ref, tensors), 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 3])
def test_sink_gradient_accumulates_over_prefix_and_suffix(backend, window):
    """Phase A's causal prefix attention and Phase B's suffix attention both use the sink: the
    summed gradient equals the full sequence's (reference over the whole sequences)."""
    p, lengths = 7, [2, 4]
    q, k, v, pk, pv, sink = _inputs(lengths, [p], [0, 0], seed=3)
    qp, kp, vp = (torch.randn(p, h, 8, dtype=torch.float64, requires_grad=True)
                  for h in (4, 2, 2))
    prefix_out = causal_attention(qp, kp, vp, scale=0.5, backend=backend, sink=sink, window=window)
    meta = PackedMeta.from_lengths(lengths, [0, 0])
    suffix_out = shared_prefix_attention(q, k, v, [kp], [vp], meta, scale=0.5, backend=backend,
                                         sink=sink, window=window)
    empty = kp.new_zeros((0, 2, 8))
    ref_prefix = reference(qp, kp, vp, [empty], [empty], [p], [0], 0.5, sink=sink, window=window)
    ref_suffix = reference(q, k, v, [kp], [vp], lengths, [0, 0], 0.5, sink=sink, window=window)
    tensors = [sink, qp, kp, vp, q, k, v]
    w1, w2 = torch.randn(prefix_out.shape, dtype=torch.float64), torch.randn(suffix_out.shape,
                                                                            dtype=torch.float64)
    ours = torch.autograd.grad((prefix_out * w1).sum() + (suffix_out * w2).sum(), tensors)
    ref = torch.autograd.grad((ref_prefix * w1).sum() + (ref_suffix * w2).sum(), tensors)
    _assert_close(ours, ref, 1e-12)


def test_windowed_prefix_rows_out_of_reach_get_zero_gradient():
    """Only the last W rows of a prefix are read under a window: earlier rows' gK/gV are 0."""
    q, k, v, pk, pv, sink = _inputs([2, 1], [10], [0, 0])
    out = shared_prefix_attention(q, k, v, pk, pv, PackedMeta.from_lengths([2, 1], [0, 0]),
                                  backend="torch", window=3)
    gk, gv = _grads(out, [pk[0], pv[0]])
    assert gk[:7].abs().max() == 0 and gv[:7].abs().max() == 0
    assert gk[7:].abs().max() > 0 and gv[7:].abs().max() > 0


def test_bad_sink_and_window_are_refused_before_compute():
    q, k, v, pk, pv, sink = _inputs([2], [3], [0])
    meta = PackedMeta.from_lengths([2], [0])
    with pytest.raises(ValueError, match="one logit per query head"):
        shared_prefix_attention(q, k, v, pk, pv, meta, sink=sink[:2])
    with pytest.raises(ValueError, match="window must be None or a python int"):
        shared_prefix_attention(q, k, v, pk, pv, meta, window=-1)
    with pytest.raises(ValueError, match="copy mode"):
        shared_prefix_attention(q, k, v, pk, pv, meta, mode="copy", sink=sink)


def test_backends_without_window_kernels_refuse_windows():
    from prefix_schedule.attention.backends import get_backend

    assert not get_backend("flash_attn").supports_window
    assert not get_backend("transformer_engine").supports_window
    assert get_backend("torch").supports_window and get_backend("math").supports_window
