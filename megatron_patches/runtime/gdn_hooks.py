"""The Gated DeltaNet state hook: Megatron's `GatedDeltaNet.forward` asks it for its short causal
conv and its gated delta rule (the gdn-state-hook source patch).

Inert without a reuse context (returns None: the stock calls run). In a reuse step the row is cut
into segments, each run from its own initial state ([Note: recurrent prefix state] in
prefix_schedule/runtime/state_cache.py):
* a prefix row: its real tokens from zeros (chunk 0) or the state after its earlier chunks, then
  the row's padding from zeros; the state at the end of the real tokens -- the conv's last
  kernel_size - 1 raw inputs ("conv") and the rule's final state ("rule") -- goes to the cache;
* a suffix row: every packed sequence from its own group's cached state (zeros for a sequence
  run whole or the padding), so one row may hold several groups.
The conv of a suffix row is one varlen call of fla's causal_conv1d with the cached tails as
per-sequence initial states (the stock kernel on the fla path); elsewhere it runs in torch, every
segment's window (its tail prepended) padded into one batch and one depthwise F.conv1d call; the rule is the layer's own kernel (`self.gated_delta_rule`), called per segment with
`initial_state` / `output_final_state`, whose backward returns the initial state's gradient.
Under full recompute Phase A stores the states without a graph, and Phase C's re-run attaches
their accumulated gradients to the recomputed ones (`keep_state`; [Note: prefix full recompute]).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from prefix_schedule.runtime.context import (
    PrefixForwardContext,
    PrefixForwardDone,
    current_context,
)

__all__ = ["gdn_state_hook", "conv_window", "keep_state", "CONV_STATE", "RULE_STATE"]

CONV_STATE = "conv"
"""Cache name of a GDN layer's conv tail: [B=1, kernel_size - 1, conv channels] raw inputs."""
RULE_STATE = "rule"
"""Cache name of a GDN layer's recurrent state: [1, HV, K, V] (the rule's dtype, fp32)."""

_RULE_ARGS = ("q", "k", "v", "g", "beta")
BATCH_SEGMENTS = True
"""One padded conv call per row (see _conv); False: one per segment (the tests' reference)."""


def gdn_state_hook(module, site: str):
    """`_gdn_state_hook(self, site)` in Megatron's GDN forward: a replacement for the conv
    (`site == "conv"`) or the delta rule (`"rule"`) in a reuse step, else None (stock)."""
    context = current_context()
    if context is None:
        return None
    if context.cp is not None:
        raise ValueError("Gated DeltaNet layers with context parallelism are not supported in "
                         "prefix reuse steps; train with context_parallel_size=1")
    segments = _segments(context, module.layer_number)
    if site == "conv":
        return functools.partial(_conv, module, context, segments)
    if site == "rule":
        return functools.partial(_rule, module, context, segments)
    raise AssertionError(f"unknown GDN hook site {site!r}")


class _Segment:
    """Rows [start, end) of the row, the state they start from (None: zeros), and whether the
    state at their end is a prefix state to cache."""

    def __init__(self, start: int, end: int, read: Optional[dict], store: bool):
        self.start, self.end, self.read, self.store = start, end, read, store


def _segments(context, layer: int) -> List[_Segment]:
    if isinstance(context, PrefixForwardContext):
        if context.packed:
            raise ValueError("packed prefix rows with Gated DeltaNet layers are not supported")
        read = None
        if context.chunk > 0:
            read = dict(group=context.group, before_chunk=context.chunk, chunks=context.reads)
        return [_Segment(0, None, read, store=True)]  # end: the row's real tokens (see _bounds)
    cu = context.meta.cu_seqlens
    groups = context.sequence_groups
    reads = context.slot_reads
    out = []
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        group = groups[i] if i < len(groups) else None
        read = None
        if group is not None:
            read = dict(group=group)
            if reads is not None and reads[context.meta.seq_slot[i]] is not None:
                chunks, length = reads[context.meta.seq_slot[i]]
                read.update(chunks=chunks, length=length)
        out.append(_Segment(a, b, read, store=False))
    return out


def _bounds(context, segments, length: int) -> List[Tuple[_Segment, int, int]]:
    """(segment, start, end) over a row of `length` tokens; a prefix row's padding (never
    cached) is its own segment from zeros."""
    if isinstance(context, PrefixForwardContext):
        real = length - context.padding
        out = [(segments[0], 0, real)]
        if context.padding:
            out.append((_Segment(real, length, None, store=False), real, length))
        return out
    if segments[-1].end != length:
        raise AssertionError(f"suffix row of {length} tokens, packed layout ends at "
                             f"{segments[-1].end}")
    return [(s, s.start, s.end) for s in segments]


def _read(context, layer: int, read: Optional[dict], name: str) -> Optional[torch.Tensor]:
    if read is None:
        return None
    return context.cache.read_state(read["group"], layer, name,
                                    before_chunk=read.get("before_chunk"),
                                    chunks=read.get("chunks"), length=read.get("length"))


def conv_window(context, layer: int, segment, x: torch.Tensor, width: int) -> torch.Tensor:
    """[cached conv tail (zeros without one); x] for a depthwise causal conv of `width` over the
    segment x [1, T, D]; a prefix segment's last W-1 raw inputs go to the cache as its tail
    ("conv", [Note: recurrent prefix state]). Shared by the GDN and Mamba hooks."""
    tail = _read(context, layer, segment.read, CONV_STATE)
    if tail is None:
        tail = x.new_zeros((1, width - 1, x.shape[-1]))
    window = torch.cat([tail.to(x.dtype), x], dim=1)  # [1, W-1+T, D]
    if segment.store:
        # a cached copy: a view would keep the whole window's storage alive with the cache (and
        # on the device under offload, which keeps every storage the cache shares)
        window = keep_state(context, layer, CONV_STATE, window[:, window.shape[1] - (width - 1):],
                            window, num_tokens=x.shape[1], copy=True)
    return window


def keep_state(context, layer: int, name: str, state: torch.Tensor, out: torch.Tensor, *,
               num_tokens: int, copy: bool = False) -> torch.Tensor:
    """The state `name` a prefix segment of `num_tokens` tokens reached (`state`, computed along
    with the layer's `out`); returns `out`. Phase A stores it (a copy if `copy`). Phase C under
    full recompute ([Note: prefix full recompute] in docs/DESIGN.md): a re-run with Megatron's
    checkpoints ("inject") returns `out` through `inject_state_grad` wherever it runs with grad
    (CheckpointFunction's recompute in backward), so the state's accumulated gradient enters
    that backward; a whole re-run ("replay") binds `state` to the entry; any other recompute
    leaves the cache alone. Shared by the GDN and Mamba hooks."""
    cache, group, chunk = context.cache, context.group, context.chunk
    if context.inject:
        if torch.is_grad_enabled():
            return cache.inject_state_grad(group, layer, name, out, state, chunk=chunk)
    elif context.replay:
        cache.rebind_state(group, layer, name, state.clone() if copy else state, chunk=chunk)
    elif not context.recomputing:
        cache.store_state(group, layer, name, state.clone() if copy else state, chunk=chunk,
                          num_tokens=num_tokens)
    return out


def _conv(module, context, segments, qkv, weight, bias):
    """The GDN short causal conv + activation over qkv [1, T, D]. A row whose segments store no
    state (suffix rows) on fla's path: ONE varlen `causal_conv1d` call with each segment's cached
    tail as its initial state (_fla_varlen_conv); in deterministic mode every segment's window
    ([cached tail or zeros; segment]) right-padded into one [N, D, W-1+Lmax] batch and ONE
    depthwise F.conv1d (exact: the conv is causal, the padding only reaches outputs that are
    sliced off). Rows that store a tail (prefix rows), and BATCH_SEGMENTS False (the tests'
    reference): one F.conv1d per segment."""
    if qkv.shape[0] != 1:
        raise AssertionError("reuse rows are packed into batch size 1")
    layer, width = module.layer_number, weight.shape[-1]
    bounds = _bounds(context, segments, qkv.shape[1])
    fla_conv = _fla_conv(module)
    if BATCH_SEGMENTS and fla_conv is not None and not any(s.store for s, _, _ in bounds):
        return _fla_varlen_conv(fla_conv, module, context, bounds, qkv, weight, bias)
    windows = [conv_window(context, layer, segment, qkv[:, a:b], width) for segment, a, b in bounds]
    if BATCH_SEGMENTS and len(windows) > 1 and not any(s.store for s, _, _ in bounds):
        lengths = [b - a for _, a, b in bounds]
        longest = width - 1 + max(lengths)
        padded = torch.cat([F.pad(w, (0, 0, 0, longest - w.shape[1])) for w in windows])
        y = module.act_fn(F.conv1d(padded.transpose(1, 2), weight, bias, groups=qkv.shape[-1]))
        y = y.transpose(1, 2)  # [N, Lmax, D]
        return torch.cat([y[i:i + 1, :length] for i, length in enumerate(lengths)], dim=1)
    outs = [module.act_fn(F.conv1d(w.transpose(1, 2), weight, bias, groups=qkv.shape[-1])).transpose(1, 2)
            for w in windows]
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _fla_conv(module):
    """fla's causal_conv1d as Megatron's GDN module calls it (its stock non-deterministic conv
    with a silu/swish activation), else None."""
    if module.config.deterministic_mode or getattr(module, "activation", None) not in ("silu", "swish"):
        return None
    from megatron.core.ssm.gated_delta_net import gdn

    return getattr(gdn, "causal_conv1d", None)


def _fla_varlen_conv(fla_conv, module, context, bounds, qkv, weight, bias):
    """One fla `causal_conv1d(x, weight [D, W], bias, activation, initial_state [N, D, W],
    cu_seqlens)` call: fla-core's Triton kernel (fla/modules/conv/triton/kernels.py) reads
    initial_state[n, :, t + W] for the inputs at t = -(W-1) .. -1 of sequence n (index 0 is never
    read), and its backward returns the initial state's gradient (the tails' gradient)."""
    layer, width = module.layer_number, weight.shape[-1]
    dim = qkv.shape[-1]
    states = []
    for segment, _, _ in bounds:
        tail = _read(context, layer, segment.read, CONV_STATE)  # [1, W-1, D] or None
        if tail is None:
            states.append(qkv.new_zeros((1, dim, width)))
        else:
            states.append(F.pad(tail.to(qkv.dtype).transpose(1, 2), (1, 0)))  # [1, D, W]
    cu = _cu_seqlens(bounds, qkv.device)
    out, _ = fla_conv(x=qkv, weight=weight.reshape(dim, width), bias=bias,
                      activation=module.activation, initial_state=torch.cat(states),
                      output_final_state=False, cu_seqlens=cu)
    return out


def _rule(module, context, segments, *args, initial_state=None, output_final_state=False,
          cu_seqlens=None, **kwargs):
    """The layer's gated delta rule over the row's segments, each from its own state."""
    if initial_state is not None or cu_seqlens is not None:
        raise AssertionError("the stock GDN call passes no state and no cu_seqlens here")
    inputs = dict(zip(_RULE_ARGS, args))
    for name in _RULE_ARGS:
        if name in kwargs:
            inputs[name] = kwargs.pop(name)
    layer = module.layer_number
    bounds = _bounds(context, segments, inputs["q"].shape[1])
    states = [_read(context, layer, segment.read, RULE_STATE) for segment, _, _ in bounds]
    if _is_torch_rule(module.gated_delta_rule):  # deterministic mode: no cu_seqlens
        outs, finals = [], []
        for (_, a, b), state in zip(bounds, states):
            out, final = module.gated_delta_rule(
                **{n: t[:, a:b] for n, t in inputs.items()}, initial_state=state,
                output_final_state=True, **kwargs)
            outs.append(out)
            finals.append(final)
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        final = torch.cat(finals)
    else:  # fla's varlen contract: one call, one initial state per packed sequence
        out, final = module.gated_delta_rule(
            **inputs, initial_state=_initial_states(states, inputs),
            output_final_state=True, cu_seqlens=_cu_seqlens(bounds, inputs["q"].device),
            **kwargs)
    for n, (segment, a, b) in enumerate(bounds):
        if segment.store:
            out = keep_state(context, layer, RULE_STATE, final[n:n + 1], out, num_tokens=b - a)
    if (isinstance(context, PrefixForwardContext) and not context.recomputing
            and context.stop_after_layer == layer and not context.stop_in_router):
        raise PrefixForwardDone()
    return out, None


def _is_torch_rule(rule) -> bool:
    from megatron.core.ssm.gated_delta_net.gdn import torch_chunk_gated_delta_rule

    return rule is torch_chunk_gated_delta_rule


def _initial_states(states, inputs) -> torch.Tensor:
    """[N, HV, K, V] fp32: each segment's cached state, zeros where it starts fresh."""
    q, v = inputs["q"], inputs["v"]
    zeros = q.new_zeros((1, v.shape[2], q.shape[-1], v.shape[-1]), dtype=torch.float32)
    return torch.cat([zeros if s is None else s.to(torch.float32) for s in states])


def _cu_seqlens(bounds, device) -> torch.Tensor:
    return torch.tensor([0] + [b for _, _, b in bounds], dtype=torch.long, device=device)
