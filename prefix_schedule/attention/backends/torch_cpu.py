"""The "torch" backend: PyTorch's fused CPU flash-attention op, one call per run of equal-shape
entries (a run of adjacent n-token suffixes is a [count, H, n, D] view, no copy)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import (Backend, acc_dtype, sdpa_causal_attention,
                                                      sdpa_copy_attention)
from prefix_schedule.attention.backends.math_kernels import math_bwd, math_fwd

__all__ = ["LoopBackend", "TorchCpuBackend", "cpu_flash_bwd", "cpu_flash_fwd"]


# Dense kernels take [B, H, L, D] (kv heads may divide query heads) and return out and a
# natural-log LSE [B, H, L]; `causal` is only used with square inputs.
def cpu_flash_fwd(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def cpu_flash_bwd(g, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, causal, scale=scale)


def _run_view(x: torch.Tensor, start: int, n: int, count: int) -> torch.Tensor:
    """`count` adjacent n-row blocks of a [T, H, ...] buffer as a [count, H, n, ...] view."""
    return x[start:start + n * count].unflatten(0, (count, n)).transpose(1, 2)


def _lse_view(lse: torch.Tensor, start: int, n: int, count: int) -> torch.Tensor:
    """The same rows of an [H, T] LSE as a [count, H, n] view."""
    return lse[:, start:start + n * count].unflatten(1, (count, n)).transpose(0, 1)


class LoopBackend(Backend):
    """Varlen calls as one dense kernel call per run (VarlenCall.runs); copy and causal modes
    through public SDPA. Subclasses give the dense kernels. A windowed call (VarlenCall.window)
    runs the math kernels with the band mask: PyTorch's CPU flash op takes no window; the
    windowed part P is at most W x W per suffix ([Note: sliding windows] in two_part.py)."""

    supports_window = True

    def kernels(self):
        raise NotImplementedError

    def _kernels(self, call):
        if call.window is None:
            return self.kernels()
        w = call.window
        return (lambda *a: math_fwd(*a, window=w)), (lambda *a: math_bwd(*a, window=w))

    def varlen_fwd(self, q, k, v, call, scale):
        fwd, _ = self._kernels(call)
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype))
        for qs, ks, nq, nk, count in call.runs:
            rows = slice(qs, qs + nq * count)
            if nk == 0 or nq == 0:  # no keys: no attention mass
                out[rows] = 0
                lse[:, rows] = -math.inf
                continue
            o, l = fwd(*(_run_view(x, s, n, count) for x, s, n in ((q, qs, nq), (k, ks, nk), (v, ks, nk))),
                       call.causal, scale)
            out[rows] = o.transpose(1, 2).flatten(0, 1)
            _lse_view(lse, qs, nq, count).copy_(l)
        return out, lse, None

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call, scale, state):
        _, bwd = self._kernels(call)
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
        for qs, ks, nq, nk, count in call.runs:
            if nk == 0 or nq == 0:
                dq[qs:qs + nq * count] = 0
                dk[ks:ks + nk * count] = 0
                dv[ks:ks + nk * count] = 0
                continue
            q_side = (_run_view(x, qs, nq, count) for x in (grad_out, q))
            k_side = (_run_view(x, ks, nk, count) for x in (k, v))
            grads = bwd(*q_side, *k_side, _run_view(out, qs, nq, count),
                        _lse_view(lse, qs, nq, count), call.causal, scale)
            for buf, start, n, d in zip((dq, dk, dv), (qs, ks, ks), (nq, nk, nk), grads):
                buf[start:start + n * count] = d.transpose(1, 2).flatten(0, 1)
        return dq, dk, dv

    def copy_attention(self, q, k, v, prefix_k, prefix_v, meta, scale):
        return sdpa_copy_attention(q, k, v, prefix_k, prefix_v, meta, scale)

    def causal_attention(self, q, k, v, scale):
        return sdpa_causal_attention(q, k, v, scale)


class TorchCpuBackend(LoopBackend):
    """PyTorch's fused CPU flash-attention kernel (private aten op with a matching backward)."""

    name = "torch"
    install_hint = "nothing: it ships with PyTorch (CPU tensors only)"
    DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def kernels(self):
        return cpu_flash_fwd, cpu_flash_bwd

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        if device.type != "cpu":
            return f"the torch backend runs PyTorch's CPU flash kernel, got a {device.type} device"
        if dtype not in self.DTYPES:
            return f"the torch backend supports {self.DTYPES}, got {dtype}"
        return ""
