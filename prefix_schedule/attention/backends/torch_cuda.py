"""The "torch_cuda" backend: PyTorch's own varlen flash attention (no extension to build).

It calls the aten ops under `torch.nn.attention.varlen.varlen_attn` directly, because the public
function's keywords changed in every release (docs/KERNEL_VERSIONS.md, "PyTorch") while the ops'
leading parameters did not:
- `torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
  return_debug_mask, scale=)` -> (out, lse [Hq, total_q] float32, rng_state, unused, debug_mask);
- `torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
  dropout_p, is_causal, rng_state, unused, scale=)` -> fresh (dq, dk, dv); GQA dk/dv summed.
Both go to PyTorch's vendored flash-attn 2 (aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp `mha_varlen_fwd` / `mha_varlen_bwd`): fp16/bf16, sm80+, head_dim % 8 == 0 and <= 256,
Hq % Hkv == 0 (GQA native), int32 cu_seqlens, last dim contiguous; causal with Lq != Lk is
bottom-right; an entry without keys gives out 0 and LSE +inf. The installed schemas are checked at
load (versions.check_torch_flash_schemas): a build whose ops moved is refused, not miscalled.

max_seqlen_q is passed as max(max_q, 2): with max_seqlen_q == 1 and GQA, mha_varlen_fwd swaps the
query-head groups into the sequence dimension, a reshape that assumes exactly one query per entry
(an entry with no query rows would break it). max_seqlen is an upper bound for the kernel (the
entries' real lengths come from cu_seqlens), so 2 computes the same thing without the swap.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import (Backend, LibraryUnsupported, check_cuda,
                                                      check_head_dim, copy_call, gather_copy_kv)
from prefix_schedule.attention.backends.versions import check_torch_flash_schemas, torch_flash_version

__all__ = ["TorchCudaBackend", "torch_flash_ops"]


def torch_flash_ops() -> SimpleNamespace:
    """What the backend reads from the running PyTorch (tests replace this with a fake)."""
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return SimpleNamespace(
        version=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
        flash_built=None if flash_built is None else bool(flash_built()),
        fwd=torch.ops.aten._flash_attention_forward, bwd=torch.ops.aten._flash_attention_backward)


def _schema(op) -> str:
    return str(op.default._schema)


class _CopyFn(torch.autograd.Function):
    """Copy mode: each suffix against [prefix ; suffix], one bottom-right causal varlen call."""

    @staticmethod
    def forward(ctx, backend, call, scale, q, kk, vv):
        out, lse, state = backend._fwd(q, kk, vv, call, scale, causal=True)
        ctx.backend, ctx.call, ctx.scale, ctx.state = backend, call, scale, state
        ctx.save_for_backward(q, kk, vv, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kk, vv, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend._bwd(grad_out, q, kk, vv, out, lse, ctx.call, ctx.scale, ctx.state,
                                      causal=True)
        return None, None, None, dq, dk, dv


class TorchCudaBackend(Backend):
    """PyTorch's vendored flash-attn 2 varlen kernels (CUDA sm80+, fp16/bf16, torch 2.10 - 2.13)."""

    name = "torch_cuda"
    install_hint = ("a CUDA build of PyTorch 2.10 - 2.13 with flash attention "
                    "(the default pip/conda CUDA wheels); nothing to compile")
    empty_kv_ok = True  # out 0, LSE +inf (flash_api.cpp / flash_fwd_kernel.h early exit)
    DTYPES = (torch.float16, torch.bfloat16)

    def _load(self):
        ops = torch_flash_ops()
        version = torch_flash_version(ops.version)  # LibraryUnsupported outside 2.10 - 2.13
        if ops.hip:
            raise LibraryUnsupported(f"ROCm PyTorch ({ops.hip}): its varlen LSE is [batch, heads, "
                                     "max_q], not [heads, total_q]; not checked")
        if not ops.cuda:
            raise LibraryUnsupported(f"PyTorch {ops.version} is a CPU-only build")
        if ops.flash_built is False:
            raise LibraryUnsupported(f"PyTorch {ops.version} was built without flash attention")
        check_torch_flash_schemas(_schema(ops.fwd), _schema(ops.bwd))
        return SimpleNamespace(version=version, fwd=ops.fwd, bwd=ops.bwd)

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        return (check_cuda(device, dtype, self.DTYPES, (8, 0), "PyTorch flash attention")
                or check_head_dim(head_dim, 8, 256, "PyTorch flash attention"))

    def _fwd(self, q, k, v, call, scale, causal):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        res = lib.fwd(q, k, v, cu_q, cu_k, max(call.max_q, 2), call.max_k, 0.0, causal, False,
                      scale=float(scale))
        out, lse, rng_state, unused = res[0], res[1], res[2], res[3]
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"torch {torch.__version__}: _flash_attention_forward returned an LSE of "
                               f"shape {tuple(lse.shape)}; expected [heads, total_q] = "
                               f"{[q.shape[1], q.shape[0]]}")
        return out, lse, (rng_state, unused)

    def _bwd(self, grad_out, q, k, v, out, lse, call, scale, state, causal):
        lib = self.lib()
        cu_q, cu_k = call.cu_tensors(q.device)
        rng_state, unused = state
        return lib.bwd(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max(call.max_q, 2),
                       call.max_k, 0.0, causal, rng_state, unused, scale=float(scale))

    def varlen_fwd(self, q, k, v, call, scale):
        return self._fwd(q, k, v, call, scale, call.causal)

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        return self._bwd(grad_out, q, k, v, out, lse, call, scale, state, call.causal)

    def copy_attention(self, q, k, v, prefix_k, prefix_v, meta, scale):
        call = copy_call(tuple(meta.cu_seqlens), tuple(meta.seq_slot), tuple(p.shape[0] for p in prefix_k))
        kk, vv = gather_copy_kv(k, v, prefix_k, prefix_v, meta)
        return _CopyFn.apply(self, call, scale, q, kk, vv)
