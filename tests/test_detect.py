"""Shared-prefix detection ([Note: detecting prefix trees] in prefix_schedule/planning/detect.py):
property tests over random token sequences (hypothesis, derandomized in CI), plus examples."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.planning.detect import FlatTrajectory, detect_prefix_trees


def _flat(tokens, first_loss, seed=0):
    n = len(tokens)
    gen = torch.Generator().manual_seed(seed)
    mask = [0.0] * min(first_loss, n) + [1.0] * max(0, n - first_loss)
    return FlatTrajectory(tokens=tokens, loss_mask=mask, advantages=torch.randn(n, generator=gen),
                          old_logprobs=-torch.rand(n, generator=gen))


def _common(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def _shared_through_nodes(group, node_a, node_b):
    chain_a, chain_b = group.chain(node_a), group.chain(node_b)
    common = _common(list(chain_a), list(chain_b))
    return sum(group.node_tokens(n).numel() for n in chain_a[:common])


@st.composite
def _batches(draw):
    """Sequences built by branching: each new one copies a random prefix of an earlier one."""
    seqs = []
    for _ in range(draw(st.integers(1, 9))):
        tail = draw(st.lists(st.integers(0, 2), min_size=1, max_size=25))
        if seqs and draw(st.booleans()):
            base = seqs[draw(st.integers(0, len(seqs) - 1))]
            seqs.append(base[:draw(st.integers(0, len(base)))] + tail)
        else:
            seqs.append(tail)
    seqs = [s if len(s) >= 2 else s + [0] for s in seqs]
    firsts = [draw(st.integers(1, len(s))) for s in seqs]
    return seqs, firsts


@settings(max_examples=150, deadline=None)
@given(_batches(), st.integers(2, 6), st.booleans())
def test_detection_finds_every_shared_span_of_min_length(data, min_len, cache_loss_tokens):
    seqs, firsts = data
    flat = [_flat(s, f, i) for i, (s, f) in enumerate(zip(seqs, firsts))]
    det = detect_prefix_trees(flat, min_shared_len=min_len, node_overhead_tokens=0,
                              cache_loss_tokens=cache_loss_tokens)
    where = {}
    for g, (group, sources) in enumerate(zip(det.batch.groups, det.sources)):
        for t, i in enumerate(sources):
            tr = group.trajectories[t]
            # nothing lost or moved: context + suffix is the sequence, arrays are its tail
            assert torch.cat([group.context(tr.node), tr.suffix]).tolist() == seqs[i]
            context = group.context_len(t)
            assert torch.equal(tr.loss_mask, flat[i].loss_mask[context:])
            assert torch.equal(tr.advantages, flat[i].advantages.float()[context:])
            assert context <= flat[i].shareable(cache_loss_tokens)
            assert tr.num_loss_tokens == flat[i].loss_mask.sum()  # every loss token, once
            if tr.context_loss is not None:  # loss inside the shared context keeps its arrays
                assert torch.equal(tr.context_loss.loss_mask, flat[i].loss_mask[:context])
                assert torch.equal(tr.context_loss.old_logprobs,
                                   flat[i].old_logprobs.float()[:context])
            else:
                assert not flat[i].loss_mask[:context].any()
            where[i] = (g, tr.node)
    assert sorted(where) == list(range(len(seqs)))
    keys = [s[:f.shareable(cache_loss_tokens)] for s, f in zip(seqs, flat)]
    for i in range(len(seqs)):
        for j in range(i + 1, len(seqs)):
            common = _common(keys[i], keys[j])
            (gi, ni), (gj, nj) = where[i], where[j]
            shared = (_shared_through_nodes(det.batch.groups[gi], ni, nj) if gi == gj else 0)
            assert shared <= common
            assert common - shared < min_len, (i, j, common, shared)


def test_multi_turn_tree_and_report():
    system = list(range(100, 140))
    turn = {k: [k] * 20 for k in range(4)}
    seqs = [system + turn[0] + turn[1] + [7, 8, 9], system + turn[0] + turn[1] + [5, 5],
            system + turn[0] + turn[2] + [6] * 4, system + turn[3] + [1, 2],
            [9] * 30]
    first_loss = [len(s) - 2 for s in seqs]
    det = detect_prefix_trees([_flat(s, f) for s, f in zip(seqs, first_loss)], min_shared_len=8,
                              node_overhead_tokens=16)
    tree, lone = det.batch.groups
    assert det.sources == ((0, 1, 2, 3), (4,))
    assert tree.prefix.tolist() == system  # system prompt shared by 4, then turn 0 by 3, ...
    # turn 2 and turn 3 belong to one trajectory each: no node
    assert [(n.parent, n.tokens.numel()) for n in tree.nodes] == [(0, 20), (1, 20)]
    assert [t.node for t in tree.trajectories] == [2, 2, 1, 0]
    assert lone.prefix_len == 1 and not lone.nodes  # shares nothing: runs dense
    assert det.shared_tokens == (4 * 40 + 3 * 20 + 2 * 20) - (40 + 20 + 20)
    assert "2 groups" in det.describe()


def test_loss_tokens_inside_shared_spans():
    prompt, answer = list(range(50, 70)), [3] * 10
    seqs = [prompt + answer + [1, 2], prompt + answer + [4, 5]]
    flat = [_flat(seqs[0], 20), _flat(seqs[1], 30)]  # trajectory 0 trains on the shared answer
    # cached with the answer: trajectory 0 keeps its loss there as a ContextLoss
    (group,) = detect_prefix_trees(flat, min_shared_len=4, node_overhead_tokens=0).batch.groups
    assert group.prefix.tolist() == prompt + answer
    assert group.trajectories[0].context_loss.loss_mask.sum() == 10
    assert group.trajectories[1].context_loss is None
    # cache_loss_tokens=False: sharing stops before the first loss token, and says what it lost
    det = detect_prefix_trees(flat, min_shared_len=4, node_overhead_tokens=0,
                              cache_loss_tokens=False)
    (group,) = det.batch.groups
    assert group.prefix.tolist() == prompt and not group.nodes
    assert group.trajectories[0].loss_mask.sum() == 12
    assert det.lost_to_loss_tokens == 2 * 10  # per trajectory: each could have shared 10 more


def test_overhead_drops_spans_that_save_too_little():
    a, b = [1] * 10 + [2, 3], [1] * 10 + [4, 5]
    kept = detect_prefix_trees([_flat(a, 11), _flat(b, 11)], min_shared_len=4,
                               node_overhead_tokens=10)
    dropped = detect_prefix_trees([_flat(a, 11), _flat(b, 11)], min_shared_len=4,
                                  node_overhead_tokens=11)
    assert len(kept.batch.groups) == 1 and len(dropped.batch.groups) == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(tokens=[1], loss_mask=[0], advantages=1.0), ">= 2"),
    (dict(tokens=[1, 2], loss_mask=[1, 1], advantages=1.0), "loss_mask\\[0\\]"),
    (dict(tokens=[1, 2], loss_mask=[0], advantages=1.0), "one per token"),
    (dict(tokens=[1, 2, 3], loss_mask=[0, 1, 1], advantages=[1.0]), "advantages"),
])
def test_bad_flat_trajectories_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FlatTrajectory(**kwargs)


def test_bad_detection_arguments_are_refused():
    ok = _flat([1, 2, 3], 1)
    with pytest.raises(ValueError, match="min_shared_len"):
        detect_prefix_trees([ok], min_shared_len=1)
    with pytest.raises(ValueError, match="no trajectories"):
        detect_prefix_trees([])
    with pytest.raises(ValueError, match="trajectory 1"):
        detect_prefix_trees([ok, [1, 2]])
