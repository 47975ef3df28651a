"""The "transformer_engine" backend: cuDNN fused attention through Transformer Engine 2.2 - 2.19.

Two-part mode calls TE's low-level `transformer_engine.pytorch.cpp_extensions.fused_attn`
`fused_attn_fwd` / `fused_attn_bwd` with qkv_layout "thd_thd_thd" and cu_seqlens (plus
cu_seqlens_*_padded = the same offsets: no padding), the way TE's own context-parallel code calls
them (AttnFuncWithCPAndKVP2P: pytorch/attention.py in 2.2-2.4, later
attention/dot_product_attention/context_parallel.py). What differs by version is in
versions.TEApi (table with file and function per fact: docs/KERNEL_VERSIONS.md):
- the fused kernel is chosen per call with TE's own `transformer_engine_torch.
  get_fused_attn_backend` (positional arguments of that version), never hard-coded: a shape or
  dtype cuDNN cannot run is refused with the reason instead of failing inside cuDNN;
- keywords: `dqkv_dtype` (bwd, until 2.14), `o_format`/`do_format`/`dqkv_layout` (2.15+, whose
  defaults are not THD); window_size (-1, 0) for the causal mask, (-1, -1) otherwise
  (check_set_window_size);
- forward returns (out, aux_ctx_tensors) with aux = [softmax_stats, rng_state]; the stats are
  [rows, H, 1] float32 (natural-log LSE) for THD with cuDNN >= 9.6, where rows is
  get_max_tokens(total_q) (>= 1024, bucketed) in 2.2-2.10 and total_q from 2.11: forward slices
  the first total_q rows, backward gets a buffer of the forward's row count (extra rows unread);
  TE 2.18 - 2.19 on sm120 give per-sequence stats [batch, H, max_seqlen_q, 1] instead (handled too);
- the backend get_fused_attn_backend returns (a pybind11 enum member, strict comparisons) is
  compared with FusedAttnBackend["F16_arbitrary_seqlen"] by int value: that is a pybind member in
  2.2 - 2.18 and an IntEnum member in 2.19 (fused_attn_fwd/bwd cast either);
- masks "padding" (part P) and "padding_causal" (part S: square, so top-left is right).
An entry without keys is not specified for cuDNN, so slots without a prefix are left out of
part P (empty_kv_ok = False). Copy mode uses the public DotProductAttention with
qkv_format="thd", attn_mask_type="padding_causal_bottom_right" and max_seqlen_q/kv passed
explicitly (otherwise TE reads them from the device).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import (Backend, LibraryUnsupported, check_cuda,
                                                      check_head_dim, copy_call, gather_copy_kv, to_device)
from prefix_schedule.attention.backends.versions import te_api

__all__ = ["TransformerEngineBackend"]

MIN_CUDNN = (9, 6, 0)  # THD padding_causal_bottom_right (copy mode), packed THD softmax stats
_MASKS = {True: ("padding_causal", (-1, 0)), False: ("padding", (-1, -1))}  # causal -> mask, window


def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


class TransformerEngineBackend(Backend):
    """TE fused (cuDNN) attention, THD layout (CUDA sm90+, fp16/bf16, cuDNN >= 9.6)."""

    name = "transformer_engine"
    install_hint = ("pip install --no-build-isolation 'transformer_engine[pytorch]>=2.2,<2.20' "
                    "(with cuDNN >= 9.6)")
    empty_kv_ok = False
    DTYPES = (torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        super().__init__()
        self._dpa_modules: dict = {}
        self._padded_index: dict = {}
        self._kernels: dict = {}

    def _load(self):
        import transformer_engine
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import fused_attn as fa
        from transformer_engine.pytorch.utils import get_cudnn_version

        text = str(getattr(transformer_engine, "__version__", "0"))
        api = te_api(text)  # LibraryUnsupported outside the checked versions
        missing = sorted((api.fwd_kwargs - _params(fa.fused_attn_fwd))
                         | (api.bwd_kwargs - _params(fa.fused_attn_bwd)))
        if missing:  # a build that differs from its release tag
            raise LibraryUnsupported(f"transformer_engine {text}: fused_attn_fwd/bwd lack {missing}")
        cudnn = tuple(get_cudnn_version())
        if cudnn < MIN_CUDNN:
            raise LibraryUnsupported(f"transformer_engine {text} runs cuDNN {cudnn}; THD attention "
                                     f"with bottom-right masks needs cuDNN >= {MIN_CUDNN}")
        return SimpleNamespace(api=api, text=text, fwd=fa.fused_attn_fwd, bwd=fa.fused_attn_bwd,
                               get_backend=tex.get_fused_attn_backend, fa=fa, te_dtype=TE_DType,
                               arbitrary=fa.FusedAttnBackend["F16_arbitrary_seqlen"],
                               dpa=te.DotProductAttention)

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        reason = (check_cuda(device, dtype, self.DTYPES, (9, 0), "TE fused attention with THD")
                  # cuDNN supports larger head dims on some versions; 128 is what is validated here
                  or check_head_dim(head_dim, 8, 128, "TE fused attention"))
        if reason:
            return reason
        try:  # a representative shape: TE's own verdict on dtype, head_dim, GPU and cuDNN
            self.kernel(dtype, 1, 1, head_dim or 128, 1024, 1024, causal=True)
        except Exception as e:  # noqa: BLE001 -- a verdict, not a crash of selection
            return f"{e}" if isinstance(e, ValueError) else f"get_fused_attn_backend failed: {e!r}"
        return ""

    def kernel(self, dtype, heads, kv_heads, head_dim, max_q, max_k, *, causal: bool):
        """TE's fused backend for one call shape (get_fused_attn_backend with this version's
        arguments, cached); ValueError unless it is cuDNN's F16_arbitrary_seqlen."""
        key = (dtype, heads, kv_heads, head_dim, max_q, max_k, causal)
        if key not in self._kernels:
            lib = self.lib()
            fa, (mask, window) = lib.fa, _MASKS[causal]
            values = dict(
                is_training=True, q_type=lib.te_dtype[dtype], kv_type=lib.te_dtype[dtype],
                qkv_layout=fa.QKVLayout["thd_thd_thd"], bias_type=fa.AttnBiasType["no_bias"],
                mask_type=fa.AttnMaskType[mask], dropout=0.0, num_heads=heads,
                num_gqa_groups=kv_heads, max_seqlen_q=max_q, max_seqlen_kv=max_k,
                head_dim_qk=head_dim, head_dim_v=head_dim, window_size_left=window[0],
                window_size_right=window[1], return_max_logit=False, cuda_graph=False,
                deterministic=False)
            if "softmax_type" in lib.api.backend_args:
                values["softmax_type"] = fa.SoftmaxType["vanilla"]
            chosen = lib.get_backend(*(values[name] for name in lib.api.backend_args))
            # By value: the pybind enum compares strictly by type, and 2.19's FusedAttnBackend
            # is an IntEnum (a pybind member != an IntEnum member of the same value).
            if int(chosen) != int(lib.arbitrary):
                raise ValueError(
                    f"transformer_engine {lib.text}: get_fused_attn_backend chose {chosen} (not "
                    f"F16_arbitrary_seqlen) for THD {dtype} {mask}, heads {heads}/{kv_heads}, "
                    f"head_dim {head_dim}, max_seqlen {max_q}/{max_k} on this GPU and cuDNN; use "
                    "--attention-backend flash_attn or a supported shape")
            if len(self._kernels) > 4096:  # many distinct shapes over a long run: start over
                self._kernels.clear()
            self._kernels[key] = chosen
        return self._kernels[key]

    def _padded_rows(self, call, device) -> torch.Tensor:
        """Index of each packed query row in a flattened [batch, max_seqlen_q] layout (host-built,
        once per call layout and device)."""
        key = (call, str(device))
        if key not in self._padded_index:
            rows = [b * call.max_q + j for b, (a, e) in enumerate(zip(call.cu_q, call.cu_q[1:]))
                    for j in range(e - a)]
            self._padded_index[key] = to_device(rows, torch.int64, device)
        return self._padded_index[key]

    def _common(self, lib, q, k, call, scale) -> dict:
        """The keywords fwd and bwd share (only those this version accepts are passed)."""
        cu_q, cu_k = call.cu_tensors(q.device)
        mask, window = _MASKS[call.causal]
        return dict(max_seqlen_q=call.max_q, max_seqlen_kv=call.max_k, cu_seqlens_q=cu_q,
                    cu_seqlens_kv=cu_k, fake_dtype=q.dtype, cu_seqlens_q_padded=cu_q,
                    cu_seqlens_kv_padded=cu_k, attn_scale=scale, dropout=0.0,
                    qkv_layout="thd_thd_thd", attn_bias_type="no_bias", attn_mask_type=mask,
                    window_size=window, fused_attention_backend=self.kernel(
                        q.dtype, q.shape[1], k.shape[1], q.shape[2], call.max_q, call.max_k,
                        causal=call.causal))

    def varlen_fwd(self, q, k, v, call, scale):
        lib = self.lib()
        kw = self._common(lib, q, k, call, scale)
        kw.update(is_training=True, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), o_format="thd")
        out, aux, *_ = lib.fwd(**{key: kw[key] for key in lib.api.fwd_kwargs})
        stats, rng_state = aux[0], aux[1]
        total, heads = q.shape[0], q.shape[1]
        if stats.dim() == 3 and stats.shape[0] >= total and tuple(stats.shape[1:]) == (heads, 1):
            rows = stats.shape[0]  # total_q, or get_max_tokens(total_q) in 2.2-2.10
            lse = stats[:total].squeeze(-1).transpose(0, 1).contiguous()
        elif tuple(stats.shape) == (call.batch, heads, call.max_q, 1):  # per sequence (2.18 sm120)
            rows = None
            lse = stats.squeeze(-1).transpose(0, 1).flatten(1)[:, self._padded_rows(call, q.device)]
        else:
            raise RuntimeError(f"transformer_engine {lib.text} returned softmax stats of shape "
                               f"{tuple(stats.shape)}; expected [rows >= {total}, {heads}, 1] or "
                               f"[{call.batch}, {heads}, {call.max_q}, 1]")
        return out, lse, (rng_state, rows)

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        lib = self.lib()
        rng_state, rows = state
        if rows is not None:  # the forward's row count; rows past total_q are never read
            stats = lse.new_zeros((rows, lse.shape[0], 1))
            stats[:lse.shape[1], :, 0] = lse.transpose(0, 1)
        else:
            flat = lse.new_zeros((lse.shape[0], call.batch * call.max_q))
            flat[:, self._padded_rows(call, q.device)] = lse
            stats = flat.view(-1, call.batch, call.max_q).transpose(0, 1).contiguous().unsqueeze(-1)
        kw = self._common(lib, q, k, call, scale)
        kw.update(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), o=out.contiguous(),
                  d_o=grad_out.contiguous(), aux_ctx_tensors=[stats, rng_state], deterministic=False,
                  dqkv_dtype=lib.te_dtype[q.dtype], o_format="thd", do_format="thd",
                  dqkv_layout="thd_thd_thd")
        dq, dk, dv, *_ = lib.bwd(**{key: kw[key] for key in lib.api.bwd_kwargs})
        return dq, dk, dv

    def _dpa(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        """One DotProductAttention module per shape and scale (it holds no parameters)."""
        key = (heads, kv_heads, head_dim, scale)
        if key not in self._dpa_modules:
            self._dpa_modules[key] = self.lib().dpa(
                num_attention_heads=heads, kv_channels=head_dim, num_gqa_groups=kv_heads,
                attention_dropout=0.0, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                softmax_scale=scale)
        return self._dpa_modules[key]

    def copy_attention(self, q, k, v, prefix_k, prefix_v, meta, scale):
        call = copy_call(tuple(meta.cu_seqlens), tuple(meta.seq_slot), tuple(p.shape[0] for p in prefix_k))
        kk, vv = gather_copy_kv(k, v, prefix_k, prefix_v, meta)
        cu_q, cu_k = call.cu_tensors(q.device)
        dpa = self._dpa(q.shape[1], k.shape[1], q.shape[2], scale)
        out = dpa(q, kk, vv, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                  max_seqlen_q=call.max_q, max_seqlen_kv=call.max_k,
                  attn_mask_type="padding_causal_bottom_right")
        return out.view(q.shape[0], q.shape[1], -1)

    def reset(self) -> None:
        super().reset()
        self._dpa_modules, self._padded_index, self._kernels = {}, {}, {}
