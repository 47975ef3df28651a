"""Per-token saved bytes of one pipeline stage's layers, layer by layer and by kind of mixer
([Note: predicted device memory] in memory_model.py says what is counted for attention and MLP
halves; [Note: GDN saved tensors] in memory_model_gdn.py for Gated DeltaNet mixers, [Note:
Mamba-2 saved tensors] in memory_model_mamba.py for Mamba-2 mixers).

A stage holds layers `first_layer .. first_layer + stage_layers - 1`; `flops_layers.layer_parts`
gives each its (mixer, MLP) symbols. Three kinds of row save differently:
- "dense": a stock Megatron row (GDN: fla's conv keeps the in_proj output);
- "prefix": a prefix unit's row in a reuse step (GDN: the state hook's per-segment conv, one
  initial state per sequence);
- "suffix": a suffix row (as "prefix", and the two-part attention also saves its output for the
  output projection).
[Note: attention without RoPE] (position_embedding_type "none", Nemotron-H; rotary_percent 0)
Megatron's SelfAttention.get_query_key_value_tensors (megatron-core 0.19.2) splits the fused
QKV output [s, b, groups, (heads/group + 2) d] into views and reshapes the query to [s, b, heads,
d]: a copy when a rank holds several groups of several query heads (1 < groups/TP, heads >
groups), a view otherwise. With no RoPE nothing else is made: the attention saves q (that copy
or a view), k and v (views), so per token act x (3h + 2q + 2kv, + q for the copy) + fp32 x
(heads + 1) against act x (3h + 3q + 3kv + 4 d) with RoPE (its post-RoPE q and k, cos / sin),
and the cache's K is a view of the fused output (no K copy). Measured by
tests/test_memory_nemotron.py (GQA 4:1 with a copy; MHA and MQA without one).

The cache of a state layer is per prefix unit (memory_model_state.prefix_cache_shape), not per
token: `state_unit` / `state_grad_unit`.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from prefix_schedule.planning.flops_layers import ATTENTION, GDN, MAMBA, MOE, layer_parts
from prefix_schedule.planning.memory_model_gdn import gdn_mixer_bytes
from prefix_schedule.planning.memory_model_mamba import mamba_mixer_bytes
from prefix_schedule.planning.memory_model_mixers import MixerBytes
from prefix_schedule.planning.memory_model_state import prefix_cache_shape

__all__ = ["MIXER_BYTES", "ROWS", "LayerTerms", "check_mixers"]

FP32 = 4
ROWS = ("dense", "prefix", "suffix")

MIXER_BYTES: Dict[str, Callable[..., MixerBytes]] = {
    GDN: lambda dims, act_bytes, reuse: gdn_mixer_bytes(dims, act_bytes, reuse=reuse),
    MAMBA: lambda dims, act_bytes, reuse: mamba_mixer_bytes(
        dims, act_bytes, path="reuse" if reuse else "stock"),
}
"""Kind of state mixer -> its formula (dims, act_bytes, reuse: a reuse step's row) -> MixerBytes."""


def check_mixers(dims, layers: range) -> None:
    """ValueError naming a state mixer the accounting model does not count yet."""
    missing = {layer_parts(dims, i)[0] for i in layers} - set(MIXER_BYTES) - {ATTENTION, None}
    if missing:
        raise ValueError(f"layers of kind {sorted(missing)} are not in the memory model")


class LayerTerms:
    """Mixin of ActivationModel: needs dims, act_bytes, qk_norm, rotary_percent, tp,
    stage_layers, first_layer."""

    # ---- the stage's layers
    def kinds(self) -> List[Tuple[Optional[str], Optional[str]]]:
        """(mixer, MLP) symbols of the stage's layers, in order."""
        return [layer_parts(self.dims, i)
                for i in range(self.first_layer, self.first_layer + self.stage_layers)]

    def num_mixers(self, *kinds: str) -> int:
        return sum(m in kinds for m, _ in self.kinds())

    def _query_copied(self) -> bool:
        """Whether Megatron's query reshape copies q out of the fused QKV output (a rank's
        groups hold several query heads each and it holds several groups)."""
        d = self.dims
        return d.num_attention_heads > d.num_query_groups and d.num_query_groups // self.tp > 1

    def _widths(self):
        d = self.dims
        return d.hidden_size, d.num_attention_heads * d.kv_channels, \
            d.num_query_groups * d.kv_channels, d.kv_channels

    # ---- per token, one layer's halves (bytes on one TP rank)
    def attention(self) -> float:
        """Saved bytes per token of one layer's attention half (input norm to output
        projection); an output gate saves its sigmoid (fp32), the gated output and a fused QKV
        output wider by the gate; RoPE's cos / sin are as wide as the rotated part; without RoPE
        q and k are views of the fused QKV output ([Note: attention without RoPE])."""
        h, q, kv, dk = self._widths()
        d, a = self.dims, self.act_bytes
        if self.rotary_percent:
            attention = a * (3 * h + 3 * q + 3 * kv + 4 * dk * self.rotary_percent)
        else:  # [Note: attention without RoPE]
            attention = a * (3 * h + 2 * q + 2 * kv + (q if self._query_copied() else 0))
        attention += FP32 * (d.num_attention_heads + 1)
        if self.qk_norm:
            attention += a * 2 * (q + kv) + FP32 * (d.num_attention_heads + d.num_query_groups)
        if d.attention_output_gate:
            attention += a * 2 * q + FP32 * q
        return attention / self.tp

    def mlp(self, symbol: Optional[str] = None) -> float:
        """Saved bytes per token of one layer's MLP half (pre-MLP norm to fc2); `symbol` "-" /
        "E" (None: MoE if the model has experts). A dense MLP by dims.gated_linear_unit (SwiGLU,
        or a non-gated squared ReLU: tests/test_memory_nemotron.py); experts are SwiGLU."""
        h, d, a = self.dims.hidden_size, self.dims, self.act_bytes
        moe = symbol == MOE if symbol is not None else bool(d.num_experts)
        if moe:
            k = d.moe_router_topk
            mlp = a * (5 * k * d.moe_ffn_hidden_size + 2 * k * h) + FP32 * 2 * d.num_experts
            if d.moe_shared_ffn_hidden_size:
                mlp += a * 5 * d.moe_shared_ffn_hidden_size
        else:  # SwiGLU: fc1 output (2 f), its halves and fc2 input (3 f); a non-gated MLP
            # (squared ReLU: torch.compile'd, it keeps fc1's output) and fc2 input: 2 f
            mlp = a * (5 if d.gated_linear_unit else 2) * d.ffn_hidden_size
        return (mlp + a * 3 * h + FP32) / self.tp

    def state_mixer(self, kind: str, row: str) -> MixerBytes:
        return MIXER_BYTES[kind](self.dims, self.act_bytes, reuse=row != "dense")

    def mixer(self, kind: Optional[str], row: str) -> float:
        """Per token of one mixer half in a row of kind `row` (module docstring)."""
        if kind is None:
            return 0.0
        if kind == ATTENTION:
            extra = self.act_bytes * self._widths()[1] / self.tp if row == "suffix" else 0.0
            return self.attention() + extra
        return self.state_mixer(kind, row).per_token / self.tp

    def layer_bytes(self, parts, row: str) -> float:
        mixer, mlp = parts
        return self.mixer(mixer, row) + (self.mlp(mlp) if mlp is not None else 0.0)

    def layers_bytes(self, row: str) -> float:
        """All the stage's layers, per token."""
        return sum(self.layer_bytes(p, row) for p in self.kinds())

    def layer(self, row: str = "dense") -> float:
        """The largest layer of the stage, per token (one layer's recompute)."""
        return max(self.layer_bytes(p, row) for p in self.kinds())

    def sequence_bytes(self, row: str, every: bool = True) -> float:
        """Per sequence of a row: the state mixers' per-sequence terms, of all the stage's
        layers (`every`) or of the largest one (one layer's recompute)."""
        terms = [self.state_mixer(m, row).per_sequence / self.tp
                 for m, _ in self.kinds() if m not in (None, ATTENTION)]
        return (sum(terms) if every else max(terms)) if terms else 0.0

    def dormant_layers(self) -> float:
        """A dormant prefix token's saved bytes over the stage's layers: every layer before the
        last mixer, the last mixer up to what the cache keeps (an attention layer's input norm,
        RoPE and K/V storage; a state layer's mixer up to its state), nothing after it (Phase A
        stops there: docs/DESIGN.md)."""
        kinds = self.kinds()
        mixers = [i for i, (m, _) in enumerate(kinds) if m is not None]
        if not mixers:
            return self.layers_bytes("prefix")
        last = mixers[-1]
        before = sum(self.layer_bytes(p, "prefix") for p in kinds[:last])
        kind = kinds[last][0]
        if kind == ATTENTION:
            h, dk, a = self.dims.hidden_size, self._widths()[3], self.act_bytes
            norm = (a * (3 * h + 4 * dk * self.rotary_percent) + FP32) / self.tp
            return before + norm + self.kv_storage(compact=False)
        return before + self.state_mixer(kind, "prefix").to_state_per_token / self.tp

    # ---- the cache: per attention layer and cached token; per state layer and prefix unit
    def kv_storage(self, compact: bool) -> float:
        """Device bytes of one attention layer's cached K/V, per cached token (V, and K without
        RoPE, view the fused QKV output, gate included; RoPE's K is a tensor of its own)."""
        _, q, kv, _ = self._widths()
        fused = q * (2 if self.dims.attention_output_gate else 1) + 2 * kv
        rope_k = kv if self.rotary_percent else 0  # without RoPE K views the fused output too
        return self.act_bytes * (2 * kv if compact else fused + rope_k) / self.tp

    def kv_copy(self) -> float:
        """One layer's concatenated K/V read of several cached units, per chain token."""
        return self.act_bytes * 2 * self._widths()[2] / self.tp

    def gkv(self) -> float:
        """fp32 gK/gV of one layer, per cached token."""
        return FP32 * 2 * self._widths()[2] / self.tp

    def _cache_shape(self):
        layers = range(self.first_layer, self.first_layer + self.stage_layers)
        return prefix_cache_shape(self.dims, act_bytes=self.act_bytes, tp=self.tp, layers=layers)

    def state_unit(self) -> float:
        """The state layers' states and conv tails, per prefix unit."""
        return self._cache_shape().state_bytes

    def state_grad_unit(self) -> float:
        """Their fp32 gradient buffers, per prefix unit."""
        return self._cache_shape().state_grad_bytes
