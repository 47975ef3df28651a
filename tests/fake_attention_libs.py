"""Fake flash-attn (and, via fake_transformer_engine, Transformer Engine) modules for CPU tests of
the kernel backends, version by version.

Each fake has the real library's module paths, and for the version asked for, its functions'
exact parameter lists (names, order, which have defaults), return conventions and argument
checks, as read in the library's source at that version's git tag (the rows of
docs/KERNEL_VERSIONS.md; flash-attn below, TE in fake_transformer_engine.py). A call with a
keyword the version does not have, or without an argument the version requires, raises
TypeError as Python raises it for the real `def` (the signature is bound with inspect); pybind
functions take positional arguments only. Values are computed with float64 torch math. Each
call checks what the real kernel relies on (dtypes, int32 cu_seqlens on the device, python-int
max lengths, THD shapes, LSE layout, window/mask agreement) and is recorded in `calls`.
Deliberate behaviours: flash-attn gives an entry without keys out 0 and LSE +inf; TE gives it
NaN (unspecified for cuDNN); both backwards WRITE dq/dk/dv. float64 inputs are accepted (the
real kernels take fp16/bf16 only) so tests can compare at 1e-12; the LSE is float32 otherwise.
"""
from __future__ import annotations

import inspect
import math
import sys
from types import ModuleType

import torch

HALF = (torch.float16, torch.bfloat16, torch.float64)


def _check_cu(cu, x, total, max_len, what):
    assert isinstance(cu, torch.Tensor) and cu.dtype == torch.int32 and cu.dim() == 1, what
    assert cu.is_contiguous() and cu.device == x.device, what
    assert isinstance(max_len, int) and not isinstance(max_len, bool), f"{what}: max_seqlen must be a python int"
    cu = cu.tolist()
    assert cu[0] == 0 and cu[-1] == total, (what, cu, total)
    assert max_len >= max(b - a for a, b in zip(cu, cu[1:])), (what, cu, max_len)
    return cu


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense_varlen(q, k, v, cu_q, cu_k, scale, mask, empty_lse):
    """Per entry attention in float64 with autograd; mask in {"none", "top_left", "bottom_right"}.
    Returns out [Tq, Hq, D] in q's dtype and LSE [Hq, Tq]."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        qq = q[a:b].double()
        if d == c:
            outs.append(torch.zeros_like(qq))
            lses.append(torch.full((q.shape[1], b - a), empty_lse, dtype=torch.float64))
            continue
        s = torch.einsum("qhd,khd->hqk", qq, k[c:d].double().repeat_interleave(rep, 1)) * scale
        if mask != "none":
            shift = (d - c) - (b - a) if mask == "bottom_right" else 0
            keep = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + shift
            s = s.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]),
                                 v[c:d].double().repeat_interleave(rep, 1)))
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1).to(_lse_dtype(q.dtype))


def dense_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, scale, mask):
    """Gradients from the GIVEN out and LSE (what a flash/cuDNN backward does)."""
    rep = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros((k.shape[0], q.shape[1], k.shape[2]), dtype=torch.float64)
    dv = torch.zeros((v.shape[0], q.shape[1], v.shape[2]), dtype=torch.float64)
    for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if a == b or c == d:
            continue
        qq, g, o = q[a:b].double(), dout[a:b].double(), out[a:b].double()
        kk, vv = (x[c:d].double().repeat_interleave(rep, 1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        p = torch.exp(s - lse[:, a:b, None].double())
        if mask != "none":
            shift = (d - c) - (b - a) if mask == "bottom_right" else 0
            p = p * (torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + shift)
        dv[c:d] = torch.einsum("hqk,qhd->khd", p, g)
        ds = p * (torch.einsum("qhd,khd->hqk", g, vv) - (g * o).sum(-1).T[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk[c:d] = torch.einsum("hqk,qhd->khd", ds, qq) * scale
    fold = lambda x: x.unflatten(1, (k.shape[1], rep)).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _install(monkeypatch, modules: dict) -> None:
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)


REQUIRED = inspect.Parameter.empty


def versioned(params, impl, name):
    """A function with exactly `params` ([(name, default or REQUIRED)], in order) that binds its
    arguments as Python would (TypeError on an unknown keyword or a missing argument) and calls
    impl(**all arguments with defaults applied)."""
    sig = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                             for n, d in params])

    def fn(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return impl(**bound.arguments)

    fn.__signature__, fn.__name__ = sig, name
    return fn


def vt(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.replace(".post", ".").split(".")[:3])


# ---------------------------------------------------------------- flash-attn
# flash_attn/flash_attn_interface.py at tags v2.6.0 ... v2.8.3.post1 (parameter lists as printed
# by ast from each tag; "R" = no default).
R = REQUIRED
_FA_HEAD = [(n, R) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                             "max_seqlen_k", "dropout_p", "softmax_scale", "causal")]
_FA_BWD_HEAD = [(n, R) for n in ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv",
                                 "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                 "dropout_p", "softmax_scale", "causal")]
FLASH_VERSIONS = ("2.6.0.post1", "2.6.1", "2.6.3", "2.7.0", "2.7.4.post1", "2.8.3")


def flash_signatures(version: str):
    """(forward params, backward params) of _flash_attn_varlen_forward/_backward."""
    v = vt(version)
    if v < (2, 6, 1):  # 2.6.0, 2.6.0.post1: nothing after `causal` has a default
        fwd = _FA_HEAD + [(n, R) for n in ("window_size", "softcap", "alibi_slopes",
                                           "return_softmax", "block_table")]
    elif v < (2, 6, 2):
        fwd = _FA_HEAD + [(n, R) for n in ("window_size", "softcap", "alibi_slopes", "return_softmax")] \
            + [("block_table", None), ("leftpad_k", None)]
    elif v < (2, 7):
        fwd = _FA_HEAD + [("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                          ("return_softmax", False), ("block_table", None), ("leftpad_k", None),
                          ("seqused_k", None)]
    else:
        fwd = _FA_HEAD + [("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
                          ("alibi_slopes", None), ("return_softmax", False), ("block_table", None),
                          ("leftpad_k", None), ("seqused_k", None)]
    window = ["window_size"] if v < (2, 7) else ["window_size_left", "window_size_right"]
    bwd = _FA_BWD_HEAD + [(n, R) for n in window + ["softcap", "alibi_slopes", "deterministic"]] \
        + [("rng_state", None)]
    if v >= (2, 7, 3):
        fwd, bwd = fwd + [("zero_tensors", False)], bwd + [("zero_tensors", False)]
    return fwd, bwd


def _flash_window(causal, left, right):
    """flash_api.cpp mha_varlen_fwd/bwd: `if (is_causal) window_size_right = 0;` -- anything
    else than no window would be a sliding window, which the backends never ask for."""
    assert left == -1 and (right in (-1, 0) if causal else right == -1), ("sliding window", left, right)


def _custom_op_types(kw):
    """2.7+: torch custom ops check their schema (python ints / floats / bools)."""
    for name in ("max_seqlen_q", "max_seqlen_k", "window_size_left", "window_size_right"):
        assert type(kw[name]) is int, (name, kw[name])
    for name in ("dropout_p", "softmax_scale", "softcap"):
        assert type(kw[name]) is float, (name, kw[name])
    assert type(kw["causal"]) is bool


def install_flash_attn(monkeypatch, version: str = "2.7.4.post1"):
    """flash_attn + flash_attn.flash_attn_interface of `version`; returns the interface module
    (with `calls`)."""
    pkg, iface = ModuleType("flash_attn"), ModuleType("flash_attn.flash_attn_interface")
    pkg.__version__ = version
    iface.calls = []
    split = vt(version) >= (2, 7)
    fwd_params, bwd_params = flash_signatures(version)

    def window_of(kw):
        return (kw["window_size_left"], kw["window_size_right"]) if split else tuple(kw["window_size"])

    def forward(**kw):
        q, k, v = kw["q"], kw["k"], kw["v"]
        if split:
            _custom_op_types(kw)
        assert q.dtype in HALF and k.dtype == v.dtype == q.dtype and kw["dropout_p"] == 0.0
        assert kw["softcap"] == 0.0 and kw["alibi_slopes"] is None and not kw["return_softmax"]
        assert kw["block_table"] is None, "paged KV has no backward"
        assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, "head_size"
        # flash_api.cpp mha_varlen_fwd (2.x): q, k and v all `... x head_size` (one head dim)
        assert k.shape[-1] == v.shape[-1] == q.shape[-1], "q, k, v head_size differ"
        _flash_window(kw["causal"], *window_of(kw))
        assert all(x.stride(-1) == 1 for x in (q, k, v)) and q.shape[1] % k.shape[1] == 0
        cu_q = _check_cu(kw["cu_seqlens_q"], q, q.shape[0], kw["max_seqlen_q"], "cu_seqlens_q")
        cu_k = _check_cu(kw["cu_seqlens_k"], q, k.shape[0], kw["max_seqlen_k"], "cu_seqlens_k")
        iface.calls.append(dict(fn="fwd", cu_q=cu_q, cu_k=cu_k, max_q=kw["max_seqlen_q"],
                                max_k=kw["max_seqlen_k"], causal=kw["causal"], window=window_of(kw),
                                empty=sum(c == d for c, d in zip(cu_k, cu_k[1:]))))
        # causal with seqlen_q != seqlen_k is bottom-right aligned since flash-attn 2.1
        out, lse = dense_varlen(q, k, v, cu_q, cu_k, kw["softmax_scale"],
                                "bottom_right" if kw["causal"] else "none", math.inf)
        rng = torch.tensor([11, 0], dtype=torch.int64)
        if split:
            return out, lse, torch.empty(0), rng
        # out == out_padded when head_dim % 8 == 0; NaN here pins the index TE's CP code reads
        return torch.full_like(out, math.nan), q, k, v, out, lse, torch.empty(0), rng

    def backward(**kw):
        dout, q, k, v, out, lse = (kw[n] for n in ("dout", "q", "k", "v", "out", "softmax_lse"))
        dq, dk, dv = kw["dq"], kw["dk"], kw["dv"]
        if split:
            _custom_op_types(kw)
        assert all(x.dtype == q.dtype for x in (dout, out, dq, dk, dv)) and kw["dropout_p"] == 0.0
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
        assert lse.dtype == _lse_dtype(q.dtype) and kw["softcap"] == 0.0 and kw["alibi_slopes"] is None
        assert kw["rng_state"] is None or kw["rng_state"].tolist() == [11, 0]
        _flash_window(kw["causal"], *window_of(kw))
        cu_q = _check_cu(kw["cu_seqlens_q"], q, q.shape[0], kw["max_seqlen_q"], "cu_seqlens_q")
        cu_k = _check_cu(kw["cu_seqlens_k"], q, k.shape[0], kw["max_seqlen_k"], "cu_seqlens_k")
        iface.calls.append(dict(fn="bwd", cu_q=cu_q, cu_k=cu_k, max_q=kw["max_seqlen_q"],
                                max_k=kw["max_seqlen_k"], causal=kw["causal"], window=window_of(kw)))
        grads = dense_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, kw["softmax_scale"],
                                 "bottom_right" if kw["causal"] else "none")
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)  # written, not accumulated (flash_api.cpp mha_varlen_bwd)
        softmax_d = torch.empty(0)
        return softmax_d if split else (dq, dk, dv, softmax_d)

    def varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        cu_q = _check_cu(cu_seqlens_q, q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        cu_k = _check_cu(cu_seqlens_k, q, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        iface.calls.append(dict(fn="func", cu_q=cu_q, cu_k=cu_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                                causal=causal))
        return dense_varlen(q, k, v, cu_q, cu_k, softmax_scale, "bottom_right" if causal else "none",
                            math.inf)[0]

    iface._flash_attn_varlen_forward = versioned(fwd_params, forward, "_flash_attn_varlen_forward")
    iface._flash_attn_varlen_backward = versioned(bwd_params, backward, "_flash_attn_varlen_backward")
    iface.flash_attn_varlen_func = varlen_func  # unchanged 2.6.0 - 2.8.3.post1
    _install(monkeypatch, {"flash_attn": pkg, "flash_attn.flash_attn_interface": iface})
    return iface


def install_transformer_engine(monkeypatch, version: str = "2.12.0", **kwargs):
    """See fake_transformer_engine.install."""
    import fake_transformer_engine

    return fake_transformer_engine.install(monkeypatch, version, **kwargs)
