"""Which replicated parameters' gradients Megatron's finalize_model_grads must also sum over TP.

[Note: replicated weights with partial gradients]
A weight replicated on every TP rank normally sees the same full activations on every rank, so
its gradient is already whole. A Gated DeltaNet layer's `out_norm` is the exception: one RMSNorm
weight shared by all value heads, while each TP rank holds only its own heads' outputs, so each
rank's gradient is the sum over its local heads only. Megatron's
`_allreduce_non_tensor_model_parallel_grads` sums over TP only sequence-parallel weights (under
sequence parallelism) and q/k norms, so without sequence parallelism (or with our CPU torch
norms, which carry no `sequence_parallel` flag) the ranks' copies drift apart and the norm's
gradient is not the TP=1 one (issue 36). The tp-grad-sum-hook patch asks `tp_grad_sum_hook`
for every parameter Megatron's own rule did not take; it names the GDN out_norm weights.
tests/test_tp_replicated_grads.py: every replicated gradient equal on both TP=2 ranks and equal
to TP=1's, for Llama, Qwen3, the Qwen3.5 GDN hybrid and the Nemotron-H Mamba hybrid (MoE at
TP > 1 needs sequence parallelism, where Megatron's own rule sums the norms: not in that test).
"""
from __future__ import annotations

__all__ = ["tp_grad_sum_hook"]


def tp_grad_sum_hook(config, name: str, param) -> bool:
    """True for a GDN layer's out_norm weight (replicated, partial gradient per TP rank)."""
    del config
    return ".out_norm." in f".{name}" and not getattr(param, "tensor_model_parallel", False)
