"""The benchmark workload: G trajectories per group sharing one prompt, random tokens."""
from __future__ import annotations

import math

import torch

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory

__all__ = ["make_batch"]


def make_batch(*, prefix_len: int, suffix_len: int, group_size: int, num_groups: int,
               vocab_size: int, seed: int) -> GroupBatch:
    """Random prompts and responses; per-token random advantages; old/ref log-probs near uniform.

    Old and reference log-probs sit around log(1/V), where an untrained model's log-probs are,
    so the importance ratios stay near 1 and both the clip and the KL term are exercised.
    """
    gen = torch.Generator().manual_seed(seed)
    uniform = -math.log(vocab_size)
    n = suffix_len

    def near_uniform() -> torch.Tensor:
        return uniform + 0.1 * torch.randn(n, generator=gen)

    groups = []
    for _ in range(num_groups):
        prefix = torch.randint(0, vocab_size, (prefix_len,), generator=gen)
        trajectories = [
            Trajectory(suffix=torch.randint(0, vocab_size, (n,), generator=gen),
                       advantages=torch.randn(n, generator=gen),
                       old_logprobs=near_uniform(), ref_logprobs=near_uniform())
            for _ in range(group_size)
        ]
        groups.append(Group(prefix=prefix, trajectories=trajectories))
    return GroupBatch(groups=groups)
