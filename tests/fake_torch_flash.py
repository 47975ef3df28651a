"""A fake of PyTorch's CUDA flash-attention ops (aten::_flash_attention_forward / _backward) for CPU
tests of the "torch_cuda" backend.

Derived from PyTorch's source (docs/KERNEL_VERSIONS.md, "PyTorch"): the schemas are the ones the
installed torch 2.13 prints (`torch.ops.aten._flash_attention_forward.default._schema`); the checks
are mha_varlen_fwd / mha_varlen_bwd of aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp and the wrappers in attention.cu / attention_backward.cu:
- q/k/v fp16 or bf16 of one dtype (float64 is let through, as in fake_attention_libs, so tests
  compare at 1e-12), last dim contiguous, head_dim % 8 == 0 and <= 256, Hq % Hkv == 0;
- cu_seqlens int32, contiguous, [batch + 1], on q's device; max_seqlen python ints (SymInt)
  bounding every entry; dropout_p a python float;
- max_seqlen_q == 1 turns causal off, and with GQA (and no window/dropout) reshapes q as
  [batch, Hkv, groups, D]: total_q must equal batch there (RuntimeError otherwise, as the reshape);
- causal with Lq != Lk is bottom-right; an entry without keys gives out 0, LSE +inf;
- LSE [Hq, total_q] float32; rng_state uint64 [2], unused uint64 []; the backward takes the LSE
  in that layout and the forward's rng_state / unused, makes grad_out and out contiguous
  (attention_backward.cu), and returns fresh dq, dk, dv (GQA dk/dv summed over the group).
Values are float64 torch math (fake_attention_libs.dense_varlen / dense_varlen_bwd).
"""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch

from fake_attention_libs import _check_cu, dense_varlen, dense_varlen_bwd

# torch 2.13.0 (read from the installed build here; the same text on every CPU/CUDA build).
SCHEMAS = {
    "2.13": (
        "aten::_flash_attention_forward(Tensor query, Tensor key, Tensor value, Tensor? cum_seq_q, "
        "Tensor? cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, "
        "bool return_debug_mask, *, float? scale=None, SymInt? window_size_left=None, "
        "SymInt? window_size_right=None, Tensor? seqused_k=None, Tensor? alibi_slopes=None, "
        "Tensor? block_table=None, int? num_splits=None) -> (Tensor output, Tensor "
        "softmax_logsumexp, Tensor rng_state, Tensor unused, Tensor debug_attn_mask)",
        "aten::_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
        "Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
        "SymInt max_k, float dropout_p, bool is_causal, Tensor rng_state, Tensor unused, *, "
        "float? scale=None, SymInt? window_size_left=None, SymInt? window_size_right=None) -> "
        "(Tensor, Tensor, Tensor)"),
}
# Older schema texts of the same ops, as other projects record them (not read at a PyTorch tag):
# FlagGems' aten op table (forward without block_table / num_splits) and xformers' torch-flash
# compatibility check (backward naming the forward's tensors philox_seed / philox_offset).
SCHEMAS["flaggems-table"] = (SCHEMAS["2.13"][0].replace(
    ", Tensor? block_table=None, int? num_splits=None", ""), SCHEMAS["2.13"][1])
SCHEMAS["philox-names"] = (SCHEMAS["2.13"][0], SCHEMAS["2.13"][1].replace(
    "Tensor rng_state, Tensor unused", "Tensor philox_seed, Tensor philox_offset"))
HALF = (torch.float16, torch.bfloat16, torch.float64)


def _params(schema: str):
    """[(name, type, keyword_only, has_default)] of an aten schema string."""
    inner = schema[schema.index("(") + 1:schema.index(") ->")]
    out, kw_only = [], False
    for part in (p.strip() for p in inner.split(",")):
        if part == "*":
            kw_only = True
            continue
        m = re.fullmatch(r"(\S+) (\w+)(=.*)?", part)
        out.append((m.group(2), m.group(1), kw_only, m.group(3) is not None))
    return out


class FakeOp:
    """An OpOverloadPacket look-alike: `.default._schema` and a call that binds like the schema
    (TypeError on an unknown / missing / positional-only-keyword argument, python int / float /
    bool for SymInt / float / bool)."""

    def __init__(self, schema: str, impl):
        self.default = SimpleNamespace(_schema=schema)
        self._params, self._impl = _params(schema), impl

    def __call__(self, *args, **kwargs):
        positional = [p for p in self._params if not p[2]]
        if len(args) > len(positional):
            raise TypeError(f"too many positional arguments ({len(args)})")
        bound = {p[0]: a for p, a in zip(positional, args)}
        for name, value in kwargs.items():
            spec = next((p for p in self._params if p[0] == name), None)
            if spec is None or name in bound:
                raise TypeError(f"unexpected or repeated argument {name!r}")
            bound[name] = value
        for name, typ, _, has_default in self._params:
            if name not in bound:
                if not has_default:
                    raise TypeError(f"missing argument {name!r}")
                bound[name] = None
            value = bound[name]
            if value is None:
                assert typ.endswith("?"), f"{name} is not optional"
                continue
            base = typ.rstrip("?")
            want = {"SymInt": int, "int": int, "float": float, "bool": bool}.get(base)
            if want is not None:
                assert type(value) is want, f"{name}: {base} expects a python {want.__name__}, got {value!r}"
        return self._impl(**bound)


def _check_inputs(q, k, v, head_dim):
    assert q.dtype in HALF and k.dtype == v.dtype == q.dtype, "FlashAttention only support fp16 and bf16"
    assert all(x.stride(-1) == 1 for x in (q, k, v)), "Input tensor must have contiguous last dimension"
    assert head_dim % 8 == 0 and head_dim <= 256, "head_size"
    assert q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query"


def install(monkeypatch, version: str = "2.13.0", *, schemas=None, cuda="13.0", hip=None,
            flash_built=True):
    """Replace torch_cuda.torch_flash_ops with this fake; returns a namespace with `calls`."""
    from prefix_schedule.attention.backends import torch_cuda

    fwd_schema, bwd_schema = schemas or SCHEMAS["2.13"]
    state = SimpleNamespace(calls=[])

    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, scale, window_size_left, window_size_right, **unused):
        q, k, v = query, key, value
        _check_inputs(q, k, v, q.shape[-1])
        assert dropout_p == 0.0 and not return_debug_mask and scale is not None
        assert all(x is None for x in unused.values()), unused
        assert window_size_left is None and window_size_right is None
        cu_q = _check_cu(cum_seq_q, q, q.shape[0], max_q, "cum_seq_q")
        cu_k = _check_cu(cum_seq_k, q, k.shape[0], max_k, "cum_seq_k")
        batch = len(cu_q) - 1
        if max_q == 1:
            is_causal = False  # flash_api.cpp: causal == not causal for one query
            if q.shape[1] > k.shape[1] and q.shape[0] != batch:
                raise RuntimeError(f"shape '[{batch}, {k.shape[1]}, {q.shape[1] // k.shape[1]}, "
                                   f"{q.shape[2]}]' is invalid for input of size {q.numel()}")
        state.calls.append(dict(fn="fwd", cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k,
                                causal=is_causal, scale=scale))
        out, lse = dense_varlen(q, k, v, cu_q, cu_k, scale, "bottom_right" if is_causal else "none",
                                math.inf)
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, rng, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype)

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, scale, window_size_left, window_size_right, **rng):
        q, k, v = query, key, value
        _check_inputs(q, k, v, q.shape[-1])
        seed, offset = rng.values()
        assert seed.dtype == torch.uint64 and seed.shape == (2,) and offset.dtype == torch.uint64
        assert out.dtype == grad_out.dtype == q.dtype and dropout_p == 0.0 and scale is not None
        assert out.shape == grad_out.shape == q.shape[:2] + v.shape[2:]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        assert logsumexp.shape == (q.shape[1], q.shape[0]) and logsumexp.dtype == lse_dtype
        cu_q = _check_cu(cum_seq_q, q, q.shape[0], max_q, "cum_seq_q")
        cu_k = _check_cu(cum_seq_k, q, k.shape[0], max_k, "cum_seq_k")
        state.calls.append(dict(fn="bwd", cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k,
                                causal=is_causal, scale=scale))
        return dense_varlen_bwd(grad_out.contiguous(), q, k, v, out.contiguous(), logsumexp, cu_q,
                                cu_k, scale, "bottom_right" if is_causal else "none")

    ops = SimpleNamespace(version=version, cuda=cuda, hip=hip, flash_built=flash_built,
                          fwd=FakeOp(fwd_schema, forward), bwd=FakeOp(bwd_schema, backward))
    monkeypatch.setattr(torch_cuda, "torch_flash_ops", lambda: ops)
    return state
