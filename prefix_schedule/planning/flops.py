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
  included); a suffix row of n tokens over c cached prefix keys has n*c + n*(n+1)/2.

- Gated DeltaNet layers (`linear_attention_freq` set: layer i is softmax attention when
  (i+1) % freq == 0, GDN otherwise, Megatron's get_linear_attention_pattern), with HK/HV key/value
  heads of widths dk/dv and conv window W: in_proj 2*h*(2*HK*dk + 2*HV*dv + 2*HV), out_proj
  2*HV*dv*h, the depthwise conv 2*W*(2*HK*dk + HV*dv), and the delta rule 6*HV*dk*dv per token
  (read S with k, update S, read it with q). No pairs: a suffix costs the same whatever the cached
  length (it starts from the cached state).

Backward = 2 x forward, so every piece of work costs 3 x its forward FLOPs.
Ignored: norms, softmax, activation functions, RoPE, embeddings lookups, the loss, optimizer.

Dense: every trajectory's full row (P+n-1 tokens) runs through the whole model, output layer
included (prefix positions carry no loss but their logits are still computed in stock training).

Prefix trees (planning/tree.py): a trajectory's prompt is its node chain, and each cached node
runs once over its ancestors' keys (pairs n*c + n*(n+1)/2 as for a suffix row).

Reuse: each cached prefix (P-1 tokens) runs forward and backward only through what the K/V of
every layer need (DESIGN.md "[Note: prefix forward stops at the last cached K/V]"): layers 1..L-1
fully and the last layer's QKV projection (a GDN last layer: its in_proj, conv and rule, whose
final state is what is cached); no last-layer attention or MLP, no output layer.
With MoE the prefix forward stops after the last layer's router instead (its statistics count,
DESIGN.md "MoE"): its attention, output projection and router are counted too (no experts).
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
        if self.num_experts is not None:
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ValueError(f"moe_router_topk={self.moe_router_topk} with num_experts="
                                 f"{self.num_experts}; give 1 <= topk <= num_experts")
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)


def _qkv(dims: ModelDims) -> int:
    return 2 * dims.hidden_size * (dims.num_attention_heads + 2 * dims.num_query_groups) * dims.kv_channels


def _mlp(dims: ModelDims, f: int) -> int:
    return 2 * dims.hidden_size * f * (2 if dims.gated_linear_unit else 1) + 2 * f * dims.hidden_size


def _router(dims: ModelDims) -> int:
    return 2 * dims.hidden_size * dims.num_experts if dims.num_experts else 0


def _layer_mlp(dims: ModelDims) -> int:
    """Forward matmul FLOPs of one token through one layer's MLP (MoE: router, k experts, shared)."""
    if not dims.num_experts:
        return _mlp(dims, dims.ffn_hidden_size)
    shared = _mlp(dims, dims.moe_shared_ffn_hidden_size) if dims.moe_shared_ffn_hidden_size else 0
    return _router(dims) + dims.moe_router_topk * _mlp(dims, dims.moe_ffn_hidden_size) + shared


def _layer_linear(dims: ModelDims) -> int:
    """Forward matmul FLOPs of one token through one layer, attention products excluded."""
    ad = dims.num_attention_heads * dims.kv_channels
    return _qkv(dims) + 2 * ad * dims.hidden_size + _layer_mlp(dims)


def _attention_pairs(length: int, cached: int) -> int:
    return length * cached + length * (length + 1) // 2


def _is_gdn(dims: ModelDims, layer: int) -> bool:
    """Whether 0-based layer `layer` is a Gated DeltaNet layer."""
    freq = dims.linear_attention_freq
    return freq is not None and (layer + 1) % freq != 0


def _gdn_mixer(dims: ModelDims) -> tuple:
    """Per-token forward FLOPs of a GDN layer's (in_proj + conv + rule, out_proj)."""
    qk = dims.linear_num_key_heads * dims.linear_key_head_dim
    v = dims.linear_num_value_heads * dims.linear_value_head_dim
    in_proj = 2 * dims.hidden_size * (2 * qk + 2 * v + 2 * dims.linear_num_value_heads)
    conv = 2 * dims.linear_conv_kernel_dim * (2 * qk + v)
    rule = 6 * dims.linear_num_value_heads * dims.linear_key_head_dim * dims.linear_value_head_dim
    return in_proj + conv + rule, 2 * v * dims.hidden_size


def _layer_forward(dims: ModelDims, layer: int, length: int, cached: int) -> int:
    if _is_gdn(dims, layer):
        return length * (sum(_gdn_mixer(dims)) + _layer_mlp(dims))
    return length * _layer_linear(dims) + 4 * dims.num_attention_heads * dims.kv_channels * \
        _attention_pairs(length, cached)


@lru_cache(maxsize=65536)  # a step's rows repeat a few (length, cached) pairs thousands of times
def _row_forward(dims: ModelDims, length: int, cached: int) -> int:
    """Forward FLOPs of a row of `length` tokens over `cached` cached keys, whole model."""
    return sum(_layer_forward(dims, i, length, cached) for i in range(dims.num_layers)) + \
        length * 2 * dims.hidden_size * dims.vocab_size


def _prefix_forward(dims: ModelDims, length: int, cached: int = 0) -> int:
    """Forward FLOPs of a cached prefix (a tree node: over its `cached` ancestor keys): layers
    1..L-1 in full, then the last layer's QKV or GDN state (MoE: up to its router)."""
    last_layer = dims.num_layers - 1
    full = sum(_layer_forward(dims, i, length, cached) for i in range(last_layer))
    if _is_gdn(dims, last_layer):
        mixer, out_proj = _gdn_mixer(dims)
        last = length * (mixer + (out_proj + _router(dims) if dims.num_experts else 0))
        return full + last
    attention = 4 * dims.num_attention_heads * dims.kv_channels * _attention_pairs(length, cached)
    last = length * _qkv(dims)
    if dims.num_experts:
        ad = dims.num_attention_heads * dims.kv_channels
        last += attention + length * (2 * ad * dims.hidden_size + _router(dims))
    return full + last


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
