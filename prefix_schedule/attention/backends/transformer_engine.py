"""The "transformer_engine" backend: cuDNN fused attention through Transformer Engine.

Two-part mode calls TE's low-level `transformer_engine.pytorch.cpp_extensions.fused_attn`
`fused_attn_fwd` / `fused_attn_bwd` with qkv_layout "thd_thd_thd" and cu_seqlens (plus
cu_seqlens_*_padded = the same offsets: no padding), the way TE's own context-parallel code
(attention/dot_product_attention/context_parallel.py, AttnFuncWithCPAndKVP2P) calls them:
- forward returns (out, aux_ctx_tensors[, max_logit]) with aux_ctx_tensors = [softmax_stats,
  rng_state, ...]; for THD with cuDNN >= 9.6 the stats are "packed", [total_q, H, 1] float32
  (the full natural-log LSE of the scaled scores); the CP code turns them into [H, total_q] by
  squeeze(-1).transpose(0, 1).contiguous() and back by transpose(0, 1).contiguous().unsqueeze(-1)
  before passing [merged_stats, rng_state] as aux_ctx_tensors to the backward;
- keyword names differ between TE versions (2.x: `fake_dtype`, bwd `dqkv_dtype`; later ones add
  `o_format`/`do_format`/`dqkv_layout` and drop `dqkv_dtype`), so every argument is passed by
  keyword and the optional ones only when the installed signature has them;
- mask "padding" (part P) and "padding_causal" (part S: square, so top-left is right).
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
from prefix_schedule.attention.backends.flash_attn import version_tuple

__all__ = ["TransformerEngineBackend"]

MIN_CUDNN = (9, 6, 0)  # THD padding_causal_bottom_right (copy mode), packed THD softmax stats
_FWD_ARGS = {"is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k",
             "v", "fake_dtype", "fused_attention_backend", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
             "attn_scale", "dropout", "qkv_layout", "attn_mask_type", "attn_bias_type"}
_BWD_ARGS = {"max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o",
             "fake_dtype", "aux_ctx_tensors", "fused_attention_backend", "cu_seqlens_q_padded",
             "cu_seqlens_kv_padded", "attn_scale", "dropout", "qkv_layout", "attn_mask_type",
             "attn_bias_type", "deterministic"}
_THD = {"qkv_layout": "thd_thd_thd", "o_format": "thd", "do_format": "thd", "dqkv_layout": "thd_thd_thd"}


def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


class TransformerEngineBackend(Backend):
    """TE fused (cuDNN) attention, THD layout (CUDA sm90+, fp16/bf16, cuDNN >= 9.6)."""

    name = "transformer_engine"
    install_hint = "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.2' (with cuDNN >= 9.6)"
    empty_kv_ok = False
    DTYPES = (torch.float16, torch.bfloat16)

    def __init__(self) -> None:
        super().__init__()
        self._dpa_modules: dict = {}
        self._padded_index: dict = {}

    def _load(self):
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.pytorch.cpp_extensions import fused_attn as fa
        from transformer_engine.pytorch.utils import get_cudnn_version

        version = str(getattr(transformer_engine, "__version__", "?"))
        fwd_params, bwd_params = _params(fa.fused_attn_fwd), _params(fa.fused_attn_bwd)
        missing = sorted((_FWD_ARGS - fwd_params) | (_BWD_ARGS - bwd_params))
        if missing:
            raise LibraryUnsupported(f"transformer_engine {version}: fused_attn_fwd/bwd lack {missing}")
        cudnn = tuple(get_cudnn_version())
        if cudnn < MIN_CUDNN:
            raise LibraryUnsupported(f"transformer_engine {version} runs cuDNN {cudnn}; THD attention "
                                     f"with bottom-right masks needs cuDNN >= {MIN_CUDNN}")
        te_dtype = None
        if "dqkv_dtype" in bwd_params:
            from transformer_engine.pytorch.constants import TE_DType as te_dtype
        return SimpleNamespace(version=version_tuple(version), fwd=fa.fused_attn_fwd, bwd=fa.fused_attn_bwd,
                               fwd_params=fwd_params, bwd_params=bwd_params, te_dtype=te_dtype,
                               kernel=fa.FusedAttnBackend["F16_arbitrary_seqlen"],
                               dpa=te.DotProductAttention)

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        # cuDNN supports larger head dims on some versions; 128 is what is validated here.
        return (check_cuda(device, dtype, self.DTYPES, (9, 0), "TE fused attention with THD")
                or check_head_dim(head_dim, 8, 128, "TE fused attention"))

    def _padded_rows(self, call, device) -> torch.Tensor:
        """Index of each packed query row in a flattened [batch, max_seqlen_q] layout (host-built,
        once per call layout and device)."""
        key = (call, str(device))
        if key not in self._padded_index:
            rows = [b * call.max_q + j for b, (a, e) in enumerate(zip(call.cu_q, call.cu_q[1:]))
                    for j in range(e - a)]
            self._padded_index[key] = to_device(rows, torch.int64, device)
        return self._padded_index[key]

    @staticmethod
    def _kwargs(params, **kwargs):
        kwargs.update({key: value for key, value in _THD.items() if key in params})
        return {key: value for key, value in kwargs.items() if key in params}

    def varlen_fwd(self, q, k, v, call, scale):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        out, aux, *_ = lib.fwd(**self._kwargs(
            lib.fwd_params, is_training=True, max_seqlen_q=call.max_q, max_seqlen_kv=call.max_k,
            cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
            fake_dtype=q.dtype, fused_attention_backend=lib.kernel, cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k, attn_scale=scale, dropout=0.0, attn_bias_type="no_bias",
            attn_mask_type="padding_causal" if call.causal else "padding"))
        stats, rng_state = aux[0], aux[1]
        packed = stats.dim() == 3
        expect = (q.shape[0], q.shape[1], 1) if packed else (call.batch, q.shape[1], call.max_q, 1)
        if tuple(stats.shape) != expect:
            raise RuntimeError(f"TE returned softmax stats of shape {tuple(stats.shape)}; expected "
                               f"[total_q, heads, 1] or [batch, heads, max_seqlen_q, 1] = {list(expect)}")
        if packed:
            lse = stats.squeeze(-1).transpose(0, 1).contiguous()
        else:  # per-sequence padded stats (TE versions before the packed THD format)
            lse = stats.squeeze(-1).transpose(0, 1).flatten(1)[:, self._padded_rows(call, q.device)]
        return out, lse, (rng_state, packed)

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        rng_state, packed = state
        if packed:
            stats = lse.transpose(0, 1).contiguous().unsqueeze(-1)
        else:
            flat = lse.new_zeros((lse.shape[0], call.batch * call.max_q))
            flat[:, self._padded_rows(call, q.device)] = lse
            stats = flat.view(-1, call.batch, call.max_q).transpose(0, 1).contiguous().unsqueeze(-1)
        dq, dk, dv, *_ = lib.bwd(**self._kwargs(
            lib.bwd_params, max_seqlen_q=call.max_q, max_seqlen_kv=call.max_k, cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k, q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), o=out.contiguous(),
            d_o=grad_out.contiguous(), fake_dtype=q.dtype,
            dqkv_dtype=lib.te_dtype[q.dtype] if lib.te_dtype is not None else None,
            aux_ctx_tensors=[stats, rng_state], fused_attention_backend=lib.kernel,
            cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_k, attn_scale=scale, dropout=0.0,
            attn_bias_type="no_bias", attn_mask_type="padding_causal" if call.causal else "padding",
            deterministic=False))
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
        self._dpa_modules, self._padded_index = {}, {}
