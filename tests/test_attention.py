"""shared_prefix_attention against the float64 dense-mask oracle: output and every gradient
(q, k, v, prefix K/V), both modes, packed batches, GQA, empty prefixes, length-1 suffixes."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from prefix_schedule.attention import core as attn
from prefix_schedule.attention import (PackedMeta, causal_attention, reference_attention,
                                       shared_prefix_attention)

# lengths, slots, prefix lengths per slot
PACKED = ([3, 1, 4, 4, 1, 2], [0, 0, 1, 1, 1, 2], [5, 0, 3])       # 3 groups, P_g = 0, n = 1
TWO_GROUPS = ([5, 2, 6], [0, 0, 1], [7, 4])
ALL_ONES = ([1, 1, 1, 1], [0, 0, 1, 1], [2, 6])
CASES = {"packed3": PACKED, "two_groups": TWO_GROUPS, "all_len1": ALL_ONES}
HEADS = {"gqa": (8, 2), "mha": (4, 4)}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


def make_problem(seed, lengths, slots, prefix_lens, hq, hkv, dtype, head_dim=8, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    meta = PackedMeta.from_lengths(lengths, slots)

    def rand(*shape):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
        return x.requires_grad_(requires_grad)

    T = meta.total_len
    q, k, v = rand(T, hq, head_dim), rand(T, hkv, head_dim), rand(T, hkv, head_dim)
    prefix_k = [rand(p, hkv, head_dim) for p in prefix_lens]
    prefix_v = [rand(p, hkv, head_dim) for p in prefix_lens]
    grad_out = torch.randn(T, hq, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    return (q, k, v, prefix_k, prefix_v, meta), grad_out


def leaves(args):
    q, k, v, prefix_k, prefix_v, _ = args
    return [q, k, v, *prefix_k, *prefix_v]


def as_f64(args):
    """Fresh float64 leaves with the same values, for the oracle."""
    q, k, v, prefix_k, prefix_v, meta = args
    f = lambda x: x.detach().to(torch.float64).requires_grad_(x.requires_grad)  # noqa: E731
    return f(q), f(k), f(v), [f(x) for x in prefix_k], [f(x) for x in prefix_v], meta


def out_and_grads(fn, args, grad_out, num_leaves=None, **kw):
    out = fn(*args, **kw)
    grads = torch.autograd.grad(out, leaves(args)[:num_leaves], grad_out.to(out.dtype))
    return [out, *grads]


def assert_rel_close(actual, expected, tol, what="", floor=1e-3):
    """Relative max-abs error <= tol (exactness.md); NaN or inf never passes. The error is
    relative to max(max|expected|, floor): a tensor that is exactly 0 in real arithmetic (dq of a
    query with a single key) is held to tol * floor absolutely, not to 0."""
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert torch.isfinite(expected).all(), f"{what}: non-finite values in the reference"
    if expected.numel() == 0:
        return
    err = (actual.to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    ref = expected.to(torch.float64).abs().max().item()
    scale = max(ref, floor)
    assert err <= tol * scale, f"{what}: rel err {err / scale:.2e} > {tol:.0e}"


def check_against_oracle(args, grad_out, tol, **kw):
    got = out_and_grads(shared_prefix_attention, args, grad_out, **kw)
    oracle_kw = {key: val for key, val in kw.items() if key != "mode"}
    want = out_and_grads(reference_attention, as_f64(args), grad_out, **oracle_kw)
    names = ["out", "dq", "dk", "dv"] + [f"d_prefix[{i}]" for i in range(len(got) - 4)]
    for name, a, b in zip(names, got, want):
        assert_rel_close(a, b, tol, name)


@pytest.mark.parametrize("mode", ["two_part", "copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_oracle(mode, dtype, heads, case):
    seed = sorted(CASES).index(case) * 10 + sorted(HEADS).index(heads)
    args, grad_out = make_problem(seed, *CASES[case], *HEADS[heads], dtype)
    check_against_oracle(args, grad_out, TOL[dtype], mode=mode)


@st.composite
def layouts(draw):
    num_slots = draw(st.integers(1, 3))
    per_slot = [draw(st.integers(1, 3)) for _ in range(num_slots)]
    slots = [g for g, n in enumerate(per_slot) for _ in range(n)]
    lengths = [draw(st.integers(1, 5)) for _ in slots]
    prefix_lens = [draw(st.integers(0, 6)) for _ in range(num_slots)]
    heads = draw(st.sampled_from([(2, 1), (4, 2), (3, 3)]))
    return lengths, slots, prefix_lens, heads, draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(layouts())
def test_random_layouts_match_oracle(layout):
    lengths, slots, prefix_lens, (hq, hkv), seed = layout
    args, grad_out = make_problem(seed, lengths, slots, prefix_lens, hq, hkv, torch.float64, head_dim=4)
    check_against_oracle(args, grad_out, TOL[torch.float64])


def test_bf16_two_part_close_to_oracle():
    args, grad_out = make_problem(3, *PACKED, 8, 2, torch.bfloat16, head_dim=16)
    check_against_oracle(args, grad_out, TOL[torch.bfloat16])
    assert shared_prefix_attention(*args).dtype == torch.bfloat16


def test_math_kernels_match_oracle(monkeypatch):
    """The device-agnostic kernels (used off CPU) follow the same merged-LSE rule."""
    from prefix_schedule.attention import backends as attention_backends

    previous = attention_backends.get_default_backend()
    attention_backends.set_default_backend("math")
    try:
        args, grad_out = make_problem(4, *PACKED, 8, 2, torch.float64)
        check_against_oracle(args, grad_out, TOL[torch.float64])
    finally:
        attention_backends.set_default_backend(previous)


def test_merged_lse_backward_when_prefix_and_suffix_both_matter():
    """Long-ish prefix and suffix with comparable attention mass on each: a per-part backward
    with a part-local LSE or output would get dq, dk and prefix dK wrong here."""
    args, grad_out = make_problem(5, [6, 9], [0, 0], [8], 4, 2, torch.float64, head_dim=4)
    q, k, v, prefix_k, _, meta = as_f64(args)
    scores = torch.einsum("thd,khd->htk", q, torch.cat([prefix_k[0], k]).repeat_interleave(2, 1)) / 2
    probs = torch.softmax(scores.masked_fill(~attn._reference_mask(meta, [8], "cpu"), -math.inf), -1)
    prefix_mass = probs[..., :8].sum(-1)
    assert 0.2 < prefix_mass.mean().item() < 0.8  # both parts carry real weight
    check_against_oracle(args, grad_out, TOL[torch.float64])
    got = out_and_grads(shared_prefix_attention, args, grad_out)
    unmerged = torch.autograd.grad(  # dq of part S alone differs: the merge matters
        shared_prefix_attention(*args[:3], [x[:0] for x in args[3]], [x[:0] for x in args[4]], meta),
        args[0], grad_out)[0]
    assert (got[1] - unmerged).abs().max() > 0.1


@pytest.mark.parametrize("mode", ["two_part", "copy"])
def test_prefix_grads_accumulate_over_microbatches(mode):
    """Two microbatches read the same prefix leaves; autograd sums their gK/gV, which must equal
    the oracle on the concatenated problem (all suffixes in one row)."""
    dtype, hq, hkv, d = torch.float64, 4, 2, 8
    full, grad_out = make_problem(6, [3, 2, 4, 1, 2], [0, 0, 0, 1, 1], [6, 3], hq, hkv, dtype, d)
    q, k, v, prefix_k, prefix_v, meta = full
    total = 0
    for rows, seq_lens, slots, slot_ids in [((0, 5), [3, 2], [0, 0], [0]),
                                             ((5, 14), [4, 1, 2], [0, 1, 1], [0, 1])]:
        a, b = rows
        sub = PackedMeta.from_lengths(seq_lens, [slot_ids.index(s) for s in slots])
        out = shared_prefix_attention(q[a:b], k[a:b], v[a:b], [prefix_k[s] for s in slot_ids],
                                      [prefix_v[s] for s in slot_ids], sub, mode=mode)
        total = total + (out * grad_out[a:b]).sum()
    got = torch.autograd.grad(total, leaves(full))
    want = out_and_grads(reference_attention, as_f64(full), grad_out)[1:]
    for i, (a_, b_) in enumerate(zip(got, want)):
        assert_rel_close(a_, b_, TOL[dtype], f"grad {i}")


def test_no_grad_inputs_and_partial_requires_grad():
    args, grad_out = make_problem(7, *PACKED, 8, 2, torch.float32, requires_grad=False)
    want = reference_attention(*as_f64(args))
    for mode in ("two_part", "copy"):
        out = shared_prefix_attention(*args, mode=mode)
        assert not out.requires_grad
        assert_rel_close(out, want, TOL[torch.float32], mode)
    q, k, v, prefix_k, prefix_v, meta = args
    pk0 = prefix_k[0].clone().requires_grad_()
    out = shared_prefix_attention(q, k, v, [pk0, *prefix_k[1:]], prefix_v, meta)
    (g,) = torch.autograd.grad(out, pk0, grad_out)
    ref_args = list(as_f64(args))
    ref_args[3] = [x.requires_grad_(i == 0) for i, x in enumerate(ref_args[3])]
    (want_g,) = torch.autograd.grad(reference_attention(*ref_args), ref_args[3][0], grad_out.double())
    assert_rel_close(g, want_g, TOL[torch.float32], "prefix dK")


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_causal_attention_matches_oracle(heads):
    hq, hkv = HEADS[heads]
    args, grad_out = make_problem(8, [7], [0], [0], hq, hkv, torch.float32)
    got = out_and_grads(lambda q, k, v, *_: causal_attention(q, k, v), args, grad_out, num_leaves=3)
    want = out_and_grads(reference_attention, as_f64(args), grad_out, num_leaves=3)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert_rel_close(a, b, TOL[torch.float32], name)


def test_explicit_scale_is_used():
    args, grad_out = make_problem(9, *TWO_GROUPS, 4, 2, torch.float64)
    check_against_oracle(args, grad_out, TOL[torch.float64], scale=0.9)
    assert not torch.allclose(shared_prefix_attention(*args, scale=0.9), shared_prefix_attention(*args))


def test_meta_derived_fields():
    meta = PackedMeta.from_lengths([3, 1, 4, 4, 1, 2], [0, 0, 1, 1, 1, 2])
    assert meta.cu_seqlens == (0, 3, 4, 8, 12, 13, 15)
    assert (meta.num_seqs, meta.num_slots, meta.total_len, meta.max_seqlen) == (6, 3, 15, 4)
    assert meta.slot_ranges == ((0, 4), (4, 13), (13, 15))
    assert meta.equal_runs == ((0, 3, 1), (3, 1, 1), (4, 4, 2), (12, 1, 1), (13, 2, 1))
    assert PackedMeta(cu_seqlens=[0, 3, 4], seq_slot=[0, 0]) == PackedMeta.from_lengths([3, 1], [0, 0])


@pytest.mark.parametrize("cu, slots", [
    ((1, 3), (0,)),                 # does not start at 0
    ((0,), ()),                     # no sequence
    ((0, 3, 3), (0, 0)),            # empty suffix
    ((0, 3, 2), (0, 0)),            # decreasing
    ((0, 3, 5), (0,)),              # slot count mismatch
    ((0, 3, 5, 6), (0, 1, 0)),      # slot not contiguous
    ((0, 3, 5), (1, 1)),            # does not start at slot 0
    ((0, 3, 5), (0, 2)),            # skipped slot
    ((0, 3, 5), (1, 0)),            # decreasing slots
    ((0, 3.0), (0,)),               # float
    ((0, True), (0,)),              # bool
    (torch.tensor([0, 3]), (0,)),   # tensor: would sync
])
def test_bad_meta_raises(cu, slots):
    with pytest.raises(ValueError):
        PackedMeta(cu_seqlens=cu, seq_slot=slots)


def _bad_inputs():
    (q, k, v, pk, pv, meta), _ = make_problem(10, *TWO_GROUPS, 4, 2, torch.float32, requires_grad=False)
    yield "T mismatch", (q[:-1], k[:-1], v[:-1], pk, pv, meta), {}
    yield "heads not divisible", (q[:, :3], k, v, pk, pv, meta), {}
    yield "k/v shape", (q, k, v[:, :1], pk, pv, meta), {}
    yield "head_dim", (q, k[..., :4], v[..., :4], pk, pv, meta), {}
    yield "prefix count", (q, k, v, pk[:1], pv[:1], meta), {}
    yield "prefix heads", (q, k, v, [pk[0][:, :1], pk[1]], pv, meta), {}
    yield "prefix k/v mismatch", (q, k, v, pk, [pv[0][:2], pv[1]], meta), {}
    yield "dtype", (q, k.double(), v, pk, pv, meta), {}
    yield "prefix dtype", (q, k, v, [pk[0].half(), pk[1]], pv, meta), {}
    as_long = [x.long() for x in (q, k, v)]
    yield "int dtype", (*as_long, [x.long() for x in pk], [x.long() for x in pv], meta), {}
    yield "2-D q", (q[:, 0], k, v, pk, pv, meta), {}
    yield "mode", (q, k, v, pk, pv, meta), {"mode": "flash"}
    yield "scale", (q, k, v, pk, pv, meta), {"scale": -1.0}
    yield "meta type", (q, k, v, pk, pv, (0, 7, 9, 15)), {}


@pytest.mark.parametrize("fn", [shared_prefix_attention, reference_attention])
@pytest.mark.parametrize("what", [w for w, _, _ in _bad_inputs()])
def test_bad_inputs_raise(fn, what):
    args, kw = {w: (a, kw) for w, a, kw in _bad_inputs()}[what]
    if fn is reference_attention and "mode" in kw:
        pytest.skip("the oracle has no mode")
    with pytest.raises(ValueError):
        fn(*args, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_part_on_cuda_matches_oracle():
    """Off CPU the two-part path runs the device-agnostic kernels (same merged-LSE rule)."""
    args, grad_out = make_problem(11, *PACKED, 8, 2, torch.float32)
    q, k, v, prefix_k, prefix_v, meta = args
    cuda = lambda x: x.detach().cuda().requires_grad_()  # noqa: E731
    dev_args = (cuda(q), cuda(k), cuda(v), [cuda(x) for x in prefix_k], [cuda(x) for x in prefix_v], meta)
    got = out_and_grads(shared_prefix_attention, dev_args, grad_out.cuda())
    want = out_and_grads(reference_attention, as_f64(args), grad_out)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a.cpu(), b, TOL[torch.float32], f"tensor {i}")


def test_causal_attention_bad_inputs_raise():
    x = torch.zeros(4, 2, 8)
    for q, k, v in [(x[:, :, 0], x, x), (x[:0], x[:0], x[:0]), (x, x[:3], x[:3]), (x, x.double(), x)]:
        with pytest.raises(ValueError):
            causal_attention(q, k, v)


@pytest.mark.parametrize("backend", ["torch", "math"])
@pytest.mark.parametrize("mode", ["two_part", "copy"])
def test_value_head_dim_narrower_than_query_key(backend, mode):
    """MLA ([Note: unequal V head dim]): V of 16 dims against Q/K of 24, an empty prefix slot
    included; output and every gradient against a float64 dense softmax written out here."""
    gen = torch.Generator().manual_seed(4)
    meta = PackedMeta.from_lengths([3, 1, 4], [0, 0, 1])

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k, v = leaf(8, 4, 24), leaf(8, 4, 24), leaf(8, 4, 16)
    pk, pv = [leaf(5, 4, 24), leaf(0, 4, 24)], [leaf(5, 4, 16), leaf(0, 4, 16)]
    out = shared_prefix_attention(q, k, v, pk, pv, meta, scale=0.3, backend=backend, mode=mode)
    rows = []
    for (a, b), slot in zip(zip(meta.cu_seqlens, meta.cu_seqlens[1:]), meta.seq_slot):
        keys, values = torch.cat([pk[slot], k[a:b]]), torch.cat([pv[slot], v[a:b]])
        scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * 0.3
        n, total = b - a, keys.shape[0]
        allowed = torch.arange(total)[None, :] <= torch.arange(n)[:, None] + total - n
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1)
        rows.append(torch.einsum("hqk,khd->qhd", probs, values))
    expected = torch.cat(rows)
    assert out.shape == (8, 4, 16) and torch.isfinite(out).all()
    assert (out - expected).abs().max() < 1e-12
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    inputs = (q, k, v, pk[0], pv[0])
    for got, want in zip(torch.autograd.grad(out, inputs, grad),
                         torch.autograd.grad(expected, inputs, grad)):
        assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-12
    wide = torch.zeros(8, 4, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="larger than the query/key head dim"):
        shared_prefix_attention(q, k, wide, [pk[0][:0], pk[0][:0]], [wide[:0], wide[:0]], meta)
