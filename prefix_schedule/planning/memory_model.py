"""Predicted device bytes of a step, before it runs: the accounting model as formulas.

[Note: predicted device memory] runtime/memory.py measures what a step holds on the device
(saved-for-backward storages, each once, the prefix cache's K/V and fp32 gK/gV, prefix
activations brought back for Phase C; parameters, gradients, optimizer state excluded). This
module predicts the same quantity from the model's shape and a StepPlan, so that a planner can
fit a budget and tools/capacity.py can size a GPU run. Per token, per layer, the bytes are those
Megatron's GPT layer (local spec, fused SDPA core attention) saves -- counted tensor by tensor on
the CPU model (tests/test_memory_model.py holds the prediction to the bytes the saved-tensor
accounting of tools/memory_probe.py counts; no allocator is measured):
- layer: input norm (input, output, rstd), QKV linear input, RoPE cos/sin of q and k (4 d),
  the fused QKV output (q + 2 kv: V is a view of it), post-RoPE q and k, attention output and
  log-sum-exp, pre-MLP norm and fc1 input, fc1 output (2 f), the SwiGLU halves and fc2 input
  (3 f): act x (6 h + 3 q + 3 kv + 4 d + 5 f) + fp32 x (heads + 2);
  a non-gated MLP (squared ReLU) saves 2 f, not 5 f; attention without RoPE: [Note: attention
  without RoPE] (memory_model_layers.py);
- head (last stage): final norm and output-layer input (3 h), fp32 logits (V / TP) and rstd,
  labels, masks and the loss terms (30 B); the embedding's token ids (8 B);
- a suffix row under the two-part attention also saves its attention output for the output
  projection (act x q per layer);
- a read of a cached prefix of several units (chunks, or a tree node's chain) concatenates their
  K/V (PrefixKVCache.read) and the attention saves that copy for backward: 2 kv per chain token
  and layer, per attention slot of a suffix row (one per group, or per tree node's chain, as
  runtime/step.py builds the slots), and per prefix unit whose forward reads several earlier
  units (dormant until its Phase C; offloaded with offload; under full recompute only the
  re-run layer's, in backward). A one-unit read is a view of the cache: no copy. A prefix
  unit that reads earlier units (a later chunk, a tree node) also saves its two-part
  attention output, as a suffix row does;
- the cache per cached token and layer: K (kv) and the fused QKV storage V views (q + 2 kv), or
  K and V compacted (2 kv) under full recompute; fp32 gK/gV (2 kv), allocated by the first
  suffix backward that reads the group;
- a dormant prefix (Phase A to Phase C): every layer but the last, the last up to its K/V, the
  cache; with offload only the cache stays; with full recompute only the compacted cache.
Full recompute (uniform, one layer per checkpoint) keeps each layer's input (act x h) and, in
backward, one layer's recompute at a time. With TP (sequence parallelism) every term is / TP;
with CP tokens are / CP. MoE layers count top-k experts' fc1/SwiGLU/fc2 tensors, the routed
copies of the hidden states and the fp32 router scores: an estimate, not measured yet.
Attention with an output gate (Qwen3-Next / Qwen3.5) also saves the gate's fp32 sigmoid and the
gated output (and its fused QKV output is wider by the gate); partial RoPE saves cos/sin of the
rotated part only. Hybrid models (memory_model_layers.py: each layer by its kind): a Gated
DeltaNet mixer saves what [Note: GDN saved tensors] (memory_model_gdn.py) says, per token and
per packed sequence (its initial state), dense rows and reuse rows apart; its cache is a state
and conv tail per prefix unit (memory_model_state.py) with fp32 gradients per unit (the tail is
a copy of the conv window's end, so offload moves the window to the host). A Mamba-2 mixer
saves what [Note: Mamba-2 saved tensors] (memory_model_mamba.py) says: Megatron's fused path in
dense rows, the state hook's conv + scan in reuse rows. Reuse with full recompute is counted
for GPTModels (GDN layers too) and HybridModels alike (tests/test_memory_hybrid_recompute.py).

The step is walked in the order the schedule runs it on one stage (PF, SF, SB, PB;
pipeline/generate.py), each sample counting what is alive then: the peak per phase is an upper
bound of the measured one (a suffix backward counts all of the row's saved tensors next to all
gK/gV it creates; not counted: the tensors under 1 KiB that offload leaves on the device, a few
% of a small model's offloaded phases with short chunks). Pipeline stages: `stage_layers` (layers on the heaviest stage) and
`in_flight` (microbatches whose activations a stage holds at once; 1F1B: min(PP, microbatches)).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.flops_layers import ATTENTION, GDN, MAMBA
from prefix_schedule.planning.memory_model_layers import LayerTerms, check_mixers

__all__ = ["ActivationModel", "MemoryOptions", "RECOMPUTE_MODES", "dense_peak_bytes",
           "reuse_phase_peaks", "unit_reads"]

RECOMPUTE_MODES = ("none", "full")
FP32 = 4
HEAD_CONST = 30  # labels (int64), masks (bool) and the policy loss's per-token fp32 terms
EMBED_CONST = 8  # the token ids the embedding saves (int64)
STATE_MIXERS = (GDN, MAMBA)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """The memory options of a reuse step: exact either way (docs/DESIGN.md "Memory")."""

    offload: bool = False
    """Dormant prefix activations wait in host memory (ReuseStep offload_prefix_activations)."""
    recompute: str = "none"
    """"none" or "full" (Megatron's recompute_granularity="full", uniform, one layer each)."""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={self.recompute!r}; choose one of {RECOMPUTE_MODES}")
        if self.offload and self.recompute == "full":
            raise ValueError("offload with full recompute: full recompute keeps no prefix "
                             "activation to offload; choose one")

    def describe(self) -> str:
        return {(False, "none"): "no offload, no recompute", (True, "none"): "offload",
                (False, "full"): "full recompute"}[self.offload, self.recompute]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationModel(LayerTerms):
    """Per-token device bytes of one pipeline stage of a model (module docstring; the layers'
    terms by kind: memory_model_layers.py)."""

    dims: ModelDims
    act_bytes: int = 2
    """Bytes of an activation element: 2 (bf16), 4 (fp32, the CPU tests)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k (Qwen3): their inputs and rstd are saved too."""
    rotary_percent: float = 1.0
    """The rotated fraction of a head (Qwen3-Next / Qwen3.5: 0.25): RoPE's saved cos / sin; 0:
    no positional embedding (Nemotron-H: [Note: attention without RoPE])."""
    tp: int = 1
    """Tensor-parallel size under sequence parallelism: every term / tp."""
    stage_layers: Optional[int] = None
    """Layers on this stage (None: all)."""
    first_layer: int = 0
    """0-based index of the stage's first layer (which layers are GDN / attention)."""
    head: bool = True
    """Whether this stage holds the output layer and loss (the last stage)."""
    in_flight: int = 1
    """Microbatches whose activations the stage holds at once (1F1B's first stage:
    min(PP, microbatches))."""

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ModelDims):
            raise ValueError(f"ActivationModel.dims={self.dims!r}; give a flops.ModelDims")
        if self.dims.window_size is not None:
            raise ValueError(
                f"ActivationModel: window_size={self.dims.window_size} (sliding-window attention, "
                "gpt-oss) is not in the memory model: its reuse attention runs the math kernels "
                "(scores of each suffix and of its windowed prefix part materialised), which "
                "nothing here counts; costing it as full attention would be wrong. No capacity "
                "or memory prediction for window_size models yet")
        for name in ("act_bytes", "tp", "in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ActivationModel.{name}={value!r}; give an int >= 1")
        if not 0 <= self.rotary_percent <= 1:
            raise ValueError(f"ActivationModel.rotary_percent={self.rotary_percent!r}; give a "
                             "fraction in [0, 1] (0: no RoPE)")
        if not self.rotary_percent and (self.qk_norm or self.dims.attention_output_gate):
            raise ValueError("ActivationModel: rotary_percent=0 (no RoPE) is counted without "
                             "qk_norm or attention_output_gate only (not measured with them)")
        if self.stage_layers is None:
            object.__setattr__(self, "stage_layers", self.dims.num_layers - self.first_layer)
        if not (0 <= self.first_layer and self.stage_layers >= 1
                and self.first_layer + self.stage_layers <= self.dims.num_layers):
            raise ValueError(f"ActivationModel: layers {self.first_layer} + {self.stage_layers} "
                             f"outside the model's {self.dims.num_layers}")
        check_mixers(self.dims, range(self.first_layer, self.first_layer + self.stage_layers))

    def head_bytes(self) -> float:
        """Output layer and loss, per token (0 off the last stage)."""
        if not self.head:
            return 0.0
        h = self.dims.hidden_size
        return (self.act_bytes * 3 * h + FP32 * (self.dims.vocab_size + 1) + HEAD_CONST) / self.tp

    def checkpoint(self) -> float:
        """What full recompute keeps per layer: the layer's input."""
        return self.act_bytes * self.dims.hidden_size / self.tp

    # ---- per token, this stage
    def row_token(self, recompute: str, *, suffix: bool = False) -> float:
        """Peak bytes per token of one microbatch row (dense, or a suffix row: `suffix`)."""
        L, row = self.stage_layers, "suffix" if suffix else "dense"
        if recompute == "full":
            return L * self.checkpoint() + EMBED_CONST + max(self.head_bytes(), self.layer(row))
        return self.layers_bytes(row) + self.head_bytes() + EMBED_CONST

    def row_sequence(self, recompute: str, *, suffix: bool = False) -> float:
        """Peak bytes per packed sequence of one microbatch row, beside row_token's."""
        row = "suffix" if suffix else "dense"
        return self.sequence_bytes(row, every=recompute != "full")

    def _last_share(self, new_kv: float, new_state: float) -> float:
        """The gK/gV or state gradients the stage's last mixer creates (its backward comes
        first)."""
        kinds = [m for m, _ in self.kinds() if m is not None]
        if not kinds:
            return 0.0
        if kinds[-1] == ATTENTION:
            return new_kv / kinds.count(ATTENTION)
        return new_state / (len(kinds) - kinds.count(ATTENTION))

    def _first_mixer(self, tokens: int, copy: float, sequences: int) -> float:
        """The stage's first layer's mixer half of a suffix row (what its backward reads)."""
        kind = self.kinds()[0][0]
        if kind in (None, ATTENTION):
            return tokens * self.mixer(kind, "suffix") + (copy if kind else 0.0)
        mixer = self.state_mixer(kind, "suffix")
        return (tokens * mixer.per_token + sequences * mixer.per_sequence) / self.tp

    def suffix_backward(self, tokens: int, recompute: str, new_gkv: float,
                        copy_tokens: int = 0, new_state: float = 0.0,
                        sequences: int = 1) -> float:
        """Peak of a suffix row's backward that creates `new_gkv` bytes of gK/gV and
        `new_state` of state gradients, whose attention reads `copy_tokens` concatenated prefix
        tokens per layer and which packs `sequences` sequences: layer by layer the row's saved
        tensors go as the gradients of the layers done arrive, so the peak is at one end: the
        last layer (all saved, its share of the gradients) or the first (its mixer half, all;
        under full recompute also its whole re-run layer with the others' gradients)."""
        L = self.stage_layers
        n_kv = self.num_mixers(ATTENTION)
        re_run = tokens * self.layer("suffix") + sequences * self.row_sequence("full", suffix=True)
        copy = copy_tokens * self.kv_copy() if n_kv else 0.0  # one layer's
        first = self._first_mixer(tokens, copy, sequences)
        last = self._last_share(new_gkv, new_state)
        new = new_gkv + new_state
        if recompute == "full":  # only the re-run layer holds its saved tensors and copy
            # k layers done: (L - k) inputs kept, one layer re-run, the done layers' gradients
            # -- linear in k, so the peak is at k = 0 or at the first layer's re-run or mixer
            kept = self.checkpoint() + EMBED_CONST
            return max(tokens * (L * self.checkpoint() + EMBED_CONST) + re_run + copy + last,
                       tokens * kept + re_run + copy + new - last,
                       tokens * kept + first + new)
        return max(tokens * self.row_token("none", suffix=True) + n_kv * copy +
                   sequences * self.row_sequence("none", suffix=True) + last,
                   tokens * EMBED_CONST + first + new)

    def suffix_forward(self, tokens: int, recompute: str, copy_tokens: int = 0,
                       sequences: int = 1) -> float:
        """What a suffix row holds at the end of its forward (`copy_tokens`, `sequences`:
        suffix_backward)."""
        if recompute == "full":  # checkpointed layers save nothing in forward
            return tokens * (self.stage_layers * self.checkpoint() + EMBED_CONST
                             + self.head_bytes())
        return tokens * self.row_token("none", suffix=True) + \
            self.num_mixers(ATTENTION) * copy_tokens * self.kv_copy() + \
            sequences * self.row_sequence("none", suffix=True)

    def prefix_reads(self, row_tokens: int, copy_tokens: int, options: MemoryOptions) -> tuple:
        """(dormant, Phase C) extra bytes of a prefix unit of `row_tokens` whose forward reads
        earlier cached units (a later chunk, a tree node below the root): its two-part attention
        saves its output apart from the output projection's input (act x q, every attention
        layer but the last mixer, which stops at its K/V) and, reading several units, their
        concatenated K/V (`copy_tokens` per attention layer). Saved until Phase C; offloaded
        until then with offload; under full recompute only the re-run layer's, in Phase C."""
        n_kv = self.num_mixers(ATTENTION)
        if not n_kv:
            return 0.0, 0.0
        out = row_tokens * self.act_bytes * self._widths()[1] / self.tp
        copy = copy_tokens * self.kv_copy()
        if options.recompute == "full":
            return 0.0, out + copy
        last = [m for m, _ in self.kinds() if m is not None][-1] == ATTENTION
        every = (n_kv - last) * out + n_kv * copy
        return (0.0, every) if options.offload else (every, 0.0)

    def dormant_token(self, options: MemoryOptions) -> float:
        """Bytes a cached prefix token holds from Phase A to Phase C (cache K/V included)."""
        n_kv = self.num_mixers(ATTENTION)
        if options.recompute == "full":
            return n_kv * self.kv_storage(compact=True)
        if options.offload:
            return n_kv * self.kv_storage(compact=False)
        return self.dormant_layers() + EMBED_CONST

    def dormant_unit(self, options: MemoryOptions) -> float:
        """Bytes a prefix unit holds from Phase A to Phase C whatever its length: the state
        layers' states and conv tails (copies of the windows' ends: runtime/gdn_hooks.py
        conv_window) and, without offload, their per-sequence saved tensors."""
        if options == MemoryOptions():
            return self.state_unit() + self.sequence_bytes("prefix")
        return self.state_unit()

    def phase_c_token(self, options: MemoryOptions) -> float:
        """Extra bytes per token of the prefix unit whose Phase C runs."""
        if options.recompute == "full":
            return self.stage_layers * self.checkpoint() + self.layer("prefix")
        if options.offload:
            return self.dormant_token(MemoryOptions()) - self.dormant_token(options)
        return 0.0

    def phase_c_unit(self, options: MemoryOptions) -> float:
        """Extra bytes of the prefix unit whose Phase C runs, whatever its length."""
        if options.recompute == "full":
            return self.sequence_bytes("prefix", every=False)
        if options.offload:
            return self.sequence_bytes("prefix")
        return 0.0

    def refusal(self, options: MemoryOptions) -> Optional[str]:
        """Why a reuse step of this stage cannot run with `options` (None: it can). Every
        option runs on every stage now, full recompute with MoE layers too ([Note: prefix router
        stats under full recompute] in runtime/router_stats.py); the executor's other refusals
        of full recompute (prefix trees, CP) depend on the step, not on the stage."""
        del options
        return None

    def gkv_token(self) -> float:
        return self.num_mixers(ATTENTION) * self.gkv()


def dense_peak_bytes(model: ActivationModel, row_tokens: Sequence[int],
                     recompute: str = "none") -> float:
    """Peak of a dense step whose microbatches hold `row_tokens` tokens each (rows x longest
    row when batched): the model's `in_flight` largest held at once."""
    largest = sorted(row_tokens, reverse=True)[:model.in_flight]
    return sum(largest) * model.row_token(recompute) + \
        len(largest) * model.row_sequence(recompute)


def unit_reads(plan) -> tuple:
    """(per microbatch index: the chains of prefix units its attention slots read, one per
    slot; per prefix unit: the chain of earlier units its forward reads), as runtime/step.py
    and the attention hook read the cache: a group's slot reads all its units, a tree node's
    slot (group, node, cached length) its node's chain; chunk c reads its ancestors."""
    units = plan.prefix_units()
    ids = {(c.group, c.chunk): u for u, c in units.items()}
    trees = {w.group for w in plan.prefixes if w.nodes is not None}
    slots = {}
    for mb in plan.microbatches:
        keys, chains = [None], []
        for s in mb.segments:
            if s.cached_len == 0:  # a dense row: a slot of its own, no read
                keys.append(None)
                continue
            key = (s.group, s.node, s.cached_len) if s.group in trees else s.group
            if key == keys[-1]:
                continue
            keys.append(key)
            chunks = plan.chain_chunks(s.group, s.node) if s.group in trees else \
                sorted(c for g, c in ids if g == s.group)
            chains.append(tuple(ids[s.group, c] for c in chunks))
        slots[mb.index] = chains
    ancestors = {}
    for u, c in units.items():
        chain, parent = [], c.parent_chunk
        while parent is not None:
            chain.append(ids[c.group, parent])
            parent = units[chain[-1]].parent_chunk
        ancestors[u] = tuple(reversed(chain))
    return slots, ancestors


def _sequences(mb) -> int:
    """Packed sequences of a suffix row as the state hook cuts it: its segments, and its
    padding as one more."""
    return len(mb.segments) + (mb.row_length > sum(s.length for s in mb.segments))


def reuse_phase_peaks(model: ActivationModel, plan,
                      options: MemoryOptions = MemoryOptions()) -> Dict[str, float]:
    """Peak bytes per phase ("PF", "suffix", "PB", "step") of a reuse step on one stage, walked
    in the one-stage schedule order ([Note: predicted device memory]). The model's `in_flight`
    > 1 (a pipeline's first stage) counts that many of the largest suffix rows at once."""
    from prefix_schedule.pipeline import ActionKind
    from prefix_schedule.pipeline.generate import build_schedule

    refusal = model.refusal(options)
    if refusal:
        raise ValueError(refusal)
    units = plan.prefix_units()
    schedule = build_schedule(num_stages=1, microbatch_groups=plan.microbatch_groups(),
                              prefix_groups=[w.group for w in plan.prefixes],
                              prefix_units={u: (c.group, c.chunk) for u, c in units.items()})
    slots, ancestors = unit_reads(plan)

    def copy_tokens(chains) -> int:  # a one-unit read is a view of the cache: no copy
        return sum(units[u].length for chain in chains if len(chain) > 1 for u in chain)

    rows = {mb.index: mb.row_length for mb in plan.microbatches}
    seqs = {mb.index: _sequences(mb) for mb in plan.microbatches}
    copies = {i: copy_tokens(chains) for i, chains in slots.items()}
    forward = {i: model.suffix_forward(rows[i], options.recompute, copies[i], seqs[i])
               for i in rows}
    if options.recompute == "full":  # as a pipeline holds them: inputs and the head's
        forward = {i: rows[i] * model.row_token("full", suffix=True) for i in rows}
    extra = sorted(forward.values(), reverse=True)[1:model.in_flight]  # the others a stage holds
    held = sum(extra)
    dormant, grads, reads = {}, {}, {}
    peaks = {"PF": 0.0, "suffix": 0.0, "PB": 0.0}

    def sample(phase: str, transient: float) -> None:
        total = sum(dormant.values()) + sum(sum(g) for g in grads.values()) + held + transient
        peaks[phase] = max(peaks[phase], total)

    def unit_grads(u: int) -> tuple:  # (gK/gV, state gradients) of prefix unit u
        return units[u].length * model.gkv_token(), model.state_grad_unit()

    for action in schedule.actions[0]:
        kind, i = action.kind, action.index
        if kind is ActionKind.PREFIX_FORWARD:
            reads[i] = model.prefix_reads(units[i].row_length, copy_tokens([ancestors[i]]),
                                          options) if ancestors[i] else (0.0, 0.0)
            dormant[i] = units[i].row_length * model.dormant_token(options) + reads[i][0] + \
                model.dormant_unit(options)
            sample("PF", 0.0)
        elif kind is ActionKind.SUFFIX_FORWARD:
            sample("suffix", model.suffix_forward(rows[i], options.recompute, copies[i], seqs[i]))
        elif kind is ActionKind.SUFFIX_BACKWARD:
            read = {u for chain in slots[i] for u in chain}
            new = {u: unit_grads(u) for u in read if u in dormant and u not in grads}
            sample("suffix", model.suffix_backward(
                rows[i], options.recompute, sum(g for g, _ in new.values()), copies[i],
                new_state=sum(s for _, s in new.values()), sequences=seqs[i]))
            grads.update(new)
        elif kind is ActionKind.PREFIX_BACKWARD:
            grads.setdefault(i, unit_grads(i))
            sample("PB", units[i].row_length * model.phase_c_token(options) + reads[i][1] +
                   model.phase_c_unit(options))
            dormant.pop(i, None)
            grads.pop(i, None)
    peaks["step"] = max(peaks.values())
    return peaks
