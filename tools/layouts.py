"""Suggested TP x PP x DP layouts for the paper's models, with the memory each one implies.

    python tools/layouts.py qwen3-8b                        # 8, 16 and 64 GPUs, 12,288-token rows
    python tools/layouts.py llama3-8b --gpus 16 --seq-len 8192 --prefix-len 6144 --all

Per GPU, on the heaviest pipeline stage (the first: embedding + its layers + the most
microbatches in flight), in GiB:
* weights: bf16 (2 bytes / parameter);
* grads: fp32 main-grad buffer (4 B; Megatron's --accumulate-allreduce-grads-in-fp32);
* optimizer: distributed optimizer (--use-distributed-optimizer): fp32 master weights + Adam's
  two moments, 12 B / parameter, sharded over the DP ranks;
* activations: bf16 tensors kept for backward per token per layer, with flash attention (no
  s^2 term) and sequence parallelism (everything / TP):
  2 * (4h + 2 h_q + 2 h_kv + 3 ffn) bytes [norm inputs, QKV input, q/k/v, attention output, proj
  input, MLP input, fc1 output (gate and up), SwiGLU output], times layers on the stage, times
  the microbatches 1F1B keeps in flight on the first stage (min(PP, microbatches)); plus the fp32
  logits of one row on the last stage (vocab / TP);
* prefix cache (reuse): one group's cached K/V (bf16) and their fp32 gradients for a prefix of
  P tokens on the stage's layers: P * 2 h_kv * (2 + 4) / TP bytes per layer.
An estimate for planning (allocator fragmentation, communication buffers and CUDA context --
typically 2-6 GiB -- are not counted); tools/memory_probe.py counts saved tensors (not the
allocator); on the real GPU compare with torch.cuda.max_memory_allocated.
MoE models are listed with their parameter count but not laid out here: this estimate has no
expert parallelism (prefix reuse trains MoE models; tools/capacity.py and tools/predict.py model
them with EP).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from argtypes import non_negative_int, positive_float, positive_int  # noqa: E402
from megatron_patches.models.model_configs import PAPER_MODELS, ModelSpec  # noqa: E402

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    prefix_cache: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.prefix_cache

    def row(self) -> str:
        return (f"TP={self.tp} PP={self.pp} DP={self.dp:<3d} | weights {self.weights:6.2f} | "
                f"grads {self.grads:6.2f} | optimizer {self.optimizer:6.2f} | activations "
                f"{self.activations:6.2f} | prefix cache {self.prefix_cache:5.2f} | total "
                f"{self.total:6.2f} GiB")


def layer_params(spec: ModelSpec) -> int:
    """A softmax-attention layer with a dense MLP (linear_qkv also makes the output gate with
    attention_output_gate)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    gate = q if getattr(spec, "attention_output_gate", False) else 0
    attention = h * (q + gate + 2 * kv) + q * h + (2 * d if spec.qk_norm else 0)
    return attention + 3 * h * spec.ffn_hidden_size + 2 * h


def gdn_mixer_params(spec: ModelSpec) -> int:
    """A Gated DeltaNet mixer (megatron-core 0.19 GatedDeltaNet): in_proj (q, k, v, z, beta,
    alpha), the depthwise conv over q, k, v (no bias), A_log and dt_bias, the output norm (one
    value head wide) and out_proj."""
    h = spec.hidden_size
    qk = spec.linear_num_key_heads * spec.linear_key_head_dim
    vd = spec.linear_num_value_heads * spec.linear_value_head_dim
    in_proj = h * (2 * qk + 2 * vd + 2 * spec.linear_num_value_heads)
    conv = (2 * qk + vd) * spec.linear_conv_kernel_dim
    return in_proj + conv + 2 * spec.linear_num_value_heads + spec.linear_value_head_dim + vd * h


def gdn_layer_params(spec: ModelSpec) -> int:
    """A GDN layer with a dense MLP: layer_params with the GDN mixer for the attention."""
    h, d = spec.hidden_size, spec.head_dim
    q = spec.num_attention_heads * d
    gate = q if getattr(spec, "attention_output_gate", False) else 0
    attention = h * (q + gate + 2 * spec.num_query_groups * d) + q * h + \
        (2 * d if spec.qk_norm else 0)
    return layer_params(spec) - attention + gdn_mixer_params(spec)


def mlp_params(spec: ModelSpec) -> int:
    """A dense MLP's fc1 and fc2: SwiGLU (gate and up), or Nemotron-H's non-gated squared ReLU
    (up only)."""
    return (2 if spec.is_nemotron_h else 3) * spec.hidden_size * spec.ffn_hidden_size


def mamba_mixer_params(spec: ModelSpec) -> int:
    """A Mamba-2 mixer (megatron-core 0.19.2 ssm/mamba_mixer.py MambaMixer): in_proj (z, x, B, C,
    dt; no bias), the depthwise conv over x, B, C (weight W = 4 wide, bias), A_log, D and dt_bias
    (one per head), the grouped gated norm (d_inner) and out_proj."""
    h, heads = spec.hidden_size, spec.mamba_num_heads
    inner = heads * spec.mamba_head_dim
    conv = inner + 2 * spec.mamba_num_groups * spec.mamba_state_dim
    return h * (inner + conv + heads) + conv * (4 + 1) + 3 * heads + inner + inner * h


def hybrid_layer_params(spec: ModelSpec, symbol: str) -> int:
    """One HybridModel layer (Nemotron-H: `M`, `*`, `-`), its input norm included."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    mixer = {"M": lambda: mamba_mixer_params(spec), "-": lambda: mlp_params(spec),
             "*": lambda: h * (q + 2 * kv) + q * h + (2 * d if spec.qk_norm else 0)}
    if symbol not in mixer:
        raise ValueError(f"layer symbol {symbol!r}; only `M`, `*` and `-` are counted")
    return mixer[symbol]() + h


def total_params(spec: ModelSpec) -> int:
    """Parameters of the dense model (MoE: all experts)."""
    if spec.is_moe:
        h = spec.hidden_size
        experts = spec.num_experts * 3 * h * spec.moe_ffn_hidden_size + h * spec.num_experts
        dense = layer_params(spec) - 3 * h * spec.ffn_hidden_size
        per_layer = dense + experts
    else:
        per_layer = layer_params(spec)
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * per_layer + embeddings + spec.hidden_size


def estimate(spec: ModelSpec, tp: int, pp: int, dp: int, *, seq_len: int, prefix_len: int,
             microbatches: int) -> Layout:
    layers = spec.num_layers // pp
    h, d = spec.hidden_size, spec.head_dim
    stage = layers * layer_params(spec) / tp + spec.vocab_size * h / tp  # first stage
    if pp == 1 and not spec.tie_word_embeddings:
        stage += spec.vocab_size * h / tp
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    per_token_layer = 2 * (4 * h + 2 * q + 2 * kv + 3 * spec.ffn_hidden_size) / tp
    in_flight = min(pp, microbatches)
    activations = seq_len * layers * per_token_layer * in_flight
    if pp == 1:
        activations += seq_len * spec.vocab_size / tp * 4
    cache = prefix_len * 2 * kv * (2 + 4) / tp * layers
    return Layout(tp, pp, dp, stage * 2 / GIB, stage * 4 / GIB, stage * 12 / dp / GIB,
                  activations / GIB, cache / GIB)


def candidate_layouts(spec: ModelSpec, gpus: int, **kw) -> List[Layout]:
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8, 16):
            if (gpus % (tp * pp) or spec.num_query_groups % tp or spec.num_layers % pp
                    or tp > 8):
                continue
            out.append(estimate(spec, tp, pp, gpus // (tp * pp), **kw))
    return out


def suggest(spec: ModelSpec, gpus: int, gpu_gib: float, headroom: float = 0.85, **kw) -> List[Layout]:
    """Layouts that fit `headroom` of the GPU, least model parallelism first (then lower TP)."""
    fits = [lay for lay in candidate_layouts(spec, gpus, **kw) if lay.total <= headroom * gpu_gib]
    return sorted(fits, key=lambda lay: (lay.tp * lay.pp, lay.tp))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"any of {', '.join(PAPER_MODELS)} (default: all)")
    p.add_argument("--gpus", type=positive_int, nargs="+", default=[8, 16, 64])
    p.add_argument("--gpu-memory-gib", type=positive_float, default=80.0, help="H100: 80, H200: 141")
    p.add_argument("--seq-len", type=positive_int, default=12288, help="tokens per microbatch row")
    p.add_argument("--prefix-len", type=non_negative_int, default=10240, help="shared prompt length")
    p.add_argument("--microbatches", type=positive_int, default=16,
                   help="microbatches per step per DP rank")
    p.add_argument("--all", action="store_true", help="every candidate, fitting or not")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models) - set(PAPER_MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(PAPER_MODELS)}")
    if args.prefix_len >= args.seq_len:
        p.error(f"--prefix-len {args.prefix_len} must be shorter than --seq-len {args.seq_len} "
                "(a row is the prompt and at least one response token)")
    kw = dict(seq_len=args.seq_len, prefix_len=args.prefix_len, microbatches=args.microbatches)
    for name in args.models or list(PAPER_MODELS):
        spec = PAPER_MODELS[name]
        print(f"{name}: {total_params(spec) / 1e9:.2f}B parameters")
        if spec.is_moe:
            print("  mixture of experts: this estimate has no expert parallelism, so no layout is "
                  "suggested here (prefix reuse trains MoE; lay it out with tools/capacity.py "
                  f"--model {name} --ep N or tools/predict.py --model {name})")
            continue
        for gpus in args.gpus:
            rows = (candidate_layouts(spec, gpus, **kw) if args.all
                    else suggest(spec, gpus, args.gpu_memory_gib, **kw)[:3])
            print(f"  {gpus} GPUs ({args.gpu_memory_gib:g} GiB each):"
                  + ("" if rows else " nothing fits; raise TP/PP or shorten --seq-len"))
            for lay in rows:
                print("    " + lay.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
