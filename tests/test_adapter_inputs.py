"""Bad inputs to the framework adapter (issue 36's probe, issue 37's token ids), one table per
input kind: per sequence (`RolloutBatch(...)`), padded (`from_padded`), packed THD
(`from_packed`), and the loss function's returns. Each case asserts a ValueError whose message
names the field and what to pass ([Note: adapter inputs are refused, never guessed] in
megatron_patches/frameworks/input_checks.py); the loss cases also assert that the refusal comes
before the optimizer could run (a NaN loss) or before Megatron's own code raises another error.
"""
from __future__ import annotations

import pytest
import torch

from megatron_patches.frameworks.rollout import RolloutBatch

N = 6


def _mask(n=N):
    return torch.cat([torch.zeros(2), torch.ones(n - 2)])


def _seq(**over):
    base = dict(tokens=[torch.arange(1, N + 1), torch.arange(2, N + 2)], loss_mask=[_mask(), _mask()],
                group_ids=[0, 0])
    base.update(over)
    return base


PER_SEQUENCE = [
    ("float ids", _seq(tokens=[torch.arange(N) + 0.7, torch.arange(N) + 0.2]),
     ["tokens[0]", "float32", "truncated", "integer token ids"]),
    ("bool ids", _seq(tokens=[torch.ones(N, dtype=torch.bool)] * 2), ["tokens[0]", "bool", "0/1"]),
    ("2-D ids", _seq(tokens=[torch.arange(N).reshape(2, 3)] * 2), ["tokens[0]", "(2, 3)", "1-D"]),
    ("fractional group ids", _seq(group_ids=[0.5, 1.25]), ["group_ids[0]", "whole number", "int or str"]),
    ("bool group ids", _seq(group_ids=[True, False]), ["group_ids[0]", "bool"]),
    ("unhashable group ids", _seq(group_ids=[[0], [1]]), ["group_ids[0]", "unhashable list"]),
    ("group id rows", _seq(group_ids=[torch.zeros(2), torch.zeros(2)]), ["group_ids[0]", "shape (2,)"]),
    ("too few group ids", _seq(group_ids=[0]), ["group_ids", "one group id per sequence"]),
    ("all-zero loss masks", _seq(loss_mask=[torch.zeros(N)] * 2), ["loss_mask", "0 at every token",
                                                                    "train nothing"]),
    ("loss mask of 0.5", _seq(loss_mask=[_mask() * 0.5] * 2), ["loss_mask[0]", "0/1"]),
    ("short loss mask", _seq(loss_mask=[_mask(N - 1)] * 2), ["loss_mask[0]", "one value per token"]),
    ("advantages [n, 1]", _seq(advantages=[torch.ones(N, 1)] * 2), ["advantages[0]", "(6, 1)"]),
    ("NaN old log-probs", _seq(old_logprobs=[torch.full((N,), float("nan"))] * 2),
     ["old_logprobs[0]", "NaN"]),
]


@pytest.mark.parametrize("name, kwargs, words", PER_SEQUENCE, ids=[c[0] for c in PER_SEQUENCE])
def test_per_sequence_inputs_refused(name, kwargs, words):
    with pytest.raises(ValueError) as info:
        RolloutBatch(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_tensor_group_ids_are_values_not_objects():
    """0-dim tensors hash by identity: each sequence would be its own group (no reuse)."""
    batch = RolloutBatch(**_seq(group_ids=list(torch.tensor([7, 7]))))
    assert batch.group_ids == [7, 7] and all(type(g) is int for g in batch.group_ids)
    floats = RolloutBatch(**_seq(group_ids=torch.tensor([3.0, 3.0]))).group_ids
    assert floats == [3, 3] and all(type(g) is int for g in floats)


B, L = 2, 8


def _padded(**over):
    ids = torch.arange(1, B * L + 1).reshape(B, L)
    attn = torch.ones(B, L)
    attn[0, :2] = 0  # left padding
    loss = torch.zeros(B, L)
    loss[:, 4:] = 1
    base = dict(input_ids=ids, attention_mask=attn, loss_mask=loss, group_ids=[0, 0])
    base.update(over)
    return base


def _holed():
    attn = torch.ones(B, L)
    attn[1, 4] = 0
    return attn


def _loss_over_padding():
    loss = torch.zeros(B, L)
    loss[:, 1:] = 1  # row 0 is padding at 0..1
    return loss


PADDED = [
    ("3-D ids", _padded(input_ids=torch.ones(B, L, 2, dtype=torch.int64)), ["input_ids", "[B, L]"]),
    ("float ids", _padded(input_ids=torch.ones(B, L) * 1.5), ["input_ids", "float32", "integer"]),
    ("bool ids", _padded(input_ids=torch.ones(B, L, dtype=torch.bool)), ["input_ids", "bool"]),
    ("mask shape", _padded(attention_mask=torch.ones(B, L - 1)), ["attention_mask", "differ in shape"]),
    ("mask of 0.5", _padded(attention_mask=torch.full((B, L), 0.5)), ["attention_mask", "0/1"]),
    ("hole in a row", _padded(attention_mask=_holed()), ["attention_mask row 1", "hole"]),
    ("loss over padding", _padded(loss_mask=_loss_over_padding()), ["loss_mask", "padding"]),
    ("loss mask L-1", _padded(loss_mask=torch.ones(B, L - 1)), ["loss_mask", f"({B}, {L - 1})",
                                                               "0 column in front"]),
    ("old log-probs L-1", _padded(old_logprobs=torch.zeros(B, L - 1)),
     ["old_logprobs", f"({B}, {L - 1})", "0 column in front"]),
    ("advantages [B, 1]", _padded(advantages=torch.ones(B, 1)), ["advantages", f"({B}, 1)",
                                                               f"[{B}] (one per sequence)"]),
    ("misspelt array", _padded(old_log_probs=torch.zeros(B, L)), ["old_log_probs", "old_logprobs"]),
    ("bad group id", _padded(group_ids=[{}, {}]), ["group_ids[0]", "unhashable dict"]),
    ("all-zero loss", _padded(loss_mask=torch.zeros(B, L)), ["loss_mask", "0 at every token"]),
]


@pytest.mark.parametrize("name, kwargs, words", PADDED, ids=[c[0] for c in PADDED])
def test_padded_inputs_refused(name, kwargs, words):
    with pytest.raises(ValueError) as info:
        RolloutBatch.from_padded(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_padded_good_rows():
    batch = RolloutBatch.from_padded(**_padded(advantages=torch.tensor([1.0, -1.0])))
    assert batch.lengths == [L - 2, L]
    assert torch.equal(batch.tokens[0], torch.arange(3, L + 1))


CU = torch.tensor([0, 6, 14])
T = 14


def _packed(**over):
    loss = torch.zeros(T)
    loss[3:6] = 1
    loss[9:] = 1
    base = dict(tokens=torch.arange(1, T + 1), cu_seqlens=CU, loss_mask=loss, group_ids=["a", "a"])
    base.update(over)
    return base


PACKED = [
    ("fractional cu_seqlens", _packed(cu_seqlens=torch.tensor([0.0, 6.5, 14.0])),
     ["cu_seqlens", "fractions", "integer offsets"]),
    ("decreasing cu_seqlens", _packed(cu_seqlens=torch.tensor([0, 8, 6])), ["cu_seqlens", "increasing"]),
    ("loss mask short", _packed(loss_mask=torch.zeros(T - 1)), ["loss_mask", f"({T - 1},)", f"[{T}]"]),
    ("loss mask long", _packed(loss_mask=torch.zeros(T + 3)), ["loss_mask", f"({T + 3},)"]),
    ("tokens short", _packed(tokens=torch.arange(1, T)), ["tokens", f"({T - 1},)"]),
    ("float tokens", _packed(tokens=torch.arange(T) + 0.5), ["tokens[0]", "float32", "truncated"]),
    ("bool tokens", _packed(tokens=torch.ones(T, dtype=torch.bool)), ["tokens[0]", "bool"]),
    ("advantages [2, 1]", _packed(advantages=torch.ones(2, 1)), ["advantages", "(2, 1)",
                                                               "[2] (one per sequence)"]),
    ("float group ids", _packed(group_ids=torch.tensor([0.25, 0.5])), ["group_ids[0]", "whole number"]),
    ("all-zero loss", _packed(loss_mask=torch.zeros(T)), ["loss_mask", "0 at every token"]),
]


@pytest.mark.parametrize("name, kwargs, words", PACKED, ids=[c[0] for c in PACKED])
def test_packed_inputs_refused(name, kwargs, words):
    with pytest.raises(ValueError) as info:
        RolloutBatch.from_packed(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_packed_good_rows_and_thd_row():
    batch = RolloutBatch.from_packed(**_packed(tokens=torch.arange(1, T + 1)[None],
                                               advantages=torch.tensor([1.0, 2.0])))
    assert batch.lengths == [6, 8] and batch.advantages[1].tolist() == [2.0] * 8


# ---- the loss function's returns (Megatron on CPU, one process) ---------------------------

def _model(per_token):
    from framework_data import SMALL
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = per_token
    return model


def _rollout():
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, 256, (24,), generator=gen)
    tokens = [torch.cat([prompt, torch.randint(1, 256, (6,), generator=gen)]) for _ in range(4)]
    masks = [torch.cat([torch.zeros(24), torch.ones(6)]) for _ in tokens]
    return RolloutBatch(tokens=tokens, loss_mask=masks, group_ids=[0] * 4,
                        advantages=[1.0, -1.0, 0.5, -0.5])


def _sum(b):
    return (b.logprobs * b.advantages * b.loss_mask).sum()


LOSS_CASES = [
    ("NaN loss", False, lambda b: (_sum(b) * float("nan"), {}), ["NaN or inf loss", "optimizer"]),
    ("inf loss", True, lambda b: (_sum(b) + float("inf"), b.num_tokens, {}), ["NaN or inf loss"]),
    ("float num_tokens", True, lambda b: (_sum(b), b.loss_mask.sum(), {}),
     ["num_tokens", "float32", "integer tensor", "TokenBatch.num_tokens"]),
    ("int num_tokens", False, lambda b: (_sum(b), int(b.loss_mask.sum()), {}),
     ["num_tokens", "a int", "integer tensor"]),
    ("per-token loss", False, lambda b: (b.logprobs * b.loss_mask, {}), ["one scalar tensor"]),
]


@pytest.mark.megatron
@pytest.mark.parametrize("name, per_token, loss_fn, words", LOSS_CASES,
                         ids=[c[0] for c in LOSS_CASES])
def test_loss_fn_returns_refused(name, per_token, loss_fn, words, megatron_env):
    from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter
    model = _model(per_token)
    adapter = PrefixReuseAdapter(model, AdapterConfig(min_shared_len=8, node_overhead_tokens=0,
                                                      min_gain=1.0))
    with pytest.raises(ValueError) as info:
        adapter.forward_backward(_rollout(), loss_fn)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.megatron
def test_num_tokens_is_what_the_contract_takes(megatron_env):
    """TokenBatch.num_tokens (the docs' per-token contract) runs: an int tensor."""
    from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter
    adapter = PrefixReuseAdapter(_model(True), AdapterConfig(min_shared_len=8,
                                                             node_overhead_tokens=0, min_gain=1.0))
    result = adapter.forward_backward(_rollout(), lambda b: (_sum(b), b.num_tokens, {}))
    assert all(bool(torch.isfinite(lp).all()) and bool((lp[24:] < 0).all())
               for lp in result.logprobs)
