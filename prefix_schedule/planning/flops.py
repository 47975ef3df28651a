"""Analytic FLOP model of one training step, dense vs prefix reuse -> the ideal speedup.

What is counted (a matmul of [m, k] by [k, n] is 2*m*n*k FLOPs), per token and per layer, with
h = hidden_size, f = ffn_hidden_size, a = num_attention_heads, g = num_query_groups,
d = kv_channels (default h / a), V = vocab_size:

- QKV projection: 2 * h * (a*d + 2*g*d)
- attention output projection: 2 * a*d * h
- MLP: 2 * h * f * (2 if gated_linear_unit else 1) for fc1 (the gated unit doubles it) + 2 * f * h
- MoE layers (`num_experts` set: every layer is MoE): the MLP becomes the router 2 * h * E, plus
  k routed experts and the shared expert, each an MLP as above with its own inner width
  (`moe_ffn_hidden_size`, `moe_shared_ffn_hidden_size`); dropless top-k routing, so every token
  costs exactly k experts whatever the load
- output layer (once per token, not per layer): 2 * h * V
- attention products QK^T and PV: 2 * a*d per (query, key) pair each, i.e. 4 * a*d per pair.
  Only unmasked pairs count: a causal row of s tokens has s*(s+1)/2 pairs (the diagonal
  included); a suffix row of n tokens over c cached prefix keys has n*c + n*(n+1)/2. A
  sliding-window layer (`window_size` W, on the layers `window_attn_skip_freq` leaves windowed)
  counts only the pairs a window sees: min(p + 1, W + 1) keys for the token at position p.
  Attention sinks (softmax_type='learnable') add one logit per (query, head): not counted.

- Gated DeltaNet layers (`linear_attention_freq` set: layer i is softmax attention when
  (i+1) % freq == 0, GDN otherwise, Megatron's get_linear_attention_pattern), with HK/HV key/value
  heads of widths dk/dv and conv window W: in_proj 2*h*(2*HK*dk + 2*HV*dv + 2*HV), out_proj
  2*HV*dv*h, the depthwise conv 2*W*(2*HK*dk + HV*dv), and the delta rule 6*HV*dk*dv per token
  (read S with k, update S, read it with q). No pairs: a suffix costs the same whatever the cached
  length (it starts from the cached state).
- Mamba-2 layers (HybridModel `M`; megatron/core/ssm/mamba_mixer.py), with H heads of width P,
  state N, G groups, d_inner = H*P, conv window W, SSD chunk length Q: in_proj
  2*h*(2*d_inner + 2*G*N + H) (z, x, B, C, dt), the depthwise conv 2*W*(d_inner + 2*G*N), the
  SSD scan 4*H*P*N per token (chunk state B^T x and its read C.h) plus, per causal pair inside
  each chunk of Q tokens counted from the segment's first token, 2*G*N (C.B) + 2*H*P (the
  weighted x), and out_proj 2*d_inner*h. A suffix starts from the cached state: its own chunks,
  no pairs with the prefix. (Megatron-LM's training.py estimates the scan as 7*d_inner*N per
  token instead; this counts the SSD kernels' matmuls.)
- HybridModel patterns (`hybrid_pattern`): a layer is one symbol: `*` attention (QKV,
  output projection, pairs), `G` a GDN mixer, `M` a Mamba mixer, `-` an MLP, `E` an MoE MLP.
  A GPTModel layer is a mixer and an MLP. `attention_output_gate` widens QKV by a gate as wide as
  the queries: 2 * h * (2*a*d + 2*g*d).

Backward = 2 x forward, so every piece of work costs 3 x its forward FLOPs.
Ignored: norms, softmax, activation functions, RoPE, embeddings lookups, the loss, optimizer.

Dense: every trajectory's full row (P+n-1 tokens) runs through the whole model, output layer
included (prefix positions carry no loss but their logits are still computed in stock training).

Prefix trees (planning/tree.py): a trajectory's prompt is its node chain, and each cached node
runs once over its ancestors' keys (pairs n*c + n*(n+1)/2 as for a suffix row).

Reuse: each cached prefix (P-1 tokens) runs forward and backward only through what the K/V of
every layer need (DESIGN.md "[Note: prefix forward stops at the last cached K/V]"): the layers
before the last caching layer (`*`, `G`, `M`) fully and that layer's QKV projection (a GDN or
Mamba layer: its in_proj, conv and rule / scan, whose final state is what is cached); no
attention or MLP after it (a HybridModel's trailing `-` layers), no output layer.
With MoE the prefix forward stops after the last MoE layer's router instead when that comes
later (its statistics count, DESIGN.md "MoE"): that layer's mixer in full (attention, output
projection) and its router are counted too (no experts).
Every suffix row runs through the whole model, its attention also reading the group's cached keys;
a segment run dense is just its dense row. Row padding (planner.py, [Note: row padding]) counts as
overhead: a microbatch's padding as a row of its own, a prefix unit's as tokens over that unit's
real keys (an upper bound: on the last stage prefix rows stop early). Dense rows are counted
unpadded, so under sequence parallelism the ideal speedup is slightly conservative.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops_layers import (HYBRID_SYMBOLS, MAMBA, MIXERS, MOE,
                                                   layer_parts, mixer_forward, mixer_to_cache,
                                                   mlp_forward, router, layer_window)

__all__ = ["ModelDims", "dense_flops", "reuse_flops", "ideal_speedup"]


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The shape of a GPT model, as far as matmul FLOPs are concerned."""

    num_layers: int
    """Transformer layers L."""
    hidden_size: int
    """Model width h."""
    ffn_hidden_size: int
    """MLP inner width f (per branch of a gated unit)."""
    num_attention_heads: int
    """Query heads a."""
    num_query_groups: int
    """Key/value heads g (GQA); equal to num_attention_heads for multi-head attention."""
    vocab_size: int
    """Output-layer width V."""
    gated_linear_unit: bool
    """Whether fc1 has two branches (SwiGLU), doubling its FLOPs."""
    kv_channels: int | None = None
    """Per-head width d; None = hidden_size // num_attention_heads."""
    num_experts: int | None = None
    """MoE: routed experts E in every layer (None: dense MLP layers)."""
    moe_router_topk: int = 0
    """MoE: experts per token k."""
    moe_ffn_hidden_size: int | None = None
    """MoE: inner width of one routed expert (None: ffn_hidden_size)."""
    moe_shared_ffn_hidden_size: int = 0
    """MoE: inner width of the shared expert (0: none)."""
    linear_attention_freq: int | None = None
    """Gated DeltaNet hybrids (Qwen3-Next / Qwen3.5: 4): every freq-th layer is softmax attention,
    the others GDN; None: every layer is attention."""
    linear_num_key_heads: int = 16
    """GDN key heads HK (Qwen3-Next: 16)."""
    linear_num_value_heads: int = 32
    """GDN value heads HV (Qwen3-Next: 32)."""
    linear_key_head_dim: int = 128
    """GDN key head width dk."""
    linear_value_head_dim: int = 128
    """GDN value head width dv."""
    linear_conv_kernel_dim: int = 4
    """GDN short conv window W."""
    attention_output_gate: bool = False
    """Softmax-attention layers' output gate (Qwen3-Next / Qwen3.5): linear_qkv also produces a
    gate as wide as the queries."""
    hybrid_pattern: str | None = None
    """A HybridModel layer pattern, one symbol per layer (`*` attention, `-` MLP, `E` MoE, `G`
    Gated DeltaNet, `M` Mamba-2; no `|` or MTP part), len == num_layers; None: a GPTModel (every
    layer a mixer and an MLP)."""
    mamba_num_heads: int | None = None
    """Mamba-2 heads H; None: 2 * hidden_size // mamba_head_dim (Megatron's expand = 2)."""
    mamba_head_dim: int = 64
    """Mamba-2 head width P."""
    mamba_state_dim: int = 128
    """Mamba-2 state size N (Nemotron-H: 128)."""
    mamba_num_groups: int = 8
    """Mamba-2 B/C groups G (Nemotron-H: 8)."""
    mamba_conv_kernel_dim: int = 4
    """Mamba-2 causal conv window (MambaMixer's d_conv)."""
    mamba_chunk_size: int = 128
    """Mamba-2 SSD chunk length Q (MambaMixer's chunk_size)."""
    window_size: int | None = None
    """Sliding-window attention (gpt-oss): W of Megatron's window_size (W, 0), a token at
    position p sees keys p - W ... p; None: full causal attention."""
    window_attn_skip_freq: int | None = None
    """Megatron's rule: 1-based layer l is windowed unless l % freq == 0 (gpt-oss: 2, alternate
    layers); None: every attention layer is windowed when window_size is set."""

    def __post_init__(self) -> None:
        if self.linear_attention_freq is not None and (
                isinstance(self.linear_attention_freq, bool)
                or not isinstance(self.linear_attention_freq, int) or self.linear_attention_freq < 1):
            raise ValueError(f"ModelDims.linear_attention_freq={self.linear_attention_freq!r}; give "
                             "an int >= 1 (every freq-th layer is softmax attention) or None")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelDims.{name}={value!r}; it must be an int >= 1")
        if not isinstance(self.gated_linear_unit, bool):
            raise ValueError(f"gated_linear_unit={self.gated_linear_unit!r}; give True or False")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_query_groups={self.num_query_groups}; fix one of them")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}; give kv_channels explicitly")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        elif isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int) or self.kv_channels < 1:
            raise ValueError(f"ModelDims.kv_channels={self.kv_channels!r}; give an int >= 1 or None")
        self._check_hybrid()
        for name in ("window_size", "window_attn_skip_freq"):
            value = getattr(self, name)
            low = 0 if name == "window_size" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ValueError(f"ModelDims.{name}={value!r}; give an int >= {low} or None")
        if self.num_experts is not None:
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk={self.moe_router_topk} with num_experts="
                                 f"{self.num_experts}; give 1 <= topk <= num_experts")
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)


    def _check_hybrid(self) -> None:
        pattern = self.hybrid_pattern
        if pattern is not None:
            if not isinstance(pattern, str) or set(pattern) - set(HYBRID_SYMBOLS):
                raise ValueError(f"ModelDims.hybrid_pattern={pattern!r}; give one symbol per "
                                 f"layer out of {''.join(HYBRID_SYMBOLS)!r}")
            if len(pattern) != self.num_layers:
                raise ValueError(f"hybrid_pattern {pattern!r} has {len(pattern)} layers, "
                                 f"num_layers={self.num_layers}; make them equal")
            if not set(pattern) & set(MIXERS):
                raise ValueError(f"hybrid_pattern {pattern!r} has no `*`, `G` or `M` layer: "
                                 "nothing of a prefix would be cached")
            if MOE in pattern and self.num_experts is None:
                raise ValueError(f"hybrid_pattern {pattern!r} has `E` layers; give num_experts")
            if self.linear_attention_freq is not None:
                raise ValueError("give hybrid_pattern (with `G` layers) or linear_attention_freq "
                                 "(a GPTModel), not both")
        for name in ("mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
                     "mamba_conv_kernel_dim", "mamba_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelDims.{name}={value!r}; it must be an int >= 1")
        if self.mamba_num_heads is None:
            object.__setattr__(self, "mamba_num_heads", 2 * self.hidden_size // self.mamba_head_dim)
        if pattern is not None and MAMBA in pattern and (
                self.mamba_num_heads < 1 or self.mamba_num_heads % self.mamba_num_groups):
            raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not a positive multiple "
                             f"of mamba_num_groups={self.mamba_num_groups}; fix one of them")


@lru_cache(maxsize=65536)  # a step's rows repeat a few (length, cached) pairs thousands of times
def _row_forward(dims: ModelDims, length: int, cached: int) -> int:
    """Forward FLOPs of a row of `length` tokens over `cached` cached keys, whole model."""
    total = 0
    for i in range(dims.num_layers):
        mixer, mlp = layer_parts(dims, i)
        total += (mixer_forward(dims, mixer, length, cached, layer_window(dims, i))
                  + mlp_forward(dims, mlp, length))
    return total + length * 2 * dims.hidden_size * dims.vocab_size


def _prefix_stop(dims: ModelDims) -> tuple:
    """(0-based layer, in its router) where a cached prefix's forward stops: the last layer that
    caches K/V or a state, or a later MoE layer's router (its statistics count)."""
    parts = [layer_parts(dims, i) for i in range(dims.num_layers)]
    cache = max(i for i, (mixer, _) in enumerate(parts) if mixer is not None)
    routers = [i for i, (_, mlp) in enumerate(parts) if mlp == MOE]
    stop = max([cache, *routers])
    return stop, stop in routers


def _prefix_forward(dims: ModelDims, length: int, cached: int = 0) -> int:
    """Forward FLOPs of a cached prefix (a tree node: over its `cached` ancestor keys): the
    layers before the stop in full, then the stop layer up to its cache (or its router)."""
    stop, in_router = _prefix_stop(dims)
    total = 0
    for i in range(stop):
        mixer, mlp = layer_parts(dims, i)
        total += (mixer_forward(dims, mixer, length, cached, layer_window(dims, i))
                  + mlp_forward(dims, mlp, length))
    mixer, _ = layer_parts(dims, stop)
    if in_router:
        return (total + mixer_forward(dims, mixer, length, cached, layer_window(dims, stop))
                + length * router(dims))
    return total + mixer_to_cache(dims, mixer, length, cached)


def dense_flops(dims: ModelDims, seq_lens: Iterable[int]) -> float:
    """Forward + backward FLOPs of full causal rows of the given lengths (P+n-1 each)."""
    total = 0
    for s in seq_lens:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"sequence length {s!r}; every length must be an int >= 1")
        total += _row_forward(dims, s, 0)
    return float(3 * total)


def reuse_flops(dims: ModelDims, plan_like: Any) -> float:
    """Forward + backward FLOPs of a StepPlan (or anything with the same attributes):
    `prefixes[*].length` and `microbatches[*].segments[*].length / .cached_len`; with
    `microbatches[*].padding` and `prefix_units()` (padding > 0) the padding counts too."""
    total = sum(_prefix_forward(dims, span.length, span.start)  # a tree: one span per node
                for work in plan_like.prefixes for span in _spans(work))
    total += sum(_row_forward(dims, s.length, s.cached_len)
                 for mb in plan_like.microbatches for s in mb.segments)
    total += sum(_row_forward(dims, mb.padding, 0) for mb in plan_like.microbatches
                 if getattr(mb, "padding", 0))
    if getattr(plan_like, "row_multiple", 1) > 1:
        total += sum(_row_forward(dims, c.padding, c.start + c.length)
                     for c in plan_like.prefix_units().values() if c.padding)
    return float(3 * total)


def _spans(work: Any):
    if getattr(work, "nodes", None):
        return work.nodes
    return (SimpleNamespace(length=work.length, start=0),)


def _dense_lengths(batch: GroupBatch, plan: Any) -> list[int]:
    expected = {(g, t): group.context_len(t) - 1 + tr.num_tokens
                for g, group in enumerate(batch.groups) for t, tr in enumerate(group.trajectories)}
    seen = {}
    for mb in plan.microbatches:
        for s in mb.segments:
            if (s.group, s.trajectory) in seen or expected.get((s.group, s.trajectory)) != s.length + s.cached_len:
                raise ValueError(f"the plan's segment (group {s.group}, trajectory {s.trajectory}) does "
                                 "not match the batch (unknown, repeated or wrong length); plan this batch")
            seen[(s.group, s.trajectory)] = s.length
    if len(seen) != len(expected):
        missing = sorted(set(expected) - set(seen))[0]
        raise ValueError(f"the plan leaves out group {missing[0]}, trajectory {missing[1]}; plan this batch")
    return list(expected.values())


def ideal_speedup(dims: ModelDims, batch: GroupBatch, plan: Any) -> float:
    """dense_flops of every trajectory's full row / reuse_flops of the plan."""
    return dense_flops(dims, _dense_lengths(batch, plan)) / reuse_flops(dims, plan)
