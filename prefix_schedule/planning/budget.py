"""plan_microbatches' checks of its budget and dense groups, before any packing."""
from __future__ import annotations

from prefix_schedule.planning.data import GroupBatch

__all__ = ["check_budget", "check_dense_groups"]


def padding_of(length: int, multiple: int) -> int:
    """Padding tokens that make a row of `length` tokens a multiple of `multiple`."""
    return -length % multiple


def check_dense_groups(batch: GroupBatch, dense_groups, capacity: int, multiple: int) -> frozenset:
    groups = frozenset(dense_groups)
    for g in sorted(groups):
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(batch.groups):
            raise ValueError(f"dense_groups names group {g!r}; the batch has groups 0.."
                             f"{len(batch.groups) - 1}")
        group = batch.groups[g]
        longest = max(group.context_len(t) - 1 + tr.num_tokens
                      for t, tr in enumerate(group.trajectories))
        if longest + padding_of(longest, multiple) > capacity:
            raise ValueError(f"group {g} is to run dense but its longest row has {longest} tokens, "
                             f"over the token budget; use token_budget >= "
                             f"{longest + padding_of(longest, multiple)} or let it use the cache")
    return groups


def check_budget(batch: GroupBatch, token_budget: int, multiple: int) -> None:
    # With the cache a row is n tokens (+ padding); a singleton only runs dense when its full row
    # fits, so the smallest workable budget is the longest suffix, padded.
    longest, where = 0, ""
    for g, group in enumerate(batch.groups):
        for t, trajectory in enumerate(group.trajectories):
            if trajectory.num_tokens > longest:
                longest, where = trajectory.num_tokens, f"group {g}, trajectory {t}"
    needed = longest + padding_of(longest, multiple)
    if token_budget < needed:
        padded = f" padded to a multiple of {multiple}" if needed != longest else ""
        raise ValueError(f"token_budget={token_budget} is smaller than the longest row: {where} needs "
                         f"{needed} tokens{padded}; use token_budget >= {needed}")
