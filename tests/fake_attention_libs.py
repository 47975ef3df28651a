"""Fake flash-attn and Transformer Engine modules for CPU tests of the kernel backends.

They have the real libraries' module paths, function signatures, argument layouts and return
conventions (flash-attn 2.6 and 2.7+ private varlen pair and flash_attn_varlen_func; TE 2.x and
latest cpp_extensions.fused_attn_fwd/bwd and DotProductAttention; see the backends' docstrings
for the upstream files), computed with float64 torch math. Each call checks what the real
kernel relies on (dtypes, int32 cu_seqlens on the device, python-int max lengths, THD shapes,
LSE layout) and is recorded in `calls`. Deliberate behaviours: flash-attn gives an entry without
keys out 0 and LSE +inf; the TE fake gives it NaN (unspecified for cuDNN); both backwards WRITE
dq/dk/dv. float64 inputs are accepted (the real kernels take fp16/bf16 only) so tests can
compare at 1e-12; the LSE is float32 otherwise.
"""
from __future__ import annotations

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
        if parent:
            setattr(modules[parent], child, module)


def install_flash_attn(monkeypatch, version: str = "2.7.4"):
    """flash_attn + flash_attn.flash_attn_interface; returns the interface module (with `calls`)."""
    pkg, iface = ModuleType("flash_attn"), ModuleType("flash_attn.flash_attn_interface")
    pkg.__version__ = version
    iface.calls = []
    split_window = tuple(int(x) for x in version.split(".")[:2]) >= (2, 7)

    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window, softcap, alibi_slopes, return_softmax):
        assert q.dtype in HALF and k.dtype == v.dtype == q.dtype and dropout_p == 0.0
        assert window == (-1, -1) and softcap == 0.0 and alibi_slopes is None and not return_softmax
        assert all(x.stride(-1) == 1 for x in (q, k, v)) and q.shape[1] % k.shape[1] == 0
        cu_q = _check_cu(cu_seqlens_q, q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        cu_k = _check_cu(cu_seqlens_k, q, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        iface.calls.append(dict(fn="fwd", cu_q=cu_q, cu_k=cu_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                                causal=causal, empty=sum(c == d for c, d in zip(cu_k, cu_k[1:]))))
        # causal with seqlen_q != seqlen_k is bottom-right aligned since flash-attn 2.1
        out, lse = dense_varlen(q, k, v, cu_q, cu_k, softmax_scale, "bottom_right" if causal else "none",
                                math.inf)
        return out, lse.to(torch.float32 if q.dtype != torch.float64 else lse.dtype), torch.empty(0), \
            torch.zeros(2, dtype=torch.int64)

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                 deterministic, rng_state):
        assert all(x.dtype == q.dtype for x in (dout, out, dq, dk, dv)) and dropout_p == 0.0
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert softmax_lse.shape == (q.shape[1], q.shape[0]) and softmax_lse.is_contiguous()
        assert softmax_lse.dtype == _lse_dtype(q.dtype) and window == (-1, -1)
        cu_q = _check_cu(cu_seqlens_q, q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        cu_k = _check_cu(cu_seqlens_k, q, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        iface.calls.append(dict(fn="bwd", cu_q=cu_q, cu_k=cu_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                                causal=causal))
        grads = dense_varlen_bwd(dout, q, k, v, out, softmax_lse, cu_q, cu_k, softmax_scale,
                                 "bottom_right" if causal else "none")
        for buf, grad in zip((dq, dk, dv), grads):
            buf.copy_(grad)  # written, not accumulated (flash_api.cpp mha_varlen_bwd)
        return torch.empty(0)

    if split_window:
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       dropout_p, softmax_scale, causal, window_size_left=-1,
                                       window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                       return_softmax=False, block_table=None, leftpad_k=None,
                                       seqused_k=None):
            return forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                           softmax_scale, causal, (window_size_left, window_size_right), softcap,
                           alibi_slopes, return_softmax)

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        softmax_scale, causal, window_size_left, window_size_right,
                                        softcap, alibi_slopes, deterministic, rng_state=None):
            return backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                            (window_size_left, window_size_right), softcap, alibi_slopes,
                            deterministic, rng_state)
    else:  # 2.6: window_size tuple, 8 outputs (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       dropout_p, softmax_scale, causal, window_size=(-1, -1),
                                       softcap=0.0, alibi_slopes=None, return_softmax=False,
                                       block_table=None, leftpad_k=None, seqused_k=None):
            out, lse, s_dmask, rng = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, dropout_p, softmax_scale, causal,
                                             tuple(window_size), softcap, alibi_slopes, return_softmax)
            # out == out_padded when head_dim % 8 == 0; NaN here pins the index TE's CP code reads
            return torch.full_like(out, math.nan), q, k, v, out, lse, s_dmask, rng

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, rng_state=None):
            backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, tuple(window_size),
                     softcap, alibi_slopes, deterministic, rng_state)
            return dq, dk, dv, torch.empty(0)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False,
                               return_attn_probs=False, block_table=None):
        cu_q = _check_cu(cu_seqlens_q, q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
        cu_k = _check_cu(cu_seqlens_k, q, k.shape[0], max_seqlen_k, "cu_seqlens_k")
        iface.calls.append(dict(fn="func", cu_q=cu_q, cu_k=cu_k, max_q=max_seqlen_q, max_k=max_seqlen_k,
                                causal=causal))
        return dense_varlen(q, k, v, cu_q, cu_k, softmax_scale, "bottom_right" if causal else "none",
                            math.inf)[0]

    iface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    iface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    iface.flash_attn_varlen_func = flash_attn_varlen_func
    _install(monkeypatch, {"flash_attn": pkg, "flash_attn.flash_attn_interface": iface})
    return iface


_TE_MASKS = {"padding": "none", "padding_causal": "top_left", "padding_causal_bottom_right": "bottom_right"}


def install_transformer_engine(monkeypatch, flavor: str = "2.x", cudnn=(9, 8, 0), packed_stats=True):
    """transformer_engine(.pytorch(.cpp_extensions.fused_attn, .constants, .utils)); flavor "2.x"
    (bwd takes dqkv_dtype) or "latest" (o_format/do_format/dqkv_layout, no dqkv_dtype); softmax
    stats packed [t, h, 1] (cuDNN >= 9.6) or per sequence [b, h, max_seqlen_q, 1].
    Returns the fused_attn module (with `calls`)."""
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions",
             "transformer_engine.pytorch.cpp_extensions.fused_attn", "transformer_engine.pytorch.constants",
             "transformer_engine.pytorch.utils"]
    mods = {name: ModuleType(name) for name in names}
    te, fa = mods["transformer_engine"], mods["transformer_engine.pytorch.cpp_extensions.fused_attn"]
    te.__version__ = "2.4.0" if flavor == "2.x" else "2.12.0"
    te_dtype = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float64: "kFloat64(fake)"}
    mods["transformer_engine.pytorch.constants"].TE_DType = te_dtype
    mods["transformer_engine.pytorch.utils"].get_cudnn_version = lambda: cudnn
    fa.FusedAttnBackend = {"F16_max512_seqlen": 0, "F16_arbitrary_seqlen": 1, "FP8": 2, "No_Backend": 3}
    fa.calls = []

    def check(kw, q, k, v):
        assert kw["qkv_layout"] == "thd_thd_thd" and kw["fused_attention_backend"] == 1
        assert kw["fake_dtype"] == q.dtype and q.dtype in HALF and k.dtype == v.dtype == q.dtype
        assert kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
        assert all(x.is_contiguous() for x in (q, k, v)) and q.shape[1] % k.shape[1] == 0
        cu_q = _check_cu(kw["cu_seqlens_q"], q, q.shape[0], kw["max_seqlen_q"], "cu_seqlens_q")
        cu_k = _check_cu(kw["cu_seqlens_kv"], q, k.shape[0], kw["max_seqlen_kv"], "cu_seqlens_kv")
        assert kw["cu_seqlens_q_padded"].tolist() == cu_q and kw["cu_seqlens_kv_padded"].tolist() == cu_k
        return cu_q, cu_k, _TE_MASKS[kw["attn_mask_type"]]

    def fwd(**kw):
        q, k, v = kw["q"], kw["k"], kw["v"]
        cu_q, cu_k, mask = check(kw, q, k, v)
        fa.calls.append(dict(fn="fwd", cu_q=cu_q, cu_k=cu_k, max_q=kw["max_seqlen_q"],
                             max_k=kw["max_seqlen_kv"], mask=kw["attn_mask_type"]))
        out, lse = dense_varlen(q, k, v, cu_q, cu_k, kw["attn_scale"], mask, math.nan)
        out[lse.isnan().T] = math.nan  # no keys: unspecified for cuDNN
        if packed_stats:
            stats = lse.T.unsqueeze(-1).contiguous()  # [t, h, 1]
        else:  # [b, h, max_seqlen_q, 1]; rows past a sequence's end hold garbage
            stats = lse.new_full((len(cu_q) - 1, q.shape[1], kw["max_seqlen_q"], 1), math.nan)
            for i, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
                stats[i, :, :b - a, 0] = lse[:, a:b]
        return out, [stats, torch.tensor([7, 0], dtype=torch.int64)]

    def bwd(**kw):
        q, k, v, o, d_o = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
        cu_q, cu_k, mask = check(kw, q, k, v)
        stats, rng_state = kw["aux_ctx_tensors"]
        assert stats.dtype == _lse_dtype(q.dtype) and stats.is_contiguous()
        assert rng_state.tolist() == [7, 0] and o.is_contiguous() and d_o.is_contiguous()
        if packed_stats:
            assert stats.shape == (q.shape[0], q.shape[1], 1)
            lse = stats.squeeze(-1).T
        else:
            assert stats.shape == (len(cu_q) - 1, q.shape[1], kw["max_seqlen_q"], 1)
            lse = torch.cat([stats[i, :, :b - a, 0] for i, (a, b) in enumerate(zip(cu_q, cu_q[1:]))], 1)
        fa.calls.append(dict(fn="bwd", cu_q=cu_q, cu_k=cu_k, mask=kw["attn_mask_type"]))
        grads = dense_varlen_bwd(d_o, q, k, v, o, lse, cu_q, cu_k, kw["attn_scale"], mask)
        return [*grads, None]

    if flavor == "2.x":
        def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                           fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
                           cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
                           s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
                           fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                           attn_mask_type="padding", window_size=(-1, -1), rng_gen=None):
            return fwd(**locals())

        def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
                           fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
                           cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
                           dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
                           fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
                           attn_mask_type="padding", window_size=(-1, -1), deterministic=False):
            assert dqkv_dtype == te_dtype[q.dtype]
            return bwd(**locals())
    else:
        def fused_attn_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                           fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
                           cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None,
                           s_quantizer=None, o_quantizer=None, attn_scale=None, dropout=0.0,
                           fast_zero_fill=True, qkv_layout="sbh3d", o_format="sbhd",
                           qkv_scale_inv_format=None, attn_bias_type="no_bias", attn_mask_type="padding",
                           softmax_type="vanilla", window_size=(-1, -1), bottom_right_diagonal=None,
                           rng_gen=None, softmax_offset=None, return_max_logit=False, cuda_graph=False):
            assert o_format == "thd"
            return fwd(**locals())

        def fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
                           fake_dtype, aux_ctx_tensors, fused_attention_backend, cu_seqlens_q_padded=None,
                           cu_seqlens_kv_padded=None, s_quantizer=None, dp_quantizer=None,
                           dqkv_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
                           qkv_layout="sbh3d", o_format="sbhd", do_format="sbhd", dqkv_layout="sbh3d",
                           qkv_scale_inv_format=None, do_scale_inv_format=None, attn_bias_type="no_bias",
                           attn_mask_type="padding", softmax_type="vanilla", window_size=(-1, -1),
                           bottom_right_diagonal=None, deterministic=False, cuda_graph=False):
            assert o_format == do_format == "thd" and dqkv_layout == "thd_thd_thd"
            return bwd(**locals())

    class DotProductAttention(torch.nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", window_size=None, sequence_parallel=False,
                     tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                     attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                     cp_comm_type="p2p", softmax_scale=None):
            super().__init__()
            self.heads, self.kv_heads, self.scale = num_attention_heads, num_gqa_groups, softmax_scale
            assert attention_dropout == 0.0 and qkv_format == "thd"

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                    cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                    cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None,
                    window_size=None):
            q, k, v = query_layer, key_layer, value_layer
            assert (q.shape[1], k.shape[1]) == (self.heads, self.kv_heads) and qkv_format == "thd"
            cu_q = _check_cu(cu_seqlens_q, q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
            cu_k = _check_cu(cu_seqlens_kv, q, k.shape[0], max_seqlen_kv, "cu_seqlens_kv")
            fa.calls.append(dict(fn="dpa", cu_q=cu_q, cu_k=cu_k, mask=attn_mask_type))
            out = dense_varlen(q, k, v, cu_q, cu_k, self.scale, _TE_MASKS[attn_mask_type], math.nan)[0]
            return out.flatten(1)  # THD output is [t, h * d]

    fa.fused_attn_fwd, fa.fused_attn_bwd = fused_attn_fwd, fused_attn_bwd
    mods["transformer_engine.pytorch"].DotProductAttention = DotProductAttention
    _install(monkeypatch, mods)
    return fa
