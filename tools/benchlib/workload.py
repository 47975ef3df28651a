"""The benchmark workload: G trajectories per group sharing one prompt, random tokens."""
from __future__ import annotations

import math

import torch

from prefix_schedule.planning.data import Group, GroupBatch, PrefixNode, Trajectory

__all__ = ["config_batch", "make_batch", "make_tree_batch"]


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


def make_tree_batch(*, depth: int, branching: int, node_len: int, suffix_len: int,
                    per_leaf: int, num_groups: int, vocab_size: int, seed: int) -> GroupBatch:
    """Prefix trees ([Note: prefix trees] in prefix_schedule/planning/tree.py): per group a root
    of `node_len` tokens, `depth - 1` more levels of `branching` children each, `per_leaf`
    trajectories of `suffix_len` tokens under every leaf node; arrays as `make_batch`."""
    gen = torch.Generator().manual_seed(seed)
    uniform = -math.log(vocab_size)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab_size, (n,), generator=gen)

    def near_uniform() -> torch.Tensor:
        return uniform + 0.1 * torch.randn(suffix_len, generator=gen)

    groups = []
    for _ in range(num_groups):
        nodes, level = [], [0]
        for _ in range(depth - 1):
            nxt = []
            for parent in level:
                for _ in range(branching):
                    nodes.append(PrefixNode(parent=parent, tokens=tokens(node_len)))
                    nxt.append(len(nodes))
            level = nxt
        trajectories = [Trajectory(suffix=tokens(suffix_len), node=leaf,
                                   advantages=torch.randn(suffix_len, generator=gen),
                                   old_logprobs=near_uniform(), ref_logprobs=near_uniform())
                        for leaf in level for _ in range(per_leaf)]
        if per_leaf == 1 and depth > 1:  # a leaf read by one trajectory is not shared
            trajectories = [_fold(nodes[t.node - 1], t) for t in trajectories]
            nodes = nodes[:len(nodes) - len(level)]
        groups.append(Group(prefix=tokens(node_len), nodes=nodes, trajectories=trajectories))
    return GroupBatch(groups=groups)


def _fold(leaf: PrefixNode, trajectory: Trajectory) -> Trajectory:
    """The trajectory after the leaf's parent, the leaf's tokens leading its suffix without loss
    (what detection makes of a node only one trajectory reads): the same dense row."""
    zeros = torch.zeros(leaf.tokens.numel())
    return Trajectory(suffix=torch.cat([leaf.tokens, trajectory.suffix]), node=leaf.parent,
                      loss_mask=torch.cat([zeros, trajectory.loss_mask]),
                      advantages=torch.cat([zeros, trajectory.advantages]),
                      old_logprobs=torch.cat([zeros - 1, trajectory.old_logprobs]),
                      ref_logprobs=torch.cat([zeros - 1, trajectory.ref_logprobs]))


def config_batch(config) -> GroupBatch:
    """The batch the bench runs for a BenchConfig (its tree or one-level shape, its seed)."""
    if config.tree is not None:
        depth, branching = config.tree_shape
        return make_tree_batch(depth=depth, branching=branching, node_len=config.node_len,
                               suffix_len=config.suffix_len, per_leaf=config.group_size,
                               num_groups=config.num_groups, vocab_size=config.vocab_size,
                               seed=config.seed)
    return make_batch(prefix_len=config.prefix_len, suffix_len=config.suffix_len,
                      group_size=config.group_size, num_groups=config.num_groups,
                      vocab_size=config.vocab_size, seed=config.seed)
