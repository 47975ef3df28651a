"""The "flash_attn" backend: flash-attn 2 varlen kernels (versions: see versions.py, 2.6 - 2.8).

Two-part mode calls the private `flash_attn.flash_attn_interface._flash_attn_varlen_forward` /
`_flash_attn_varlen_backward` pair (what ring attention calls for the merged-out backward), as
read in flash_attn/flash_attn_interface.py and csrc/flash_attn/flash_api.cpp (mha_varlen_fwd/bwd)
at every tag v2.6.0 ... v2.8.3.post1 (table: docs/KERNEL_VERSIONS.md):
- forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, <window>, softcap, alibi_slopes, return_softmax, block_table, ...):
  2.6.0/2.6.0.post1 give `window_size`, `softcap`, `alibi_slopes`, `return_softmax` and
  `block_table` no default, so every one of them is passed (block_table=None, as TE's
  context-parallel code does); returns 8 values in 2.6, 4 from 2.7 (FlashApi.unpack_forward);
- backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p, softmax_scale, causal, <window>, softcap, alibi_slopes, deterministic,
  rng_state=None) WRITES dq/dk/dv (GQA: at::sum_out into dk/dv), dtype = q's;
- <window> is `window_size=(-1, r)` in 2.6 and `window_size_left=-1, window_size_right=r` from
  2.7 (torch custom ops there: inspect.signature tells nothing, the version decides), r = 0 when
  causal else -1 (TE's convention; the C++ forces r = 0 for causal itself);
- softmax_lse is [H, total_q] float32 since 2.6; an entry without keys gives out 0, LSE +inf
  (flash_fwd_kernel.h early exit);
- head_dim must be a multiple of 8 (only the public wrappers pad), <= 256.
Copy mode calls the public `flash_attn_varlen_func(..., causal=True)`, bottom-right aligned per
sequence since 2.1.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import (Backend, check_cuda, check_head_dim, copy_call,
                                                      gather_copy_kv)
from prefix_schedule.attention.backends.versions import flash_api

__all__ = ["FlashAttnBackend"]


class FlashAttnBackend(Backend):
    """flash-attn 2 varlen kernels (CUDA sm80+, fp16/bf16)."""

    name = "flash_attn"
    install_hint = "pip install 'flash-attn>=2.6,<2.9' --no-build-isolation"
    empty_kv_ok = True  # out 0, LSE +inf (see flash_fwd_kernel.h early exit)
    DTYPES = (torch.float16, torch.bfloat16)

    def _load(self):
        import flash_attn
        from flash_attn import flash_attn_interface as fai

        api = flash_api(str(getattr(flash_attn, "__version__", "0")))  # LibraryUnsupported outside
        return SimpleNamespace(api=api, fwd=fai._flash_attn_varlen_forward,
                               bwd=fai._flash_attn_varlen_backward, func=fai.flash_attn_varlen_func)

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        return (check_cuda(device, dtype, self.DTYPES, (8, 0), "flash-attn 2")
                or check_head_dim(head_dim, 8, 256, "flash-attn 2"))

    def varlen_fwd(self, q, k, v, call, scale):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        res = lib.fwd(q, k, v, cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0, softmax_scale=scale,
                      causal=call.causal, softcap=0.0, alibi_slopes=None, return_softmax=False,
                      block_table=None, **lib.api.window(call.causal))
        out, lse, rng_state = lib.api.unpack_forward(res)
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"flash-attn {lib.api.version} returned an LSE of shape {tuple(lse.shape)}; "
                               f"expected [heads, total_q] = {[q.shape[1], q.shape[0]]} (flash-attn >= 2.6)")
        return out, lse, rng_state

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        lib.bwd(grad_out, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, call.max_q, call.max_k,
                dropout_p=0.0, softmax_scale=scale, causal=call.causal, softcap=0.0,
                alibi_slopes=None, deterministic=False, rng_state=state, **lib.api.window(call.causal))
        return dq, dk, dv

    def copy_attention(self, q, k, v, prefix_k, prefix_v, meta, scale):
        call = copy_call(tuple(meta.cu_seqlens), tuple(meta.seq_slot), tuple(p.shape[0] for p in prefix_k))
        kk, vv = gather_copy_kv(k, v, prefix_k, prefix_v, meta)
        cu_q, cu_k = call.cu_tensors(q.device)
        return self.lib().func(q, kk, vv, cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0,
                               softmax_scale=scale, causal=True)
