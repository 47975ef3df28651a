"""The training runs of tools/replay.py: one Megatron model each, trained with AdamW on fp32
master weights (Megatron's mixed-precision layout), and how two runs' weights are compared.

A run = a tiny Llama GPTModel (megatron_patches.models.tiny) in Megatron's DDP wrapper with fp32 gradient
accumulation (`grad_reduce_in_fp32=True`: `main_grad` buffers) and `finalize_model_grads` (token-mean
over the step), fp32 master weights, torch AdamW on them, global-norm gradient clipping as
Megatron's optimizer does it (coefficient max_norm / (norm + 1e-6)), and the master weights
copied back into the model (a bf16 model gets them rounded). Dense runs step through Megatron's
stock schedule, the reuse run through the prefix-reuse schedule; nothing else differs.

[Note: relative parameter difference]
For a run `a` against the reference `r` (both fp32 master weights after the same update), every
entry's difference is divided by its tensor's scale, max |r| over that tensor (the test suite's
`max_relative_diff` scale): d = |a - r| / max|r_T|. `max` is the largest d over all entries of
all tensors (= max_relative_diff), `mean` the mean of d over all entries, `rmse` the root mean
square of d. A tensor whose reference is all zeros uses scale 1.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

__all__ = ["Run", "param_diff", "ModelShape"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The replayed model (a tiny Llama: RoPE, SwiGLU, RMSNorm, GQA)."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_attention_heads: int = 4
    num_query_groups: int = 2

    def config(self, *, vocab_size: int, max_seq_len: int, dtype: torch.dtype):
        from megatron_patches.models.tiny import TinyLlamaConfig

        return TinyLlamaConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                               ffn_hidden_size=self.ffn_hidden_size,
                               num_attention_heads=self.num_attention_heads,
                               num_query_groups=self.num_query_groups, vocab_size=vocab_size,
                               max_seq_len=max_seq_len, params_dtype=dtype)


class Run:
    """One model trained on the trace: `kind` "dense" or "reuse"."""

    def __init__(self, name: str, kind: str, cfg, weights: dict, *, fused_attention: bool,
                 lr: float, eps: float, weight_decay: float, clip_grad: float) -> None:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron_patches.models.tiny import build_model

        self.name, self.kind, self.clip_grad = name, kind, clip_grad
        model = build_model(cfg, fused_attention=fused_attention, seed=None)
        model.load_state_dict({k: v.to(cfg.params_dtype) for k, v in weights.items()}, strict=False)
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = self.model.no_sync
        self.params = dict(model.named_parameters())
        self.master = {n: torch.nn.Parameter(weights[n].detach().float().clone())
                       for n in self.params}
        self.optimizer = torch.optim.AdamW(list(self.master.values()), lr=lr, eps=eps,
                                           weight_decay=weight_decay)

    def train_step(self, batch, plan, loss_config) -> dict:
        """One optimizer step on `batch`: {loss, grad_norm, seconds}."""
        from benchlib.steps import dense_step, reuse_step  # items moved to the model's device

        self.model.zero_grad_buffer()
        start = time.perf_counter()
        if self.kind == "reuse":
            result = reuse_step(self.model, batch, plan, loss_config)
        else:
            result = dense_step(self.model, batch, loss_config)
        norm = self._apply_update()
        return {"loss": result.loss, "grad_norm": norm, "seconds": time.perf_counter() - start}

    def _apply_update(self) -> float:
        from megatron_patches.runtime.finite_grads import check_finite_grads

        check_finite_grads(self.model, run=self.name)  # before AdamW touches the weights
        grads = []
        for name, master in self.master.items():
            g = self.params[name].main_grad
            master.grad = g.detach().float().clone()
            grads.append(master.grad)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for g in grads:
                    g.mul_(coeff)
        self.optimizer.step()
        with torch.no_grad():
            for name, master in self.master.items():
                self.params[name].copy_(master)
        return norm

    def weights(self) -> dict:
        return {n: m.detach() for n, m in self.master.items()}

    # ---- checkpoints (safetensors: no pickle)
    def state_tensors(self) -> dict:
        out = {}
        for name, master in self.master.items():
            out[f"w.{name}"] = master.detach().cpu().contiguous()
            state = self.optimizer.state.get(master, {})
            if state:
                out[f"m.{name}"] = state["exp_avg"].cpu().contiguous()
                out[f"v.{name}"] = state["exp_avg_sq"].cpu().contiguous()
                out[f"step.{name}"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
        return out

    def load_state_tensors(self, tensors: dict) -> None:
        with torch.no_grad():
            for name, master in self.master.items():
                master.copy_(tensors[f"w.{name}"])
                self.params[name].copy_(master)
                if f"m.{name}" in tensors:
                    self.optimizer.state[master] = {
                        "step": tensors[f"step.{name}"].reshape(()).clone(),
                        "exp_avg": tensors[f"m.{name}"].to(master.device),
                        "exp_avg_sq": tensors[f"v.{name}"].to(master.device)}

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.state_tensors(), str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.load_state_tensors(load_file(str(path)))


def param_diff(reference: dict, other: dict) -> dict:
    """{max, mean, rmse} of the relative parameter difference ([Note: relative parameter
    difference] above); all three inf when either side holds a NaN or inf (a NaN would vanish
    from a max fold and read as agreement)."""
    worst, total, squares, count = 0.0, 0.0, 0.0, 0
    for name, ref in reference.items():
        r, a = ref.double(), other[name].double()
        if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(a).all())):
            return {"max": math.inf, "mean": math.inf, "rmse": math.inf}
        scale = float(r.abs().max()) or 1.0
        d = (a - r).abs() / scale
        worst = max(worst, float(d.max()))
        total += float(d.sum())
        squares += float(d.pow(2).sum())
        count += d.numel()
    return {"max": worst, "mean": total / count, "rmse": math.sqrt(squares / count)}


def initial_weights(cfg, seed: int, round_to: Optional[torch.dtype]) -> dict:
    """The shared starting weights: a reference model's initialisation (seed), optionally
    rounded to `round_to` (bf16 replays start every run from the bf16-rounded weights, so the
    comparison measures training, not the initial rounding)."""
    from megatron_patches.models.tiny import build_model

    model = build_model(cfg, seed=seed)
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    if round_to is not None:
        weights = {n: w.to(round_to).float() for n, w in weights.items()}
    return weights
