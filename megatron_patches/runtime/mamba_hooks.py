"""The Mamba-2 state hook: Megatron's `MambaMixer._ssm_training` asks it for the fused
conv + scan it would call (`mamba_split_conv1d_scan_combined`; the mamba-state-hook patch).

Inert without a reuse context (returns None: the stock call runs). In a reuse step the row is cut
into segments exactly as for Gated DeltaNet (megatron_patches/runtime/gdn_hooks.py; [Note: recurrent
prefix state] in prefix_schedule/runtime/state_cache.py), each run from its own state:
* "conv": the causal conv's last kernel_size - 1 raw xBC inputs (channels x, B, C), as
  `[1, W-1, conv channels]`. The conv runs on [tail; segment] and drops its first W-1 outputs,
  so the library's own `causal_conv1d_fn` serves (no initial-state layout constraint) and the
  tail's gradient comes from its dx.
* "ssm": the SSD state `[1, heads, head_dim, d_state]` (fp32 in the kernels), passed as
  `initial_states` to the library's `mamba_chunk_scan_combined` with `return_final_states`
  (mamba-ssm 2.3.x returns dinitial_states and takes dfinal_states: ssd_combined.py).
With BATCH_SEGMENTS, a suffix row's segments (no state to store) run as ONE padded [N, Lmax]
batch, one call of each kernel with per-row initial states (_batched; exact,
tests/test_batched_hybrid.py against the per-segment path _per_segment; off by default until the
saved-bytes model counts the padding). Each segment computes what the fused op computes with Megatron's arguments (no
rmsnorm_weight, no outproj_weight): y = scan(x) + D x, times silu(z); Megatron's own code goes on
with its grouped norm and out-projection. Under full recompute both states go through the GDN
hooks' `keep_state`: Phase A stores them without a graph, and Phase C's re-run (HybridStack's
checkpointed forward) hands the recomputed ones their accumulated gradients ([Note: prefix full
recompute]; tests/test_hybrid_recompute.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from prefix_schedule.runtime.context import (
    PrefixForwardContext,
    PrefixForwardDone,
    current_context,
)

from megatron_patches.runtime.gdn_hooks import (CONV_STATE, _bounds, _read, _segments, conv_window,
                                                keep_state)

__all__ = ["mamba_state_hook", "CONV_STATE", "SSM_STATE"]
# CONV_STATE ("conv": [1, kernel_size - 1, conv channels] raw xBC inputs) is the GDN hooks'

SSM_STATE = "ssm"
"""Cache name of a Mamba layer's SSD state: [1, heads, head_dim, d_state]."""
BATCH_SEGMENTS = False
"""True: run a suffix row's segments as one padded batch (_batched, exact; tests/
test_batched_hybrid.py). Off by default: the kernels then save N x Lmax rows instead of the
segments' sum, which the saved-bytes model (prefix_schedule/planning, held to the byte by
tests/test_memory_mamba.py) does not count yet; False runs one call pair per segment."""


def mamba_state_hook(module):
    """`_mamba_state_hook(self)` in Megatron's `MambaMixer._ssm_training`: a stand-in for
    `mamba_split_conv1d_scan_combined` in a reuse step, else None (stock)."""
    context = current_context()
    if context is None:
        return None
    if context.cp is not None:
        raise ValueError("Mamba layers with context parallelism are not supported in prefix "
                         "reuse steps; train with context_parallel_size=1")
    return functools.partial(_split_conv_scan, module, context,
                             _segments(context, module.layer_number))


def _split_conv_scan(module, context, segments, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A,
                     D=None, chunk_size=None, activation="silu", headdim=None, ngroups=1,
                     norm_before_gate=False, seq_idx=None, rmsnorm_weight=None,
                     outproj_weight=None, **kernel_kwargs):
    from megatron.core.ssm import mamba_mixer

    if mamba_mixer.causal_conv1d_fn is None or mamba_mixer.mamba_chunk_scan_combined is None:
        raise ValueError("prefix reuse of Mamba layers runs their conv and scan through "
                         "causal-conv1d's causal_conv1d_fn and mamba-ssm's "
                         "mamba_chunk_scan_combined: install causal-conv1d (>= 1.4) and mamba-ssm "
                         "(2.3.x), or on CPU call megatron_patches.enable_cpu_support() first")
    if rmsnorm_weight is not None or outproj_weight is not None or seq_idx is not None:
        raise AssertionError("Megatron's _ssm_training passes no norm, out-projection or seq_idx "
                             "here (reuse rows carry their own sequence layout)")
    if zxbcdt.shape[0] != 1:
        raise AssertionError("reuse rows are packed into batch size 1")
    heads = D.shape[0]
    headdim = D.shape[1] if D.dim() == 2 else headdim
    dim = heads * headdim
    dstate = (zxbcdt.shape[-1] - 2 * dim - heads) // ngroups // 2
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, heads], dim=-1)
    layer, width = module.layer_number, conv1d_weight.shape[-1]
    bounds = _bounds(context, segments, zxbcdt.shape[1])
    shape = _Shape(heads=heads, headdim=headdim, dim=dim, ngroups=ngroups, dstate=dstate,
                   width=width, chunk_size=chunk_size, activation=activation)
    run = _batched if BATCH_SEGMENTS and len(bounds) > 1 and not any(s.store for s, _, _ in bounds) \
        else _per_segment
    out = run(mamba_mixer, context, layer, bounds, shape, z, xbc, dt, conv1d_weight, conv1d_bias,
              dt_bias, A, D, kernel_kwargs)
    if (isinstance(context, PrefixForwardContext) and not context.recomputing
            and context.stop_after_layer == layer and not context.stop_in_router):
        raise PrefixForwardDone()
    return out


@dataclasses.dataclass(frozen=True)
class _Shape:
    heads: int
    headdim: int
    dim: int
    ngroups: int
    dstate: int
    width: int
    chunk_size: int
    activation: str


def _split_xbc(conv, shape):
    """x, B, C of the conv output [N, L, channels], as contiguous copies: views would keep the
    whole conv output alive (and offload would copy each view's span of it apart)."""
    return (t.contiguous() for t in torch.split(
        conv, [shape.dim, shape.ngroups * shape.dstate, shape.ngroups * shape.dstate], dim=-1))


def _per_segment(lib, context, layer, bounds, shape, z, xbc, dt, weight, bias, dt_bias, A, D, kw):
    """One causal_conv1d_fn and one mamba_chunk_scan_combined call per segment (the reference
    for _batched; the path for rows whose segments store a prefix state)."""
    width, outs = shape.width, []
    for segment, a, b in bounds:
        window = conv_window(context, layer, segment, xbc[:, a:b], width)  # [1, W-1+L, ch]
        conv = lib.causal_conv1d_fn(window.transpose(1, 2), weight, bias, activation=shape.activation)
        x, bmat, cmat = _split_xbc(conv[..., width - 1:].transpose(1, 2), shape)  # [1, L, ...]
        length = b - a
        state = _read(context, layer, segment.read, SSM_STATE)
        result = lib.mamba_chunk_scan_combined(
            x.reshape(1, length, shape.heads, shape.headdim), dt[:, a:b].contiguous(), A,
            bmat.reshape(1, length, shape.ngroups, shape.dstate),
            cmat.reshape(1, length, shape.ngroups, shape.dstate), shape.chunk_size, D=D,
            z=z[:, a:b].contiguous().reshape(1, length, shape.heads, shape.headdim),
            dt_bias=dt_bias, dt_softplus=True, initial_states=state,
            return_final_states=segment.store, **kw)
        y, final = result if segment.store else (result, None)
        if segment.store:
            y = keep_state(context, layer, SSM_STATE, final, y, num_tokens=length)
        outs.append(y.reshape(1, length, shape.dim))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _pad_rows(rows, length: int) -> torch.Tensor:
    """[1, L_i, C] pieces as one [N, length, C] batch, zeros after each piece (differentiable)."""
    return torch.cat([F.pad(r, (0, 0, 0, length - r.shape[1])) for r in rows])


def _batched(lib, context, layer, bounds, shape, z, xbc, dt, weight, bias, dt_bias, A, D, kw):
    """The row's segments padded into one [N, Lmax] batch, each row from its own states: one
    causal_conv1d_fn and one mamba_chunk_scan_combined call. Exact for the real positions: both
    are causal along the sequence (an output depends on inputs at or before it), each row starts
    at position 0 as in the per-segment call (same chunk boundaries), and the padding's outputs
    are sliced off (their gradient is zero). Only for rows whose segments store no state: a
    padded row's final state would include the padding (dt_softplus makes its decay non-zero)."""
    width = shape.width
    lengths = [b - a for _, a, b in bounds]
    longest, n = max(lengths), len(lengths)
    windows = [conv_window(context, layer, segment, xbc[:, a:b], width) for segment, a, b in bounds]
    conv = lib.causal_conv1d_fn(_pad_rows(windows, width - 1 + longest).transpose(1, 2), weight,
                                bias, activation=shape.activation)
    x, bmat, cmat = _split_xbc(conv[..., width - 1:].transpose(1, 2), shape)  # [N, Lmax, ...]
    states = [_read(context, layer, segment.read, SSM_STATE) for segment, _, _ in bounds]
    known = [s for s in states if s is not None]
    initial = None if not known else torch.cat(
        [torch.zeros_like(known[0]) if s is None else s.to(known[0].dtype) for s in states])
    y = lib.mamba_chunk_scan_combined(
        x.reshape(n, longest, shape.heads, shape.headdim),
        _pad_rows([dt[:, a:b] for _, a, b in bounds], longest), A,
        bmat.reshape(n, longest, shape.ngroups, shape.dstate),
        cmat.reshape(n, longest, shape.ngroups, shape.dstate), shape.chunk_size, D=D,
        z=_pad_rows([z[:, a:b] for _, a, b in bounds], longest).reshape(
            n, longest, shape.heads, shape.headdim),
        dt_bias=dt_bias, dt_softplus=True, initial_states=initial, return_final_states=False, **kw)
    y = y.reshape(n, longest, shape.dim)
    return torch.cat([y[i:i + 1, :length] for i, length in enumerate(lengths)], dim=1)
