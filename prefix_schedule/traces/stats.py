"""Validate a trace and summarise it, streaming: steps, group sizes, lengths, prefix share, and
the FLOP model's ideal speedup of prefix reuse on it for a given model shape.

Prefix share of a group = P / mean(P + n_i): the fraction of the group's dense tokens that are
its shared prompt (what the paper's "prefix ratio" measures).
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, dense_flops, reuse_flops
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.traces.io import PathLike, read_header, read_steps

__all__ = ["TraceStats", "validate_trace", "MODEL_PRESETS"]

MODEL_PRESETS = {
    "llama3-8b": ModelDims(num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                           num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                           gated_linear_unit=True),
    "qwen3-8b": ModelDims(num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                          num_attention_heads=32, num_query_groups=8, vocab_size=151936,
                          gated_linear_unit=True, kv_channels=128),
}
"""Shapes for the ideal-speedup column of `tools/trace.py stats` (from the models' configs)."""


@dataclass
class TraceStats:
    """What `validate_trace` saw (every field filled in one streaming pass)."""

    num_steps: int = 0
    num_groups: int = 0
    num_trajectories: int = 0
    prefix_tokens: int = 0
    """Shared-prompt tokens, counted once per group."""
    dense_tokens: int = 0
    """sum over trajectories of P + n (what a dense trainer processes)."""
    prompt_copies: int = 0
    """sum over trajectories of P (the prompt tokens a dense trainer processes)."""
    loss_tokens: int = 0
    max_seq_len: int = 0
    """Longest P + n."""
    max_response_len: int = 0
    vocab_size: Optional[int] = None
    max_token_id: int = 0
    has_old_logprobs: Optional[bool] = None
    has_ref_logprobs: Optional[bool] = None
    group_sizes: Counter = field(default_factory=Counter)
    prefix_shares: list = field(default_factory=list)
    flops: dict = field(default_factory=dict)
    """model name -> [dense FLOPs, reuse FLOPs] summed over the steps."""

    @property
    def reuse_tokens(self) -> int:
        """Tokens a prefix-reuse step processes: each prompt once plus every response."""
        return self.prefix_tokens + self.dense_tokens - self.prompt_copies

    def ideal_speedup(self, model: str) -> float:
        dense, reuse = self.flops[model]
        return dense / reuse

    def add_step(self, batch: GroupBatch, models: dict) -> None:
        self.num_steps += 1
        for group in batch.groups:
            p, lengths = group.prefix_len, [t.num_tokens for t in group.trajectories]
            self.num_groups += 1
            self.num_trajectories += len(lengths)
            self.group_sizes[len(lengths)] += 1
            self.prefix_tokens += p
            self.prompt_copies += p * len(lengths)
            self.dense_tokens += sum(p + n for n in lengths)
            self.loss_tokens += sum(t.num_loss_tokens for t in group.trajectories)
            self.max_seq_len = max(self.max_seq_len, p + max(lengths))
            self.max_response_len = max(self.max_response_len, max(lengths))
            self.max_token_id = max(self.max_token_id, int(group.prefix.max()),
                                    *(int(t.suffix.max()) for t in group.trajectories))
            self.prefix_shares.append(p / statistics.fmean(p + n for n in lengths))
        self._check_presence(batch)
        self._add_flops(batch, models)

    def _check_presence(self, batch: GroupBatch) -> None:
        for name in ("has_old_logprobs", "has_ref_logprobs"):
            value = getattr(batch, name)
            if getattr(self, name) is None:
                setattr(self, name, value)
            elif getattr(self, name) != value:
                kind = name[len("has_"):]
                raise ValueError(f"step {self.num_steps - 1}: {kind} are "
                                 f"{'present' if value else 'absent'} but earlier steps "
                                 f"{'lack' if value else 'have'} them; give {kind} in every "
                                 "step or in none")

    def _add_flops(self, batch: GroupBatch, models: dict) -> None:
        longest = max(g.prefix_len + t.num_tokens for g in batch.groups for t in g.trajectories)
        plan = plan_microbatches(batch, token_budget=longest, max_seq_len=longest)
        rows = [g.prefix_len - 1 + t.num_tokens for g in batch.groups for t in g.trajectories]
        for name, dims in models.items():
            totals = self.flops.setdefault(name, [0.0, 0.0])
            totals[0] += dense_flops(dims, rows)
            totals[1] += reuse_flops(dims, plan)

    def summary(self) -> dict:
        """JSON-ready summary (what `tools/trace.py stats --json` writes)."""
        shares = sorted(self.prefix_shares) or [0.0]
        q = lambda f: shares[min(len(shares) - 1, int(f * len(shares)))]  # noqa: E731
        return {
            "steps": self.num_steps, "groups": self.num_groups,
            "trajectories": self.num_trajectories,
            "group_sizes": dict(sorted(self.group_sizes.items())),
            "prefix_share": {"min": shares[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9),
                             "max": shares[-1],
                             "token_weighted": self.prompt_copies / max(self.dense_tokens, 1)},
            "dense_tokens": self.dense_tokens, "reuse_tokens": self.reuse_tokens,
            "token_ratio": self.dense_tokens / max(self.reuse_tokens, 1),
            "loss_tokens": self.loss_tokens, "max_seq_len": self.max_seq_len,
            "max_response_len": self.max_response_len, "vocab_size": self.vocab_size,
            "max_token_id": self.max_token_id,
            "old_logprobs": bool(self.has_old_logprobs), "ref_logprobs": bool(self.has_ref_logprobs),
            "ideal_speedup": {name: self.ideal_speedup(name) for name in self.flops},
        }


def validate_trace(path: PathLike, *, vocab_size: Optional[int] = None,
                   max_steps: Optional[int] = None, models: Optional[dict] = None) -> TraceStats:
    """Read the whole trace, a step at a time, checking every field; return its statistics.
    ValueError (naming line, step, group, response, entry) on the first malformed field.
    `models`: name -> ModelDims for the ideal-speedup figures (default MODEL_PRESETS)."""
    header = read_header(path)
    stats = TraceStats(vocab_size=vocab_size if vocab_size is not None else header.vocab_size)
    models = MODEL_PRESETS if models is None else models
    for batch in read_steps(path, stop=max_steps, vocab_size=vocab_size):
        stats.add_step(batch, models)
    if stats.num_steps == 0:
        raise ValueError(f"{path}: the trace has a header but no groups; write at least one step")
    return stats
