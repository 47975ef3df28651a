"""The "flash_attn" backend: flash-attn 2 (>= 2.6) varlen kernels.

Two-part mode calls the private `flash_attn.flash_attn_interface._flash_attn_varlen_forward` /
`_flash_attn_varlen_backward` pair (what ring attention calls for the merged-out backward), as
read in Dao-AILab/flash-attention flash_attn/flash_attn_interface.py (2.7/2.8 line) and
csrc/flash_attn/flash_api.cpp (mha_varlen_fwd/bwd):
- forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, <window>, softcap, alibi_slopes, return_softmax, ...) returns
  (out_padded, softmax_lse, S_dmask, rng_state) since 2.7 and
  (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state) in 2.6 (TE's context-parallel
  code indexes [0]/[1]/[3] resp. [4]/[5]/[7] on `v2_7_0_plus`);
- backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p, softmax_scale, causal, <window>, softcap, alibi_slopes, deterministic,
  rng_state=None) WRITES dq/dk/dv (GQA: at::sum_out into dk/dv), dtype = q's;
- <window> is `window_size=(-1, -1)` up to 2.6 and `window_size_left=-1, window_size_right=-1`
  from 2.7 (where the functions are torch custom ops, so inspect.signature tells nothing: the
  version decides). The first 13 backward / 7 forward arguments are positional in both lines,
  the rest are passed by keyword;
- softmax_lse is [H, total_q] float32 since 2.6; an entry without keys gives out 0, LSE +inf;
- head_dim must be a multiple of 8 (only the public wrappers pad), <= 256.
Copy mode calls the public `flash_attn_varlen_func(..., causal=True)`, bottom-right aligned per
sequence since 2.1.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import (Backend, LibraryUnsupported, check_cuda,
                                                      check_head_dim, copy_call, gather_copy_kv)

__all__ = ["FlashAttnBackend"]

MIN_VERSION = (2, 6)


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.7.4.post1' -> (2, 7, 4)."""
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


class FlashAttnBackend(Backend):
    """flash-attn 2 varlen kernels (CUDA sm80+, fp16/bf16)."""

    name = "flash_attn"
    install_hint = "pip install 'flash-attn>=2.6' --no-build-isolation"
    empty_kv_ok = True  # out 0, LSE +inf (see flash_fwd_kernel.h early exit)
    DTYPES = (torch.float16, torch.bfloat16)

    def _load(self):
        import flash_attn
        from flash_attn import flash_attn_interface as fai

        text = str(getattr(flash_attn, "__version__", "0"))
        version = version_tuple(text)
        if version < MIN_VERSION:
            raise LibraryUnsupported(f"flash-attn {text} is older than 2.6 (the [H, total_q] LSE layout)")
        if version >= (2, 7):
            window = {"window_size_left": -1, "window_size_right": -1}
        else:
            window = {"window_size": (-1, -1)}
        return SimpleNamespace(version=version, window=window, fwd=fai._flash_attn_varlen_forward,
                               bwd=fai._flash_attn_varlen_backward, func=fai.flash_attn_varlen_func)

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        return (check_cuda(device, dtype, self.DTYPES, (8, 0), "flash-attn 2")
                or check_head_dim(head_dim, 8, 256, "flash-attn 2"))

    def varlen_fwd(self, q, k, v, call, scale):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        res = lib.fwd(q, k, v, cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0, softmax_scale=scale,
                      causal=call.causal, softcap=0.0, alibi_slopes=None, return_softmax=False,
                      **lib.window)
        out, lse, rng_state = (res[4], res[5], res[7]) if len(res) == 8 else (res[0], res[1], res[3])
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"flash-attn {lib.version} returned an LSE of shape {tuple(lse.shape)}; "
                               f"expected [heads, total_q] = {[q.shape[1], q.shape[0]]} (flash-attn >= 2.6)")
        return out, lse, rng_state

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        lib.bwd(grad_out, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, call.max_q, call.max_k,
                dropout_p=0.0, softmax_scale=scale, causal=call.causal, softcap=0.0,
                alibi_slopes=None, deterministic=False, rng_state=None, **lib.window)
        return dq, dk, dv

    def copy_attention(self, q, k, v, prefix_k, prefix_v, meta, scale):
        call = copy_call(tuple(meta.cu_seqlens), tuple(meta.seq_slot), tuple(p.shape[0] for p in prefix_k))
        kk, vv = gather_copy_kv(k, v, prefix_k, prefix_v, meta)
        cu_q, cu_k = call.cu_tensors(q.device)
        return self.lib().func(q, kk, vv, cu_q, cu_k, call.max_q, call.max_k, dropout_p=0.0,
                               softmax_scale=scale, causal=True)
