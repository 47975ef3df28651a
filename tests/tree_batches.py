"""Random prefix-tree batches for tests ([Note: prefix trees] in prefix_schedule/planning/tree.py)."""

import torch

from prefix_schedule.planning.data import ContextLoss, Group, GroupBatch, PrefixNode, Trajectory


def _context_loss(gen, length):
    """Loss on about half the context's tokens (a trained-on shared turn), own arrays."""
    mask = (torch.rand(length, generator=gen) > 0.5).float()
    mask[0] = 0.0
    return ContextLoss(loss_mask=mask, advantages=torch.randn(length, generator=gen),
                       old_logprobs=-torch.rand(length, generator=gen) * 6 - 1,
                       ref_logprobs=-torch.rand(length, generator=gen) * 6 - 1)


def _with_context_loss(gen, group):
    for t, tr in enumerate(group.trajectories):
        tr.context_loss = _context_loss(gen, group.context_len(t))
    return Group(prefix=group.prefix, nodes=group.nodes, trajectories=group.trajectories)


def _trajectory(gen, n, node, vocab):
    mask = (torch.rand(n, generator=gen) > 0.2).float()
    mask[0] = 1.0
    return Trajectory(suffix=torch.randint(0, vocab, (n,), generator=gen), loss_mask=mask,
                      advantages=torch.randn(n, generator=gen),
                      old_logprobs=-torch.rand(n, generator=gen) * 6 - 1,
                      ref_logprobs=-torch.rand(n, generator=gen) * 6 - 1, node=node)


def make_tree_group(gen, *, depth, branching, node_len, suffix_len, per_leaf=1, inner=0,
                    vocab=256, node_loss=False):
    """A full tree: `depth` levels of nodes (the root is level 1), `branching` children per inner
    node, `per_leaf` trajectories under each leaf node and `inner` under each inner node (their
    reads stop one token short of the node's cached K/V). Lengths vary a little around
    node_len / suffix_len. `node_loss`: every trajectory also trains on tokens of its shared
    context (ContextLoss)."""
    def length(base):
        return max(2, base + int(torch.randint(-2, 3, (1,), generator=gen)))

    prefix = torch.randint(0, vocab, (length(node_len),), generator=gen)
    nodes, level = [], [0]
    for _ in range(depth - 1):
        nxt = []
        for parent in level:
            for _ in range(branching):
                nodes.append(PrefixNode(parent=parent, tokens=torch.randint(
                    0, vocab, (length(node_len),), generator=gen)))
                nxt.append(len(nodes))
        level = nxt
    leaves = set(level)
    trajectories = []
    for node in range(len(nodes) + 1):
        count = per_leaf if node in leaves else inner
        trajectories += [_trajectory(gen, length(suffix_len), node, vocab) for _ in range(count)]
    group = Group(prefix=prefix, nodes=nodes, trajectories=trajectories)
    return _with_context_loss(gen, group) if node_loss else group


def make_tree_batch(seed, specs, vocab=256):
    """specs: one dict of make_tree_group's keyword arguments per group."""
    gen = torch.Generator().manual_seed(seed)
    return GroupBatch(groups=[make_tree_group(gen, vocab=vocab, **spec) for spec in specs])
