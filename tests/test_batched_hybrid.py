"""Batched hybrid kernels in reuse steps: a suffix row's segments padded into one [N, Lmax] batch
(Mamba-2: one causal_conv1d_fn and one mamba_chunk_scan_combined call, per-row initial states;
Gated DeltaNet: one depthwise conv call) == the per-segment path (BATCH_SEGMENTS = False, one
call per segment: the reference) -- loss and every parameter gradient to 1e-6 relative (they
agree to rounding), and the batched path makes one call per layer and suffix row. On CPU the
kernels are the CPU layer's torch stand-ins (megatron_patches/support/mamba_cpu.py, gdn_cpu.py);
stock dense parity of both paths is tests/test_mamba.py and tests/test_gdn.py."""
import zlib

import pytest
import torch

from prefix_schedule.planning.planner import plan_microbatches
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

SHAPES = [(33, [6, 9, 4, 1]), (17, [8, 3]), (5, [5, 7, 1, 2])]  # several groups, 1-token suffixes
TOL = 1e-6


def _reuse(model, batch, budget):
    from megatron_patches.training import param_grads, reuse_step

    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512)
    step = reuse_step(model, batch, plan, LOSS)
    grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    return step, grads, plan


def _counting(monkeypatch, owner, attr, seen):
    """Wrap owner.attr to record each call's batch size (restored by monkeypatch)."""
    original = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        seen.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, wrapper)


def _compare(monkeypatch, hooks, model, budget, counted):
    """Batched vs per-segment reuse steps on the same data; returns the calls each made."""
    from megatron_patches.training import max_relative_diff, missing_grads

    batch = make_batch(zlib.crc32(hooks.__name__.encode()) % 1000, SHAPES)
    calls, results = {}, {}
    for batched in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(hooks, "BATCH_SEGMENTS", batched)
            calls[batched] = {name: [] for name in counted}
            for name, (owner, attr) in counted.items():
                _counting(patch, owner, attr, calls[batched][name])
            results[batched] = _reuse(model, batch, budget)
    (want_step, want_grads, plan), (got_step, got_grads, _) = results[False], results[True]
    assert abs(want_step.loss - got_step.loss) <= TOL * max(abs(want_step.loss), 1e-3)
    assert not missing_grads(dense=want_grads, reuse=got_grads)
    diff = max_relative_diff(want_grads, got_grads)
    assert diff <= TOL, f"batched vs per-segment: max relative gradient difference {diff:.3e}"
    assert any(len(mb.segments) > 2 for mb in plan.microbatches)  # rows with several segments
    return calls


def test_mamba_batched_segments_equal_per_segment(megatron_env, monkeypatch):
    from megatron.core.ssm import mamba_mixer
    from megatron_patches.runtime import mamba_hooks
    from test_mamba import _model

    model = _model("M*M-")
    calls = _compare(monkeypatch, mamba_hooks, model, 24, {
        "conv": (mamba_mixer, "causal_conv1d_fn"), "scan": (mamba_mixer, "mamba_chunk_scan_combined")})
    batched, single = calls[True], calls[False]
    # per segment: batch size 1 each; batched: suffix rows are one call with N rows
    assert set(single["scan"]) == {1} and max(batched["scan"]) > 1
    assert len(batched["scan"]) < len(single["scan"]) and len(batched["conv"]) < len(single["conv"])


def test_gdn_fla_varlen_conv_equals_per_segment(megatron_env, monkeypatch):
    """fla's path: a suffix row's conv is one causal_conv1d call with cu_seqlens and the cached
    tails as initial_state [N, D, W] (the CPU stand-in reads it as fla's Triton kernel does)."""
    from megatron.core.ssm.gated_delta_net import gdn
    from megatron_patches.runtime import gdn_hooks
    from test_gdn import _gdn_model

    seen = {True: [], False: []}
    original = gdn.causal_conv1d

    def recording(*args, **kwargs):
        if kwargs.get("initial_state") is not None:
            seen[gdn_hooks.BATCH_SEGMENTS].append(tuple(kwargs["initial_state"].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(gdn, "causal_conv1d", recording)
    model = _gdn_model()
    _compare(monkeypatch, gdn_hooks, model, 24, {})
    assert not seen[False] and seen[True]
    assert max(n for n, _, _ in seen[True]) > 1  # several sequences, one call
    width = model.decoder.layers[0].self_attention.conv1d.weight.shape[-1]
    assert all(w == width for _, _, w in seen[True])


def test_gdn_padded_conv_equals_per_segment(megatron_env, monkeypatch):
    """Deterministic mode (Megatron's torch conv and rule): the padded batch, one F.conv1d."""
    import torch.nn.functional as F
    from megatron_patches.runtime import gdn_hooks
    from test_gdn import _gdn_model

    model = _gdn_model(deterministic_mode=True)
    calls = _compare(monkeypatch, gdn_hooks, model, 24, {"conv": (gdn_hooks.F, "conv1d")})
    assert set(calls[False]["conv"]) == {1} and max(calls[True]["conv"]) > 1
    assert len(calls[True]["conv"]) < len(calls[False]["conv"])
    assert gdn_hooks.F is F  # the module the hook calls conv1d through
