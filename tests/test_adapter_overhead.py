"""The adapter's host work at scale, made whole-array (docs/FRAMEWORKS.md "Measure"), changes no
result: detection equals the per-token radix with per-trajectory checked splits it replaced, the
whole-batch array check accepts exactly what the per-array walk accepts (and the walk still names
the failure), and the shadow index batch gives every row entry its (sequence, position).
Property tests over random batches (hypothesis); no model, no timings."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import prefix_schedule.planning.detect as detect
import prefix_schedule.planning.flat as flat_module
from prefix_schedule.planning import batch_checks
from prefix_schedule.planning.detect import FlatTrajectory, detect_prefix_trees
from test_detect import _batches, _flat


def _radix_per_token(keys, members, start):
    """detect._radix as it was: a per-token Python loop over list keys (the reference)."""
    by_token = {}
    for i in members:
        if len(keys[i]) > start:
            by_token.setdefault(int(keys[i][start]), []).append(i)
    spans = []
    for group in by_token.values():
        end = min(len(keys[i]) for i in group)
        first = keys[group[0]]
        for i in group[1:]:
            key, e = keys[i], start + 1
            while e < end and key[e] == first[e]:
                e += 1
            end = e
        span = detect._Span(start, end, group, [i for i in group if len(keys[i]) == end])
        span.children = _radix_per_token(keys, group, end)
        spans.append(span)
    return spans


def _stored(tr):
    out = {name: getattr(tr, name) for name in flat_module._STORED if name != "context_loss"}
    if tr.context_loss is not None:
        out["context_loss"] = vars(tr.context_loss)
    return out


def _same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _assert_same_detection(fast, slow):
    assert fast.sources == slow.sources
    assert (fast.shared_tokens, fast.total_tokens, fast.lost_to_loss_tokens) == \
        (slow.shared_tokens, slow.total_tokens, slow.lost_to_loss_tokens)
    assert fast.describe() == slow.describe()
    for f, s in zip(fast.batch.groups, slow.batch.groups, strict=True):
        assert torch.equal(f.prefix, s.prefix)
        assert [(n.parent, n.tokens.tolist()) for n in f.nodes] == \
            [(n.parent, n.tokens.tolist()) for n in s.nodes]
        for a, b in zip(f.trajectories, s.trajectories, strict=True):
            assert _same(_stored(a), _stored(b))


@settings(max_examples=120, deadline=None)
@given(_batches(), st.integers(2, 6), st.integers(0, 8), st.booleans())
def test_detection_equals_the_per_token_detection_it_replaced(data, min_len, overhead, cache):
    seqs, firsts = data
    flat = [_flat(s, f, i) for i, (s, f) in enumerate(zip(seqs, firsts))]
    kwargs = dict(min_shared_len=min_len, node_overhead_tokens=overhead, cache_loss_tokens=cache)
    fast = detect_prefix_trees(flat, **kwargs)
    assert flat_module.checked_splits(flat) is not None  # the batch-checked splits ran
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(detect, "_radix", _radix_per_token)
        patch.setattr(detect, "checked_splits", lambda trajectories: None)
        slow = detect_prefix_trees(flat, **kwargs)
    _assert_same_detection(fast, slow)


@pytest.mark.parametrize("field, value, message", [
    ("loss_mask", 0.5, "loss_mask must hold only 0 and 1"),
    ("advantages", float("nan"), "advantages\\[.\\] is nan"),
    ("advantages", 2e6, "normalise the advantages"),
    ("old_logprobs", 0.25, "a log-probability is <= 0"),
])
def test_a_bad_array_still_gets_its_per_trajectory_message(field, value, message):
    flat = [_flat([5, 6, 7, 8, 9, 1], 4, 0), _flat([5, 6, 7, 8, 9, 2], 4, 1)]
    getattr(flat[1], field)[5] = value  # in the suffix (the shared span is tokens 0..4)
    assert flat_module.checked_splits(flat) is None
    with pytest.raises(ValueError, match=f"^trajectory 1: .*{message}"):
        detect_prefix_trees(flat, min_shared_len=2, node_overhead_tokens=0)


EDITS = [
    lambda tr: tr.advantages.__setitem__(0, float("nan")),
    lambda tr: tr.advantages.__setitem__(0, 1e7),
    lambda tr: tr.loss_mask.__setitem__(0, 0.5),
    lambda tr: tr.old_logprobs.__setitem__(0, 0.5),
    lambda tr: tr.old_logprobs.__setitem__(0, float("-inf")),
    lambda tr: setattr(tr, "advantages", tr.advantages.double()),  # walk accepts, fast path not
    lambda tr: setattr(tr, "loss_mask", tr.loss_mask[:-1]),
    lambda tr: tr.suffix.__setitem__(0, -1),
    lambda tr: setattr(tr, "suffix", tr.suffix.float()),
]


def _walk(batch):
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(batch_checks, "_arrays_pass", lambda groups: False)
            batch_checks.check_batch_arrays(batch)
    except ValueError as error:
        return str(error)
    return None


@settings(max_examples=80, deadline=None)
@given(_batches(), st.lists(st.tuples(st.integers(0, 50), st.integers(0, len(EDITS) - 1)),
                            max_size=2))
def test_whole_batch_array_check_accepts_what_the_walk_accepts(data, edits):
    seqs, firsts = data
    flat = [_flat(s, f, i) for i, (s, f) in enumerate(zip(seqs, firsts))]
    batch = detect_prefix_trees(flat, min_shared_len=2, node_overhead_tokens=0).batch
    trajectories = [tr for group in batch.groups for tr in group.trajectories]
    for where, edit in edits:
        EDITS[edit](trajectories[where % len(trajectories)])
    walk = _walk(batch)
    fast = batch_checks._arrays_pass(batch.groups)
    assert not (fast and walk), walk  # never accepts what the walk refuses
    if walk is None:
        batch_checks.check_batch_arrays(batch)
        assert fast or any(tr.advantages.dtype != torch.float32 for tr in trajectories)
    else:
        with pytest.raises(ValueError) as raised:
            batch_checks.check_batch_arrays(batch)
        assert str(raised.value) == walk  # the same message


def test_shadow_rows_index_their_tokens(megatron_env):
    """Every loss entry of every reuse row (suffix rows and prefix-tree loss units) is labelled
    with the token at its (sequence, position): the shadow batch indexes the real rows."""
    from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter, RolloutBatch
    from megatron_patches.frameworks.indexing import SEQ_INDEX, SEQ_POSITION
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from framework_data import SMALL
    gen = torch.Generator().manual_seed(0)
    system, turn = torch.randint(1, 200, (24,), generator=gen), torch.randint(1, 200, (20,), generator=gen)
    tokens, masks = [], []
    for k in range(6):  # a tree: system prompt, a trained-on turn shared by 3, then answers
        head = torch.cat([system, turn]) if k < 3 else system
        tokens.append(torch.cat([head, torch.randint(1, 200, (5 + k,), generator=gen)]))
        mask = torch.zeros(tokens[-1].numel())
        mask[(30 if k == 0 else len(head)):] = 1.0
        masks.append(mask)
    rollout = RolloutBatch(tokens=tokens, loss_mask=masks, group_ids=[0] * 6,
                           advantages=[1.0] * 6)
    prepared = PrefixReuseAdapter(build_model(TinyLlamaConfig(**SMALL)),
                                  AdapterConfig(min_shared_len=4, node_overhead_tokens=0)
                                  ).prepare(rollout)
    assert any(g.nodes for g in prepared.step.batch.groups)
    seen = []
    step = prepared.step
    from prefix_schedule.pipeline import ActionKind
    for action in step.schedule.actions[0]:
        if action.kind not in (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD):
            continue
        step.prepare(action)
        item, step._pending = step._pending, None
        if SEQ_INDEX not in item:
            continue
        seq, pos = item[SEQ_INDEX].reshape(-1), item[SEQ_POSITION].reshape(-1)
        labels = item["labels"].reshape(-1)
        for s, p, label in zip(seq.tolist(), pos.tolist(), labels.tolist()):
            if s >= 0:
                assert label == int(tokens[s][p]), (s, p)
                seen.append((s, p))
    wanted = sorted((s, p) for s in range(6) for p in masks[s].nonzero().reshape(-1).tolist())
    assert set(wanted) <= set(seen)  # every loss token (suffix rows index all their entries)


@settings(max_examples=60, deadline=None)
@given(_batches(), st.booleans(), st.sampled_from([None, "negative id", "mask at 0", "int32",
                                                   "short advantages"]))
def test_checked_flat_trajectories_equal_the_checked_constructor(data, logprobs, bad):
    from prefix_schedule.planning.detect import checked_flat_trajectories
    seqs, firsts = data
    flats = [_flat(s, f, i) for i, (s, f) in enumerate(zip(seqs, firsts))]
    rows = [[f.tokens for f in flats], [f.loss_mask for f in flats],
            [f.advantages for f in flats],
            [f.old_logprobs for f in flats] if logprobs else None, None]
    if bad == "negative id":
        rows[0][-1] = rows[0][-1].clone().index_fill_(0, torch.tensor([0]), -1)
    elif bad == "mask at 0":
        rows[1][-1] = rows[1][-1].clone().index_fill_(0, torch.tensor([0]), 1.0)
    elif bad == "int32":
        rows[0][-1] = rows[0][-1].int()
    elif bad == "short advantages":
        rows[2][-1] = rows[2][-1][:-1]
    checked = checked_flat_trajectories(*rows)
    if bad is not None:
        assert checked is None  # the caller builds one by one: FlatTrajectory names the fault
        return
    built = [FlatTrajectory(tokens=t, loss_mask=m, advantages=a, old_logprobs=o)
             for t, m, a, o in zip(rows[0], rows[1], rows[2], rows[3] or [None] * len(flats))]
    for a, b in zip(checked, built, strict=True):
        assert _same(vars(a), vars(b))


def _rollout_error(make):
    try:
        make()
    except (ValueError, TypeError) as error:  # a string row: torch's TypeError, as before
        return f"{type(error).__name__}: {error}"
    return None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.sampled_from([None, "nan advantage", "half mask", "mask at 0",
                                           "short log-probs", "inf log-prob", "text"]),
       st.integers(0, 4))
def test_rollout_checks_at_once_name_the_same_fault(num, fault, where):
    from megatron_patches.frameworks import rollout as rollout_module
    gen = torch.Generator().manual_seed(num)
    tokens = [torch.randint(1, 50, (int(n),), generator=gen)
              for n in torch.randint(2, 9, (num,), generator=gen)]
    masks = [torch.cat([torch.zeros(1), torch.ones(t.numel() - 1)]) for t in tokens]
    adv = [float(a) for a in torch.randn(num, generator=gen)]
    old = [-torch.rand(t.numel(), generator=gen) for t in tokens]
    k = where % num
    if fault == "nan advantage":
        adv[k] = float("nan")
    elif fault == "half mask":
        masks[k] = masks[k].clone().fill_(0.5)
    elif fault == "mask at 0":
        masks[k] = torch.ones(tokens[k].numel())
    elif fault == "short log-probs":
        old[k] = old[k][:-1]
    elif fault == "inf log-prob":
        old[k] = old[k].clone().fill_(float("-inf"))
    elif fault == "text":
        old[k] = "abc"

    def make():
        return rollout_module.RolloutBatch(tokens=tokens, loss_mask=masks, group_ids=[0] * num,
                                           advantages=adv, old_logprobs=old)
    fast = _rollout_error(make)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout_module, "_float_rows_at_once", lambda *a: None)
        patch.setattr(rollout_module, "_bad_masks", lambda masks, lengths: range(len(masks)))
        walk = _rollout_error(make)
    assert fast == walk and (fault is None) == (fast is None), (fast, walk)
    if fault is None:
        built = make()
        assert all(torch.equal(a, torch.full_like(a, b)) for a, b in zip(built.advantages, adv))


def test_prepare_pauses_the_garbage_collector_and_restores_it(megatron_env):
    import gc
    from megatron_patches.frameworks.adapter import _gc_paused
    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), _gc_paused():
        raise ValueError("refused inside prepare")
    assert gc.isenabled()  # restored on a refusal too
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own setting is kept
    finally:
        gc.enable()
