"""A fake Transformer Engine of a given version (2.2 - 2.19) for CPU tests of the TE backend.

Read at the NVIDIA/TransformerEngine tags (docs/KERNEL_VERSIONS.md has file and function per row):
- cpp_extensions/fused_attn.py fused_attn_fwd / fused_attn_bwd: the parameter lists below, per
  version (which keywords exist, which have no default);
- transformer_engine_torch.get_fused_attn_backend (csrc/extensions/attention.cu|.cpp, pybind11
  without argument names: positional only): its parameters per version, and a small model of
  nvte_get_fused_attn_backend (common/fused_attn/fused_attn.cpp) for the THD case;
- fused_attn_f16_arbitrary_seqlen.cu fused_attn_arbitrary_seqlen_fwd: THD softmax stats of
  get_max_tokens(total_q) rows (common/fused_attn/utils.cu) in 2.2-2.10, total_q from 2.11;
  [batch, heads, max_seqlen_q, 1] with `packed_stats=False` (2.18 on sm120; cuDNN < 9.6);
- utils.py get_cudnn_version, constants.py TE_DType, the public DotProductAttention.
- the fused-backend enum: transformer_engine_torch.NVTE_Fused_Attn_Backend is a pybind11 enum
  without py::arithmetic (common/util/pybind_helper.h), so == / != against another type is
  strict (False / True); cpp_extensions/fused_attn.py `FusedAttnBackend` is a dict of those
  members in 2.2 - 2.18 and an IntEnum with `cast` in 2.19 (release_v2.19), whose
  fused_attn_fwd/bwd cast the backend they are given.
Rows of a bucketed stats buffer past total_q hold NaN; the backward insists on the row count its
own forward would have produced.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch

from fake_attention_libs import (HALF, R, _check_cu, _install, _lse_dtype, dense_varlen,
                                 dense_varlen_bwd, versioned, vt)

TE_VERSIONS = ("2.2.0", "2.4.0", "2.5.0", "2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.14.0",
               "2.15.0", "2.18.0", "2.19.0")


class PybindEnum:
    """A member of a pybind11 enum without py::arithmetic: strict comparisons, int() works."""

    def __init__(self, name: str, value: int):
        self.name, self.value = name, value

    def __int__(self):
        return self.value

    def __eq__(self, other):
        return type(other) is PybindEnum and other.value == self.value

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return f"<NVTE_Fused_Attn_Backend.NVTE_{self.name}: {self.value}>"


# common/include/transformer_engine/fused_attn.h NVTE_Fused_Attn_Backend (F16_max512_seqlen = 0
# existed before 2.18; THD layouts never got it)
_NVTE_BACKENDS = {n: PybindEnum(n, i) for n, i in (("No_Backend", -1), ("F16_max512_seqlen", 0),
                                                   ("F16_arbitrary_seqlen", 1), ("FP8", 2))}


def fused_attn_backend_enum(version: str):
    """cpp_extensions/fused_attn.py FusedAttnBackend: a dict of the pybind members (2.2 - 2.18),
    an IntEnum comparing equal to them by value with `cast` (2.19)."""
    if vt(version)[:2] < (2, 19):
        return dict(_NVTE_BACKENDS)
    import enum

    class FusedAttnBackend(enum.IntEnum):
        No_Backend = -1
        F16_arbitrary_seqlen = 1
        FP8 = 2

        @classmethod
        def cast(cls, backend):
            return backend if isinstance(backend, cls) else cls(int(backend))

        def __eq__(self, other):
            if isinstance(other, PybindEnum):
                return int(self) == int(other)
            return int.__eq__(self, other)

        def __ne__(self, other):
            result = self.__eq__(other)
            return result if result is NotImplemented else not result

        __hash__ = int.__hash__

    return FusedAttnBackend
_MASKS = {"padding": "none", "padding_causal": "top_left", "padding_causal_bottom_right": "bottom_right",
          "no_mask": "none", "causal": "top_left", "causal_bottom_right": "bottom_right"}

# fused_attn_fwd / fused_attn_bwd parameter lists by version ("R" = no default).
_FWD_HEAD = [(n, R) for n in ("is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q",
                              "cu_seqlens_kv", "q", "k", "v", "fake_dtype", "fused_attention_backend")]
_BWD_HEAD = [(n, R) for n in ("max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q",
                              "k", "v", "o", "d_o", "fake_dtype")]


def fused_attn_signatures(version: str):
    v = vt(version)[:2]
    fwd = _FWD_HEAD + [("attn_bias", None), ("cu_seqlens_q_padded", None), ("cu_seqlens_kv_padded", None),
                       ("page_table_k", None), ("page_table_v", None), ("s_quantizer", None),
                       ("o_quantizer", None), ("attn_scale", None), ("dropout", 0.0),
                       ("fast_zero_fill", True), ("qkv_layout", "sbh3d")]
    bwd = _BWD_HEAD + ([] if v >= (2, 15) else [("dqkv_dtype", R)]) + [
        ("aux_ctx_tensors", R), ("fused_attention_backend", R), ("cu_seqlens_q_padded", None),
        ("cu_seqlens_kv_padded", None), ("s_quantizer", None), ("dp_quantizer", None),
        ("dqkv_quantizer", None), ("attn_scale", None), ("dropout", 0.0), ("fast_zero_fill", True),
        ("qkv_layout", "sbh3d")]
    if v >= (2, 15):
        fwd += [("o_format", "sbhd"), ("qkv_scale_inv_format", None)]
        bwd += [("o_format", "sbhd"), ("do_format", "sbhd"), ("dqkv_layout", "sbh3d"),
                ("qkv_scale_inv_format", None), ("do_scale_inv_format", None)]
    tail = [("attn_bias_type", "no_bias"), ("attn_mask_type", "padding")]
    tail += [("softmax_type", "vanilla")] if v >= (2, 8) else []
    tail += [("window_size", (-1, -1))] + ([("bottom_right_diagonal", None)] if v >= (2, 12) else [])
    fwd += tail + [("rng_gen", None)] + ([("softmax_offset", None)] if v >= (2, 8) else []) \
        + ([("return_max_logit", False)] if v >= (2, 9) else []) + ([("cuda_graph", False)] if v >= (2, 10) else [])
    bwd += tail + [("deterministic", False)] + ([("cuda_graph", False)] if v >= (2, 10) else [])
    return fwd, bwd


def backend_args(version: str) -> list[str]:
    """transformer_engine_torch.get_fused_attn_backend's parameters (attention.cu/.cpp)."""
    v = vt(version)[:2]
    args = ["q_type", "kv_type", "qkv_layout", "bias_type", "mask_type", "dropout", "num_heads",
            "num_gqa_groups", "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v",
            "window_size_left", "window_size_right"]
    if v >= (2, 5):
        args.insert(0, "is_training")
    if v >= (2, 8):
        args.insert(args.index("mask_type") + 1, "softmax_type")
    return args + [n for since, n in (((2, 9), "return_max_logit"), ((2, 10), "cuda_graph"),
                                      ((2, 12), "deterministic")) if v >= since]


def get_max_tokens(num_tokens: int) -> int:
    """common/fused_attn/utils.cu get_max_tokens."""
    log2_t = math.ceil(math.log2(num_tokens))
    if log2_t <= 10:
        return 1024
    if log2_t <= 15:
        return 2 ** log2_t
    return (num_tokens + 32767) // 32768 * 32768


def install(monkeypatch, version: str = "2.12.0", cudnn=(9, 8, 0), packed_stats=True, sm=(9, 0)):
    """transformer_engine(.pytorch(.cpp_extensions.fused_attn, .constants, .utils)) and
    transformer_engine_torch of `version`. Returns the fused_attn module (with `calls`, and
    `refuse` -- a predicate over get_fused_attn_backend's named arguments that forces No_Backend)."""
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions",
             "transformer_engine.pytorch.cpp_extensions.fused_attn", "transformer_engine.pytorch.constants",
             "transformer_engine.pytorch.utils", "transformer_engine_torch"]
    mods = {name: ModuleType(name) for name in names}
    fa, tex = mods["transformer_engine.pytorch.cpp_extensions.fused_attn"], mods["transformer_engine_torch"]
    mods["transformer_engine"].__version__ = version
    te_dtype = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float64: "kFloat64(fake)",
                torch.float32: "kFloat32"}
    mods["transformer_engine.pytorch.constants"].TE_DType = te_dtype
    mods["transformer_engine.pytorch.utils"].get_cudnn_version = lambda: cudnn
    fa.QKVLayout = {n: "NVTE_" + n.upper() for n in ("sbh3d", "bshd_bshd_bshd", "thd_thd_thd", "t3hd")}
    fa.AttnBiasType = {n: "NVTE_" + n.upper() for n in ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")}
    fa.AttnMaskType = {n: "NVTE_" + n.upper() for n in _MASKS}
    if vt(version) >= (2, 8):
        fa.SoftmaxType = {n: "NVTE_" + n.upper() for n in ("vanilla", "off-by-one", "learnable")}
    fa.FusedAttnBackend = fused_attn_backend_enum(version)
    cast = getattr(fa.FusedAttnBackend, "cast", lambda backend: backend)  # 2.19: fwd/bwd cast
    fa.calls, fa.refuse = [], lambda args: False
    bucketed, io_formats = vt(version)[:2] < (2, 11), vt(version)[:2] >= (2, 15)
    arg_names = backend_args(version)

    def get_fused_attn_backend(*args):
        if len(args) != len(arg_names):  # pybind11: "incompatible function arguments"
            raise TypeError(f"get_fused_attn_backend(): incompatible function arguments: {len(args)} "
                            f"given, TE {version} takes {len(arg_names)} ({arg_names})")
        a = dict(zip(arg_names, args))
        assert a.get("is_training", True) is True and a["q_type"] == a["kv_type"]
        assert a["q_type"] in te_dtype.values() and a["qkv_layout"] in fa.QKVLayout.values()
        assert a["mask_type"] in fa.AttnMaskType.values() and a["bias_type"] in fa.AttnBiasType.values()
        assert "softmax_type" not in a or a["softmax_type"] == fa.SoftmaxType["vanilla"]
        assert all(type(a[n]) is int for n in arg_names[arg_names.index("num_heads"):][:8])
        fa.calls.append(dict(fn="get_backend", **a))
        mask = a["mask_type"].lower().replace("nvte_", "")
        ok = (a["q_type"] in ("kFloat16", "kBFloat16", "kFloat64(fake)") and sm >= (9, 0)
              and cudnn >= (9, 6, 0) and a["qkv_layout"] == fa.QKVLayout["thd_thd_thd"]
              and a["bias_type"] == fa.AttnBiasType["no_bias"] and a["dropout"] == 0.0
              and mask.startswith("padding") and a["head_dim_qk"] % 8 == 0 and a["head_dim_qk"] <= 128
              and a["window_size_left"] == -1 and a["window_size_right"] in (-1, 0)
              and not ("bottom_right" in mask and a["max_seqlen_q"] > a["max_seqlen_kv"]))
        return _NVTE_BACKENDS["F16_arbitrary_seqlen" if ok and not fa.refuse(a) else "No_Backend"]

    def check(kw, q, k, v):
        kw["fused_attention_backend"] = cast(kw["fused_attention_backend"])
        assert kw["fused_attention_backend"] != fa.FusedAttnBackend["No_Backend"], \
            "Fused attention does not support this input combination."
        assert kw["fused_attention_backend"] == fa.FusedAttnBackend["F16_arbitrary_seqlen"]
        assert kw["qkv_layout"] == "thd_thd_thd" and kw["attn_mask_type"] in fa.AttnMaskType
        assert kw["fake_dtype"] == q.dtype and q.dtype in HALF and k.dtype == v.dtype == q.dtype
        assert kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
        causal = "causal" in kw["attn_mask_type"]
        assert kw["window_size"][0] == -1 and kw["window_size"][1] in ((-1, 0) if causal else (-1,))
        assert all(x.is_contiguous() for x in (q, k, v)) and q.shape[1] % k.shape[1] == 0
        cu_q = _check_cu(kw["cu_seqlens_q"], q, q.shape[0], kw["max_seqlen_q"], "cu_seqlens_q")
        cu_k = _check_cu(kw["cu_seqlens_kv"], q, k.shape[0], kw["max_seqlen_kv"], "cu_seqlens_kv")
        assert kw["cu_seqlens_q_padded"].tolist() == cu_q and kw["cu_seqlens_kv_padded"].tolist() == cu_k
        return cu_q, cu_k, _MASKS[kw["attn_mask_type"]]

    def stats_rows(total_q):
        return get_max_tokens(total_q) if bucketed else total_q

    def fwd(**kw):
        q, k, v = kw["q"], kw["k"], kw["v"]
        cu_q, cu_k, mask = check(kw, q, k, v)
        assert kw["is_training"] is True and kw["attn_bias"] is None and kw["page_table_k"] is None
        assert not io_formats or kw["o_format"] == "thd", "o_format must match THD (default sbhd)"
        out, lse = dense_varlen(q, k, v, cu_q, cu_k, kw["attn_scale"], mask, math.nan)
        out[lse.isnan().T] = math.nan  # no keys: unspecified for cuDNN
        if packed_stats:  # [rows, h, 1]; rows past total_q hold garbage
            stats = lse.new_full((stats_rows(q.shape[0]), q.shape[1], 1), math.nan)
            stats[:q.shape[0], :, 0] = lse.T
        else:  # [b, h, max_seqlen_q, 1]; rows past a sequence's end hold garbage
            stats = lse.new_full((len(cu_q) - 1, q.shape[1], kw["max_seqlen_q"], 1), math.nan)
            for i, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
                stats[i, :, :b - a, 0] = lse[:, a:b]
        fa.calls.append(dict(fn="fwd", cu_q=cu_q, cu_k=cu_k, max_q=kw["max_seqlen_q"],
                             max_k=kw["max_seqlen_kv"], mask=kw["attn_mask_type"], stats_rows=stats.shape[0]))
        return out, [stats, torch.tensor([7, 0], dtype=torch.int64)]

    def bwd(**kw):
        q, k, v, o, d_o = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
        cu_q, cu_k, mask = check(kw, q, k, v)
        assert io_formats or kw["dqkv_dtype"] == te_dtype[d_o.dtype]
        assert not io_formats or (kw["o_format"], kw["do_format"], kw["dqkv_layout"]) == (
            "thd", "thd", "thd_thd_thd"), "o/do/dqkv formats must match THD (defaults sbhd)"
        stats, rng_state = kw["aux_ctx_tensors"]
        assert stats.dtype == _lse_dtype(q.dtype) and stats.is_contiguous()
        assert rng_state.tolist() == [7, 0] and o.is_contiguous() and d_o.is_contiguous()
        if packed_stats:
            assert stats.shape == (stats_rows(q.shape[0]), q.shape[1], 1), (stats.shape, version)
            lse = stats[:q.shape[0]].squeeze(-1).T
        else:
            assert stats.shape == (len(cu_q) - 1, q.shape[1], kw["max_seqlen_q"], 1)
            lse = torch.cat([stats[i, :, :b - a, 0] for i, (a, b) in enumerate(zip(cu_q, cu_q[1:]))], 1)
        fa.calls.append(dict(fn="bwd", cu_q=cu_q, cu_k=cu_k, mask=kw["attn_mask_type"],
                             stats_rows=stats.shape[0]))
        grads = dense_varlen_bwd(d_o, q, k, v, o, lse, cu_q, cu_k, kw["attn_scale"], mask)
        return [*grads, None]

    fwd_params, bwd_params = fused_attn_signatures(version)
    fa.fused_attn_fwd = versioned(fwd_params, fwd, "fused_attn_fwd")
    fa.fused_attn_bwd = versioned(bwd_params, bwd, "fused_attn_bwd")
    tex.get_fused_attn_backend = get_fused_attn_backend
    mods["transformer_engine.pytorch"].DotProductAttention = _dot_product_attention(fa)
    _install(monkeypatch, mods)
    return fa


def _dot_product_attention(fa):
    class DotProductAttention(torch.nn.Module):
        """The public module (stable over 2.2 - 2.18 for the arguments used here)."""

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
            out = dense_varlen(q, k, v, cu_q, cu_k, self.scale, _MASKS[attn_mask_type], math.nan)[0]
            return out.flatten(1)  # THD output is [t, h * d]

    return DotProductAttention
