"""Synthetic RL traces with realistic length distributions, seeded and reproducible.

Two kinds, after the prefix ratios seen in practice (../docs and the paper's cost model):

- `rag`: long-context retrieval / multimodal RLVR. Each group's prefix share P / mean(P + n)
  is drawn uniformly from [0.80, 0.98]; prompts are long (P ~ 0.55-1.0 x the length scale),
  responses short. Rewards are continuous (answer F1-like, in [0, 1]).
- `math`: math / code reasoning. Prefix share uniform in [0.02, 0.12]; short prompts, long
  responses. Rewards are binary (pass / fail).

Group sizes are drawn from `group_sizes` (default 8, 16, 32, 64). Within a group the response
lengths vary log-normally (sigma 0.35) around the mean the share implies; a group whose longest
row would exceed max_seq_len is scaled down as a whole (its share stays). Advantages are GRPO's (per response, broadcast over its tokens); old and
reference log-probs sit near log(1/V) with a little noise (an untrained model's), so the PPO
ratio and the KL term are both exercised; about one response in ten gets a masked span (a tool
output inside the response). Everything is drawn from one numpy Generator(seed): the same
arguments give byte-identical traces on any machine.

`max_seq_len` scales the lengths (the longest P + n); the shares do not depend on it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prefix_schedule.losses import grpo_advantages
from prefix_schedule.planning.data import Group, GroupBatch, Trajectory

__all__ = ["SynthConfig", "KINDS", "synth_steps"]

KINDS = {"rag": (0.80, 0.98), "math": (0.02, 0.12)}
"""kind -> range of the per-group prefix share."""


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """What `tools/trace.py synth` generates."""

    kind: str
    """"rag" (prefix share 80-98%) or "math" (2-12%)."""
    steps: int
    """Optimizer steps."""
    seed: int = 0
    """Seed of every draw."""
    groups_per_step: int = 4
    """Groups (prompts) per step."""
    group_sizes: tuple = (8, 16, 32, 64)
    """Group sizes to draw from, uniformly."""
    max_seq_len: int = 4096
    """Longest prompt + response (the length scale)."""
    vocab_size: int = 32000
    """Token ids are drawn from [0, vocab_size)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}; choose one of {sorted(KINDS)}")
        for name, minimum in (("steps", 1), ("seed", 0), ("groups_per_step", 1),
                              ("max_seq_len", 16), ("vocab_size", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r}; give an int >= {minimum}")
        sizes = tuple(self.group_sizes)
        if not sizes or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in sizes):
            raise ValueError(f"group_sizes={self.group_sizes!r}; give one or more ints >= 1")
        object.__setattr__(self, "group_sizes", sizes)


def _lengths(config: SynthConfig, rng: np.random.Generator, size: int) -> tuple[int, list[int]]:
    """(P, [n_i]) of one group: P / mean(P + n_i) is the drawn share (up to rounding), and the
    longest P + n_i fits max_seq_len."""
    low, high = KINDS[config.kind]
    share = rng.uniform(low, high)
    total = rng.uniform(0.45, 0.85) * config.max_seq_len  # mean dense length before fitting
    spread = rng.lognormal(mean=-0.35 ** 2 / 2, sigma=0.35, size=size)
    spread = spread / spread.mean()  # mean response = (1 - share) * total exactly
    prompt, responses = share * total, (1 - share) * total * spread
    fit = min(1.0, config.max_seq_len / (prompt + responses.max()))
    # rounding (and the floors of 2 and 1 tokens) can add a token: clip to max_seq_len
    p = min(max(2, int(round(prompt * fit))), config.max_seq_len - 1)
    return p, [min(max(1, int(round(n * fit))), config.max_seq_len - p) for n in responses]


def _trajectory(config: SynthConfig, rng: np.random.Generator, n: int, advantage: float) -> Trajectory:
    uniform = -math.log(config.vocab_size)
    mask = np.ones(n, dtype=np.float32)
    if n >= 8 and rng.random() < 0.1:  # a tool output inside the response: no loss there
        start = int(rng.integers(1, n // 2))
        mask[start:start + int(rng.integers(1, n // 4 + 1))] = 0
    old = np.minimum(uniform + 0.1 * rng.standard_normal(n), 0.0)
    ref = np.minimum(uniform + 0.1 * rng.standard_normal(n), 0.0)
    return Trajectory(suffix=rng.integers(0, config.vocab_size, n), loss_mask=mask,
                      advantages=advantage, old_logprobs=old.astype(np.float32),
                      ref_logprobs=ref.astype(np.float32))


def _rewards(config: SynthConfig, rng: np.random.Generator, size: int) -> np.ndarray:
    if config.kind == "math":
        return (rng.random(size) < rng.uniform(0.1, 0.9)).astype(np.float64)
    return np.clip(rng.beta(2.0, 2.0, size) + 0.1 * rng.standard_normal(size), 0.0, 1.0)


def synth_steps(config: SynthConfig) -> Iterator[tuple[GroupBatch, list]]:
    """(GroupBatch, rewards per group) for each step, in order."""
    rng = np.random.default_rng(config.seed)
    for _ in range(config.steps):
        groups, rewards = [], []
        for _ in range(config.groups_per_step):
            size = int(config.group_sizes[int(rng.integers(len(config.group_sizes)))])
            prompt, responses = _lengths(config, rng, size)
            reward = _rewards(config, rng, size)
            advantages = grpo_advantages(reward).tolist()
            prefix = rng.integers(0, config.vocab_size, prompt)
            groups.append(Group(prefix=prefix, trajectories=[
                _trajectory(config, rng, n, a) for n, a in zip(responses, advantages)]))
            rewards.append(reward.tolist())
        yield GroupBatch(groups=groups), rewards
