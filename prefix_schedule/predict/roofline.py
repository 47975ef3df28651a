"""The roofline: seconds of each op of a training step on a DeviceSpec, summed per action.

Every op is costed on its own (no overlap between compute and communication, as eager Megatron
runs them unless told otherwise), in five categories (`Cost`):
- gemm: 2*m*n*k FLOPs at the device's GEMM throughput for that shape, or its bytes over the
  memory bandwidth if that is slower (a skinny GEMM is memory-bound);
- attention: 4*heads*d FLOPs per unmasked (query, key) pair (flops.py's count: causal rows
  s(s+1)/2, a suffix over c cached keys n*c + n(n+1)/2) at the flash-attention curve, per row;
  backward `attention_backward_flops` x that at the backward efficiency;
- memory: memory-bound ops by bytes over the memory bandwidth: per token and layer the norms,
  residual adds, RoPE and SwiGLU stream ~ (10 h + 4 (q + kv) + 6 f) activations (sequence
  parallel: / TP), twice that in backward; the output layer's softmax/loss reads and writes the
  fp32 logits 3x; reuse adds reading the cached K/V per suffix row and, in backward, the fp32
  gK/gV accumulation (read + write);
- comm: TP with sequence parallelism (2 all-gathers + 2 reduce-scatters of the row's hidden states
  per layer, each way), CP (dense: the K/V all-gather per layer and dK/dV reduce-scatter; reuse:
  the prefix K/V all-gather in Phase A and the fp32 gK/gV reduce-scatter in Phase C, suffixes
  whole per rank), EP all-to-all (dispatch + combine per MoE layer, each way), PP p2p per
  microbatch boundary; ring collectives: (p-1)/p x bytes / bandwidth + (p-1) x latency;
- overhead: a fixed `op_overhead_s` per launched op (OPS_PER_LAYER forward, 1.5x backward).
No Megatron, no torch: pure arithmetic on ModelDims (planning/flops.py) and a Layout.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence, Tuple

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.predict.devices import DeviceSpec

__all__ = ["Cost", "Layout", "OPS_PER_LAYER", "attention_cost", "collective_cost", "embedding_cost",
           "gemm_cost", "head_cost", "layer_cost", "memory_cost", "p2p_cost", "pairs", "sum_costs"]

OPS_PER_LAYER = 40
"""Ops one transformer layer launches in forward (Megatron local spec, unfused: 2 RMSNorms of
~5 ops, 4 GEMMs, RoPE on q and k ~6 ops each, the attention call, SwiGLU 3, 2 residual adds,
views and copies); backward launches 1.5x as many."""
Rows = Sequence[Tuple[int, int]]  # (tokens of a row on this rank, cached keys it also reads)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the model is split: tensor, pipeline (x virtual), context, expert and data parallel."""

    tp: int = 1
    """Tensor parallel size (with sequence parallelism)."""
    pp: int = 1
    """Pipeline stages (ranks)."""
    vpp: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B)."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size (MoE)."""
    dp: int = 1
    """Data parallel size."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name}={value!r}; give an int >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def check_model(self, dims: ModelDims) -> None:
        """ValueError when the model cannot be split this way."""
        stages = self.pp * self.vpp
        if dims.num_layers % stages:
            raise ValueError(f"{dims.num_layers} layers do not split into pp x vpp = {stages} "
                             "stages; choose pp and vpp dividing the layer count")
        if dims.num_query_groups % self.tp or dims.num_attention_heads % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the {dims.num_query_groups} K/V heads"
                             f" and {dims.num_attention_heads} query heads; choose a divisor")
        if self.ep > 1 and (not dims.num_experts or dims.num_experts % self.ep):
            raise ValueError(f"ep={self.ep} needs a MoE model whose expert count it divides")


@dataclasses.dataclass(frozen=True)
class Cost:
    """Seconds per category."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    comm: float = 0.0
    overhead: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.gemm + other.gemm, self.attention + other.attention,
                    self.memory + other.memory, self.comm + other.comm,
                    self.overhead + other.overhead)

    def scaled(self, factor: float) -> "Cost":
        return Cost(self.gemm * factor, self.attention * factor, self.memory * factor,
                    self.comm * factor, self.overhead * factor)

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.memory + self.comm + self.overhead

    def as_dict(self) -> dict:
        return dict(gemm=self.gemm, attention=self.attention, memory=self.memory, comm=self.comm,
                    overhead=self.overhead, total=self.total)


def sum_costs(costs: Iterable[Cost]) -> Cost:
    total = Cost()
    for c in costs:
        total = total + c
    return total


def gemm_cost(dev: DeviceSpec, m: float, n: float, k: float) -> Cost:
    """One [m, k] x [k, n] matmul (m: tokens)."""
    if m <= 0:
        return Cost()
    compute = 2 * m * n * k / dev.gemm_flops(m, min(n, k))
    traffic = dev.dtype_bytes * (m * k + k * n + m * n) / dev.memory_bandwidth
    return Cost(gemm=max(compute, traffic), overhead=dev.op_overhead_s)


def memory_cost(dev: DeviceSpec, num_bytes: float, ops: int = 1) -> Cost:
    return Cost(memory=num_bytes / dev.memory_bandwidth, overhead=ops * dev.op_overhead_s)


def pairs(length: int, cached: int) -> int:
    """Unmasked (query, key) pairs of a causal row of `length` tokens over `cached` keys."""
    return length * cached + length * (length + 1) // 2


def attention_cost(dev: DeviceSpec, heads: int, head_dim: int, rows: Rows, *, backward: bool,
                   cp: int = 1, calls: int = 1) -> Cost:
    """One varlen flash-attention call (or `calls`) over packed rows; with CP each rank holds
    1/cp of every row's queries and pairs."""
    seconds = 0.0
    for length, cached in rows:
        if length <= 0:
            continue
        flops = 4 * heads * head_dim * pairs(length, cached) / cp
        if backward:
            flops *= dev.attention_backward_flops
        seconds += flops / dev.attention_flops(max(1.0, length / cp), backward)
    return Cost(attention=seconds, overhead=calls * dev.op_overhead_s)


def collective_cost(dev: DeviceSpec, total_bytes: float, group: int, span: int) -> Cost:
    """A ring all-gather / reduce-scatter / all-to-all of `total_bytes` (the whole tensor) over
    `group` ranks whose outermost member is `span` ranks away (span > gpus_per_node: IB)."""
    if group <= 1 or total_bytes <= 0:
        return Cost()
    seconds = (group - 1) / group * total_bytes / dev.link_bandwidth(span)
    return Cost(comm=seconds + (group - 1) * dev.link_latency_s)


def p2p_cost(dev: DeviceSpec, num_bytes: float, span: int) -> Cost:
    return Cost(comm=num_bytes / dev.link_bandwidth(span) + dev.link_latency_s)


def _mlp_gemms(dev, dims: ModelDims, tokens: float, f: int, tp: int) -> Cost:
    glu = 2 if dims.gated_linear_unit else 1
    return gemm_cost(dev, tokens, glu * f / tp, dims.hidden_size) + \
        gemm_cost(dev, tokens, dims.hidden_size, f / tp)


def _mlp(dev, dims: ModelDims, lay: Layout, tokens: float) -> Cost:
    if not dims.num_experts:
        return _mlp_gemms(dev, dims, tokens, dims.ffn_hidden_size, lay.tp)
    h, k, experts = dims.hidden_size, dims.moe_router_topk, dims.num_experts
    router = gemm_cost(dev, tokens, experts, h)
    per_expert = tokens * k / experts  # dropless top-k, even load: tokens per local expert
    local = _mlp_gemms(dev, dims, per_expert, dims.moe_ffn_hidden_size, lay.tp)
    routed = local.scaled(experts / lay.ep)
    shared = (_mlp_gemms(dev, dims, tokens, dims.moe_shared_ffn_hidden_size, lay.tp)
              if dims.moe_shared_ffn_hidden_size else Cost())
    a2a = collective_cost(dev, 2 * tokens * k * h * dev.dtype_bytes, lay.ep, lay.ep * lay.tp)
    return router + routed + shared + a2a


def _tp_comm(dev, dims: ModelDims, lay: Layout, tokens: float, collectives: int) -> Cost:
    one = collective_cost(dev, tokens * dims.hidden_size * dev.dtype_bytes, lay.tp, lay.tp)
    return one.scaled(collectives)


def layer_cost(dev: DeviceSpec, dims: ModelDims, lay: Layout, rows: Rows, *, backward: bool,
               kv_only: bool = False, cp_split: bool = False, attention_calls: int = 1,
               cache_reads: int = 0) -> Cost:
    """One transformer layer over packed whole rows (cached keys: whole prefix).

    kv_only: the last layer of a cached prefix (norm + QKV projection, no attention or MLP).
    cp_split: every row is split over the CP ranks (this rank: 1/cp of its tokens and pairs),
    whose K/V it all-gathers (forward; backward: reduce-scatters the fp32 gradients).
    cache_reads: cached prefix tokens whose K/V the rows read (backward: and whose fp32 gK/gV
    they accumulate)."""
    h, d, tp = dims.hidden_size, dims.kv_channels, lay.tp
    q, kv = dims.num_attention_heads * d, dims.num_query_groups * d
    f = dims.ffn_hidden_size if not dims.num_experts else dims.moe_ffn_hidden_size * dims.moe_router_topk
    whole = float(sum(length for length, _ in rows))
    cp = lay.cp if cp_split else 1
    tokens = whole / cp
    passes = 2 if backward else 1
    per_token = 10 * h / tp + 4 * (q + kv) / tp + (0 if kv_only else 6 * f / tp)
    cost = gemm_cost(dev, tokens, (q + 2 * kv) / tp, h).scaled(passes)
    cost = cost + memory_cost(dev, passes * tokens * per_token * dev.dtype_bytes,
                              ops=int(OPS_PER_LAYER * (1.5 if backward else 1)) - 4)
    cost = cost + _tp_comm(dev, dims, lay, tokens, 1 if kv_only else 4)
    if cp > 1:
        kv_bytes = whole * 2 * kv / tp * (4 if backward else dev.dtype_bytes)
        cost = cost + collective_cost(dev, kv_bytes, lay.cp, lay.cp * lay.tp)
    if kv_only:
        return cost
    cost = cost + attention_cost(dev, dims.num_attention_heads // tp, d, rows, backward=backward,
                                 cp=cp, calls=attention_calls)
    if cache_reads:
        per_cached = 2 * kv / tp * (dev.dtype_bytes + (8 if backward else 0))
        cost = cost + memory_cost(dev, cache_reads * per_cached)
    cost = cost + gemm_cost(dev, tokens, h, q / tp).scaled(passes)
    return cost + _mlp(dev, dims, lay, tokens).scaled(passes)


def head_cost(dev: DeviceSpec, dims: ModelDims, lay: Layout, tokens: float, *,
              backward: bool) -> Cost:
    """Final norm, output layer and the loss over `tokens` (the last stage)."""
    passes = 2 if backward else 1
    vocab = dims.vocab_size / lay.tp
    cost = gemm_cost(dev, tokens, vocab, dims.hidden_size).scaled(passes)
    cost = cost + memory_cost(dev, 3 * tokens * vocab * 4 + 4 * tokens * dims.hidden_size, ops=12)
    return cost + _tp_comm(dev, dims, lay, tokens, 1)


def embedding_cost(dev: DeviceSpec, dims: ModelDims, tokens: float) -> Cost:
    return memory_cost(dev, 2 * tokens * dims.hidden_size * dev.dtype_bytes, ops=2)

