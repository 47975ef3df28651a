"""The "math" backend: plain torch math (no fused kernel), any device and dtype. The last resort:
memory O(L_q x L_k) per run of equal-shape entries."""
from __future__ import annotations

from prefix_schedule.attention.backends.math_kernels import math_bwd, math_fwd
from prefix_schedule.attention.backends.torch_cpu import LoopBackend

__all__ = ["MathBackend", "math_bwd", "math_fwd"]


class MathBackend(LoopBackend):
    """Plain torch math on any device; copy/causal modes through public SDPA."""

    name = "math"
    install_hint = "nothing: plain torch"

    def kernels(self):
        return math_fwd, math_bwd
