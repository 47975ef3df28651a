"""What a Mamba-2 layer (HybridModel `M`: input norm, MambaMixer, residual add) saves for backward
on a GPU, from mamba-ssm's and causal-conv1d's source: `mamba_mixer_bytes` (MixerBytes,
memory_model_mixers.py) and the exact count of one layer forward, `mamba_row_bytes`.

[Note: Mamba-2 saved tensors] Read in megatron-core 0.19.2 (ssm/mamba_mixer.py), mamba-ssm
v2.3.2.post1 (mamba_ssm/ops/triton/ssd_combined.py, layernorm_gated.py; the same
`save_for_backward` lists in v2.2.6.post3 - v2.3.2.post1 and main at e9594ce) and causal-conv1d
1.7.0 (causal_conv1d_interface.py, cpp_functions.py; the same in 1.4.0 - 1.6.1). Widths: h hidden,
H heads of P, G groups of state N, dim = H P, conv channels ch = dim + 2 G N, in-projection
d_in = 2 dim + 2 G N + H, conv width W, scan chunk Q; act = activation bytes, fp32 = 4.
- Both paths: the input norm (Megatron's local RMSNorm, as memory_model.ActivationModel counts
  it: input, normalised input, output = the in-projection's input; fp32 rstd): act 3h + 4; the
  gated RMSNorm after the scan (LayerNormFn: its input, fp32 rstd per group) and
  the out-projection's input: act 2 dim + 4 G; per layer call -exp(A_log) and exp's output (fp32
  H each; bf16 parameters: dt_bias.float() too).
- "stock" (Megatron's dense training, use_mamba_mem_eff_path): one fused
  MambaSplitConv1dScanCombinedFn over the row; it saves zxbcdt (act d_in), out_x (the scan's
  output before the z gate, act dim), A, D, dt_bias (its conv output, chunk states and dA_cumsum are recomputed
  in backward). Per token act (3h + d_in + 3 dim) + 4 (1 + G).
- "reuse" (megatron_patches/runtime/mamba_hooks.py: every row of a reuse step, one call pair per
  packed sequence): CausalConv1dFn on [cached tail; segment] saves that window (act ch per token,
  W - 1 more per sequence); MambaChunkScanCombinedFn saves out_x (act dim), x, dt, dA_cumsum
  (fp32 [H, ceil(T/Q) Q]: a sequence of T tokens pads to whole chunks), A, B, C, D, z, dt_bias
  and initial_states (a view of the cache's state: counted as cache by memory_model_state, not
  here). The hook hands the scan contiguous copies of x, B, C (act ch) and of z, dt (act
  dim + H), so neither the conv output nor zxBCdt stays alive through views (and offload never
  copies a view's span of them apart). Per token act (3h + 2 ch + 4 dim + H) + 4 (1 + G + H):
  act ch + 4 H more than stock.
- A prefix whose stage stops in this layer (the reuse hook raises PrefixForwardDone after the
  scan) keeps all of that but the gated norm and the out-projection: act 2 dim + 4 G less.
tests/test_memory_mamba.py holds `mamba_row_bytes` to the bytes the saved-tensor accounting
(prefix_schedule.runtime.memory) counts for a real Megatron MambaLayer on CPU whose kernels are
fakes that save exactly what the source above saves (tests/mamba_saved_fake.py), fp32 and bf16
(bf16 parameters as Megatron builds them: A_log and D fp32, dt_bias bf16; on CPU torch's input
norm also up-casts its saved input to fp32, which this count, like ActivationModel's, leaves out).
"""
from __future__ import annotations

from typing import Sequence

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model_mixers import MixerBytes

__all__ = ["MAMBA_PATHS", "mamba_mixer_bytes", "mamba_row_bytes"]

MAMBA_PATHS = ("reuse", "stock")
"""reuse: the state hook's conv + scan per packed sequence; stock: Megatron's fused dense op."""
FP32 = 4


def _check(dims: ModelDims, act_bytes: int, path: str) -> None:
    if not isinstance(dims, ModelDims):
        raise ValueError(f"dims={dims!r}; give a flops.ModelDims")
    if isinstance(act_bytes, bool) or act_bytes not in (2, 4):
        raise ValueError(f"act_bytes={act_bytes!r}; give 2 (bf16) or 4 (fp32)")
    if path not in MAMBA_PATHS:
        raise ValueError(f"path={path!r}; choose one of {MAMBA_PATHS}")


def _widths(dims: ModelDims):
    heads, groups = dims.mamba_num_heads, dims.mamba_num_groups
    dim = heads * dims.mamba_head_dim
    bc = 2 * groups * dims.mamba_state_dim
    return heads, groups, dim, dim + bc, 2 * dim + bc + heads  # H, G, dim, ch, d_in


def _terms(dims: ModelDims, a: int, path: str):
    """(per token whole layer, per token to the state, per layer call) bytes."""
    h = dims.hidden_size
    heads, groups, dim, ch, d_in = _widths(dims)
    norm = a * 3 * h + FP32  # input norm (its output is the in-projection's input)
    after_scan = a * 2 * dim + FP32 * groups  # gated norm input and rstd, out_proj input
    if path == "stock":
        whole = norm + a * (d_in + dim) + after_scan  # zxBCdt, out_x
        to_state = whole  # stock runs no prefix phase
    else:  # z and dt copies, the conv window, x B C copies, out_x; dA_cumsum
        to_state = norm + a * (dim + heads + 2 * ch + dim) + FP32 * heads
        whole = to_state + after_scan
    per_call = FP32 * heads * (2 if a == FP32 else 3)  # exp(A_log), A (+ dt_bias.float())
    return whole, to_state, per_call


def _sequence_extra(dims: ModelDims, a: int, length: int) -> int:
    """Reuse path, one packed sequence of `length` tokens: the conv window's W - 1 leading
    steps, dA_cumsum's padding to whole chunks."""
    heads, _, _, ch, _ = _widths(dims)
    chunk = dims.mamba_chunk_size
    padded = -(-length // chunk) * chunk
    return (dims.mamba_conv_kernel_dim - 1) * ch * a + FP32 * heads * (padded - length)


def mamba_mixer_bytes(dims: ModelDims, act_bytes: int, *, path: str = "reuse") -> MixerBytes:
    """Saved-for-backward bytes of one Mamba-2 layer at TP = 1 ([Note: Mamba-2 saved tensors]).

    `path`: "reuse" (every row of a reuse step) or "stock" (Megatron's dense step: fewer bytes,
    its fused op recomputes the conv). `per_sequence` is an upper bound: dA_cumsum's padding at
    its most (Q - 1 steps) and the per-call fp32 tensors once per sequence; `mamba_row_bytes` is
    exact, and equals per_token x T + per_sequence for one sequence of T = 1 (mod Q) tokens."""
    _check(dims, act_bytes, path)
    whole, to_state, per_call = _terms(dims, act_bytes, path)
    per_sequence = per_call
    if path == "reuse":
        per_sequence += _sequence_extra(dims, act_bytes, 1)  # W-1 steps, Q-1 padded steps
    return MixerBytes(per_token=whole, to_state_per_token=to_state, per_sequence=per_sequence)


def mamba_row_bytes(dims: ModelDims, act_bytes: int, lengths: Sequence[int], *,
                    path: str = "reuse", to_state: bool = False) -> int:
    """Exact bytes one Mamba-2 layer forward saves on a row of packed sequences of `lengths`
    tokens (the reuse hook's segments; "stock": one unpacked row, one length). `to_state`: a
    prefix row that stops in this layer once its state is made (reuse only)."""
    _check(dims, act_bytes, path)
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                          for n in lengths):
        raise ValueError(f"lengths={lengths!r}; give the row's sequence lengths, ints >= 1")
    if path == "stock" and (len(lengths) != 1 or to_state):
        raise ValueError("path='stock' counts one unpacked dense row (one length, no prefix "
                         "stop): Megatron's dense step feeds whole rows")
    whole, state, per_call = _terms(dims, act_bytes, path)
    total = sum(lengths) * (state if to_state else whole) + per_call
    if path == "reuse":
        total += sum(_sequence_extra(dims, act_bytes, n) for n in lengths)
    return int(total)
