"""An independent float64 reference: decoder-only LM and GRPO/PPO loss, from their definitions.

Shares NO code with the project (imports torch and the standard library only): the model, the
RoPE table (incl. Llama 3.1 frequency scaling), GQA, per-head q/k RMSNorm, SwiGLU, the per-token
log-probs, the entropy and the loss are written here again, plainly, in float64, one trajectory
at a time over its full `prefix + suffix` sequence. It reads the weights of a Megatron GPTModel
by their state-dict names and returns gradients in Megatron's layout, so a test can compare
loss and every parameter gradient with the project's dense and prefix-reuse steps.

Definitions used (see tests/test_reference.py for what each check isolates):

- RMSNorm(x) = x / sqrt(mean(x**2) + eps) * w (over the last dim).
- Llama attention with GQA: query head j reads K/V head j // (heads / kv_heads); scores
  q.k / sqrt(head_dim), causal; RoPE rotates (x[:d/2], x[d/2:]) by angle pos * inv_freq[i]
  (rotate-half convention); Qwen3: RMSNorm over head_dim on every q and k head, before RoPE.
- inv_freq[i] = theta ** (-2i / head_dim); Llama 3.1 scaling (Meta's `apply_scaling`):
  wavelength w = 2 pi / f; w < L/high: f; w > L/low: f / factor; else
  (1 - s) f / factor + s f with s = (L / w - low) / (high - low), L the original context.
- SwiGLU MLP: down(silu(gate(x)) * up(x)).
- Per token t with mask 1: r = exp(logp - old) (old = stopgrad(logp) on-policy);
  pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); KL with x = logp - ref:
  k1 = x, k2 = x**2 / 2, k3 = exp(-x) + x - 1; H = -sum_v p_v log p_v;
  loss = sum_t (pg + kl_coef * KL - entropy_coef * H) / (number of masked tokens in the batch).

Megatron weight layouts read here: `linear_qkv.weight` is grouped per K/V head as
[q heads of the group; k; v] (rows), `linear_fc1.weight` is [gate; up].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

F64 = torch.float64


@dataclass(frozen=True)
class RefModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    llama3_scaling: Optional[dict] = None  # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    qk_norm: bool = False


@dataclass(frozen=True)
class RefLossConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0


@dataclass
class RefSequence:
    """One trajectory: full token list and, per suffix token, mask / advantage / log-probs."""

    prefix: List[int]
    suffix: List[int]
    loss_mask: List[float]
    advantages: List[float]
    old_logprobs: Optional[List[float]] = None
    ref_logprobs: Optional[List[float]] = None


# ---------------------------------------------------------------------------- the model


def inv_frequencies(cfg: RefModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    freqs = []
    for i in range(d // 2):
        f = cfg.rope_theta ** (-(2.0 * i) / d)
        s = cfg.llama3_scaling
        if s is not None:
            wavelength = 2.0 * math.pi / f
            old = s["original_max_position_embeddings"]
            if wavelength < old / s["high_freq_factor"]:
                pass
            elif wavelength > old / s["low_freq_factor"]:
                f = f / s["factor"]
            else:
                smooth = (old / wavelength - s["low_freq_factor"]) / (
                    s["high_freq_factor"] - s["low_freq_factor"])
                f = (1.0 - smooth) * f / s["factor"] + smooth * f
        freqs.append(f)
    return torch.tensor(freqs, dtype=F64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [s, heads, d]; rotate pairs (x[i], x[i + d/2]) by positions * inv_freq[i]."""
    angle = positions.to(F64)[:, None] * inv_freq[None, :]  # [s, d/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class ReferenceLM:
    """float64 leaf parameters with their own names; `grads_in_megatron_layout` maps back."""

    def __init__(self, cfg: RefModelConfig, megatron_state: Dict[str, torch.Tensor]):
        self.cfg = cfg
        sd = {k: v for k, v in megatron_state.items() if torch.is_tensor(v)}
        leaf = lambda t: t.detach().to(F64).clone().requires_grad_(True)  # noqa: E731
        c = cfg
        group = c.num_heads // c.num_kv_heads
        self.p: Dict[str, torch.Tensor] = {
            "embed": leaf(sd["embedding.word_embeddings.weight"]),
            "final_norm": leaf(sd["decoder.final_layernorm.weight"]),
            "out": leaf(sd["output_layer.weight"]),
        }
        for i in range(c.num_layers):
            pre = f"decoder.layers.{i}."
            qkv = sd[pre + "self_attention.linear_qkv.weight"].reshape(
                c.num_kv_heads, group + 2, c.head_dim, c.hidden_size)
            fc1 = sd[pre + "mlp.linear_fc1.weight"]
            self.p.update({
                f"{i}.attn_norm": leaf(sd[pre + "input_layernorm.weight"]),
                f"{i}.wq": leaf(qkv[:, :group].reshape(c.num_heads * c.head_dim, c.hidden_size)),
                f"{i}.wk": leaf(qkv[:, group].reshape(c.num_kv_heads * c.head_dim, c.hidden_size)),
                f"{i}.wv": leaf(qkv[:, group + 1].reshape(c.num_kv_heads * c.head_dim, c.hidden_size)),
                f"{i}.wo": leaf(sd[pre + "self_attention.linear_proj.weight"]),
                f"{i}.mlp_norm": leaf(sd[pre + "pre_mlp_layernorm.weight"]),
                f"{i}.gate": leaf(fc1[: c.ffn_hidden_size]),
                f"{i}.up": leaf(fc1[c.ffn_hidden_size:]),
                f"{i}.down": leaf(sd[pre + "mlp.linear_fc2.weight"]),
            })
            if c.qk_norm:
                self.p[f"{i}.q_norm"] = leaf(sd[pre + "self_attention.q_layernorm.weight"])
                self.p[f"{i}.k_norm"] = leaf(sd[pre + "self_attention.k_layernorm.weight"])
        self.inv_freq = inv_frequencies(cfg)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [s] -> logits [s, V] at positions 0..s-1 (causal)."""
        c, p = self.cfg, self.p
        s = tokens.numel()
        positions = torch.arange(s)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        x = p["embed"][tokens]
        for i in range(c.num_layers):
            h = rms_norm(x, p[f"{i}.attn_norm"], c.norm_eps)
            q = (h @ p[f"{i}.wq"].T).reshape(s, c.num_heads, c.head_dim)
            k = (h @ p[f"{i}.wk"].T).reshape(s, c.num_kv_heads, c.head_dim)
            v = (h @ p[f"{i}.wv"].T).reshape(s, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, p[f"{i}.q_norm"], c.norm_eps)
                k = rms_norm(k, p[f"{i}.k_norm"], c.norm_eps)
            q, k = rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq)
            heads = []
            for j in range(c.num_heads):
                kv = j // (c.num_heads // c.num_kv_heads)
                scores = (q[:, j] @ k[:, kv].T) / math.sqrt(c.head_dim)
                scores = scores.masked_fill(~causal, float("-inf"))
                heads.append(torch.softmax(scores, dim=-1) @ v[:, kv])
            x = x + torch.cat(heads, dim=-1) @ p[f"{i}.wo"].T
            h = rms_norm(x, p[f"{i}.mlp_norm"], c.norm_eps)
            gate, up = h @ p[f"{i}.gate"].T, h @ p[f"{i}.up"].T
            x = x + (gate * torch.sigmoid(gate) * up) @ p[f"{i}.down"].T
        return rms_norm(x, p["final_norm"], c.norm_eps) @ p["out"].T

    def zero_grad(self) -> None:
        for t in self.p.values():
            t.grad = None

    def grads_in_megatron_layout(self) -> Dict[str, torch.Tensor]:
        c, g = self.cfg, {k: (v.grad if v.grad is not None else torch.zeros_like(v))
                          for k, v in self.p.items()}
        group = c.num_heads // c.num_kv_heads
        out = {"embedding.word_embeddings.weight": g["embed"],
               "decoder.final_layernorm.weight": g["final_norm"],
               "output_layer.weight": g["out"]}
        for i in range(c.num_layers):
            pre = f"decoder.layers.{i}."
            q = g[f"{i}.wq"].reshape(c.num_kv_heads, group, c.head_dim, c.hidden_size)
            k = g[f"{i}.wk"].reshape(c.num_kv_heads, 1, c.head_dim, c.hidden_size)
            v = g[f"{i}.wv"].reshape(c.num_kv_heads, 1, c.head_dim, c.hidden_size)
            out[pre + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(
                -1, c.hidden_size)
            out[pre + "input_layernorm.weight"] = g[f"{i}.attn_norm"]
            out[pre + "self_attention.linear_proj.weight"] = g[f"{i}.wo"]
            out[pre + "pre_mlp_layernorm.weight"] = g[f"{i}.mlp_norm"]
            out[pre + "mlp.linear_fc1.weight"] = torch.cat([g[f"{i}.gate"], g[f"{i}.up"]])
            out[pre + "mlp.linear_fc2.weight"] = g[f"{i}.down"]
            if c.qk_norm:
                out[pre + "self_attention.q_layernorm.weight"] = g[f"{i}.q_norm"]
                out[pre + "self_attention.k_layernorm.weight"] = g[f"{i}.k_norm"]
        return out


# ---------------------------------------------------------------------------- the loss


def suffix_logprobs_and_entropy(model: ReferenceLM, seq: RefSequence):
    """log p(suffix[i] | prefix, suffix[:i]) and the entropy there, per suffix token."""
    full = torch.tensor(seq.prefix + seq.suffix)
    logits = model.logits(full[:-1])[len(seq.prefix) - 1:]  # rows that predict the suffix
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = torch.tensor(seq.suffix)
    logp = logp_all[torch.arange(labels.numel()), labels]
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    x = logp - ref  # log pi/ref of the sampled token
    if estimator == "k1":
        return x
    if estimator == "k2":
        return x * x / 2
    if estimator == "k3":
        return torch.exp(-x) + x - 1
    raise ValueError(estimator)


def batch_loss(model: ReferenceLM, sequences: List[RefSequence], cfg: RefLossConfig):
    """Token-mean GRPO/PPO loss over every masked token of the batch (float64, differentiable),
    and the token mean of |per-token loss| (the scale a rounding error is judged against when
    the terms cancel)."""
    total = torch.zeros((), dtype=F64)
    magnitude = 0.0
    count = 0
    for seq in sequences:
        logp, entropy = suffix_logprobs_and_entropy(model, seq)
        mask = torch.tensor(seq.loss_mask, dtype=F64)
        adv = torch.tensor(seq.advantages, dtype=F64)
        old = logp.detach() if seq.old_logprobs is None else torch.tensor(seq.old_logprobs, dtype=F64)
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if cfg.kl_coef:
            ref = torch.tensor(seq.ref_logprobs, dtype=F64)
            per_token = per_token + cfg.kl_coef * kl_estimate(logp, ref, cfg.kl_estimator)
        if cfg.entropy_coef:
            per_token = per_token - cfg.entropy_coef * entropy
        total = total + (per_token * mask).sum()
        magnitude += float((per_token.detach().abs() * mask).sum())
        count += int(mask.sum())
    return total / max(count, 1), magnitude / max(count, 1)
