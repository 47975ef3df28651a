"""Gated DeltaNet (GPTModel, Qwen3-Next / Qwen3.5 layout) with Megatron's full activation
recompute, as RL frameworks train (verl's Megatron backend: recompute_granularity="full",
recompute_method="uniform", recompute_num_layers=1).

[Note: prefix full recompute] in docs/DESIGN.md: Phase A runs the prefix under no_grad and keeps
each GDN layer's final rule state and conv tail; Phase C re-runs the prefix forward with
Megatron's checkpoints, and the GDN hook hands each recomputed state the fp32 gradient its
suffixes accumulated (PrefixKVCache.inject_state_grad). Every case: loss and every fp32 parameter
gradient within 1e-5 relative of stock dense with the same full recompute, and of stock dense
without recompute.
"""

import contextlib
import zlib

import pytest

from dist_harness import DistributedRunError, run_distributed
from test_equivalence import LOSS, TOL, assert_equal_step, make_batch
from test_gdn import _gdn_model

pytestmark = pytest.mark.megatron

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
QWEN35 = dict(attention_output_gate=True, rotary_percent=0.5)  # gated attention, partial RoPE


@contextlib.contextmanager
def _no_recompute(model):
    """Stock dense without recompute on the same weights: TransformerBlock reads
    config.recompute_granularity at every forward (megatron-core transformer_block.py)."""
    config = model.config
    saved = config.recompute_granularity
    config.recompute_granularity = None
    try:
        yield
    finally:
        config.recompute_granularity = saved


def _three_ways(model, batch, budget, **plan_kwargs):
    """(dense with the model's recompute, its grads, dense without recompute, its grads,
    reuse, its grads, plan)."""
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import dense_step, param_grads, reuse_step

    runs = []
    for run in ("dense", "dense, no recompute", "reuse"):
        model.zero_grad(set_to_none=True)
        if run == "reuse":
            plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512, **plan_kwargs)
            result = reuse_step(model, batch, plan, LOSS)
        else:
            with _no_recompute(model) if run != "dense" else contextlib.nullcontext():
                result = dense_step(model, batch, LOSS)
        runs.append((result, param_grads(model)))
    model.zero_grad(set_to_none=True)
    assert model.config.recompute_granularity == "full", "the prefix toggle was undone"
    return runs, plan


def _assert_equal(runs):
    (dense, dense_grads), (plain, plain_grads), (reuse, reuse_grads) = runs
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)
    assert_equal_step(plain, plain_grads, reuse, reuse_grads)


@pytest.fixture(scope="module")
def qwen35(megatron_env):
    """GDN, attention, GDN, attention; gated attention with partial RoPE; full recompute."""
    return _gdn_model(**QWEN35, **FULL)


CASES = {
    "several groups, packed rows": ([(33, [6, 9, 4]), (17, [8, 3]), (50, [5, 7, 6, 2])], 20, {}),
    "one group over many microbatches": ([(40, [9, 7, 12, 5, 8, 11])], 16, {}),
    "prefix chunks of 12": ([(30, [6, 9, 4]), (17, [8, 3])], 12, {"prefix_chunk_tokens": 12}),
    # chunks shorter than the conv window: a chunk's tail holds rows of the previous one
    "prefix chunks of 3": ([(23, [6, 4, 5]), (9, [3, 7])], 12, {"prefix_chunk_tokens": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gdn_full_recompute_equals_dense(qwen35, name):
    shapes, budget, plan_kwargs = CASES[name]
    runs, plan = _three_ways(qwen35, make_batch(zlib.crc32(name.encode()) % 1000, shapes),
                             budget, **plan_kwargs)
    if name.startswith("several"):
        assert any(len({s.group for s in mb.segments}) > 1 for mb in plan.microbatches)
    if "chunks" in name:
        assert any(c.chunk > 0 for c in plan.prefix_units().values()), "no prefix was chunked"
    _assert_equal(runs)


def test_gdn_last_layer_full_recompute(megatron_env):
    """A GDN last layer: Phase A stops after its state; Phase C's re-run stops at the final
    norm's input (zero gradient there), so only the injected state gradients drive that layer."""
    model = _gdn_model(linear_attention_freq=[1, 0, 1, 1], **QWEN35, **FULL)
    _assert_equal(_three_ways(model, make_batch(9, [(21, [5, 5, 5]), (19, [5, 5, 5])]), 11)[0])


def test_gdn_block_recompute_with_layers_run_whole(megatron_env):
    """recompute_method="block" with 2 of 4 layers checkpointed: the last GDN and attention
    layers run with grad in Phase C's forward itself (the injection happens there, not in a
    checkpoint's backward)."""
    model = _gdn_model(**QWEN35, recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=2)
    _assert_equal(_three_ways(model, make_batch(4, [(26, [7, 5]), (14, [6, 6, 3])]), 12,
                              prefix_chunk_tokens=10)[0])


def test_gdn_full_recompute_without_a_final_norm_rebinds_states(megatron_env, monkeypatch):
    """A last stage without a final norm to stop at re-runs its prefix whole and binds the
    re-run's K/V and states to the cache entries (PrefixKVCache.rebind / rebind_state); dense
    runs without the norm too."""
    from prefix_schedule.runtime.cache import PrefixKVCache

    calls = []
    for method in ("rebind_state", "inject_state_grad"):
        original = getattr(PrefixKVCache, method)
        monkeypatch.setattr(PrefixKVCache, method, lambda *a, _f=original, _m=method, **k: (
            calls.append(_m), _f(*a, **k))[1])
    model = _gdn_model(**QWEN35, **FULL)
    model.decoder.final_layernorm = None
    _assert_equal(_three_ways(model, make_batch(6, [(25, [6, 4, 5]), (11, [3, 7])]), 12,
                              prefix_chunk_tokens=9)[0])
    assert "rebind_state" in calls and "inject_state_grad" not in calls, set(calls)


@pytest.mark.parametrize("dropped", ["rule", "conv"])
def test_without_the_injected_state_gradient_the_step_differs(qwen35, monkeypatch, dropped):
    """The checks above can fail: a Phase C that leaves out one state's gradient (the rule
    state or the conv tail) is far from dense."""
    from prefix_schedule.runtime.cache import PrefixKVCache

    from megatron_patches.training import max_relative_diff

    inject = PrefixKVCache.inject_state_grad

    def without(self, group, layer, name, out, tensor, **kwargs):
        return out if name == dropped else inject(self, group, layer, name, out, tensor, **kwargs)

    monkeypatch.setattr(PrefixKVCache, "inject_state_grad", without)
    (dense, dense_grads), _, (reuse, reuse_grads) = _three_ways(
        qwen35, make_batch(8, [(30, [6, 9, 4]), (17, [8, 3])]), 12, prefix_chunk_tokens=12)[0]
    assert abs(dense.loss - reuse.loss) <= TOL * abs(dense.loss)  # the forward is untouched
    assert max_relative_diff(dense_grads, reuse_grads) > 1e-3


def _pp2_rank(pattern):
    import megatron_patches
    from megatron_patches.models.tiny import initialize_distributed

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = _gdn_model(num_layers=len(pattern), linear_attention_freq=list(pattern), **QWEN35,
                       **FULL)
    runs, _ = _three_ways(model, make_batch(4, [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])]),
                          10, prefix_chunk_tokens=14)
    kinds = sorted({type(layer.self_attention).__name__ for layer in model.decoder.layers})
    return rank_summary(runs, kinds=kinds)


def rank_summary(runs, **extra):
    """A rank's picklable summary of `_three_ways`' runs: its pipeline stage, the three losses,
    the token counts, the worst gradient difference of reuse against either dense run, and
    whether every parameter got a gradient."""
    from megatron.core import parallel_state

    from megatron_patches.training import max_relative_diff, missing_grads

    (dense, dense_grads), (plain, plain_grads), (reuse, reuse_grads) = runs
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                losses=(dense.loss, plain.loss, reuse.loss),
                tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max(max_relative_diff(dense_grads, reuse_grads),
                              max_relative_diff(plain_grads, reuse_grads)),
                nonzero=not missing_grads(dense=dense_grads, reuse=reuse_grads), **extra)


def test_pp2_full_recompute_with_a_gdn_only_stage():
    """PP=2, stage 0 holds only GDN layers: its Phase C re-run ends at its output (the received
    gradient) and injects its states' gradients; the last stage stops at the final norm."""
    try:
        results = run_distributed(_pp2_rank, world_size=2, args=((1, 1, 1, 0),),
                                  timeout_s=400)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert results[0]["kinds"] == ["GatedDeltaNet"], "stage 0 must hold only GDN layers"
    assert_ranks_equal(results, results[-1:])


def assert_ranks_equal(results, with_loss):
    """Every rank's gradients (all present) within TOL of both dense runs; the loss and token
    count of the ranks in `with_loss` (the last pipeline stage's) equal too."""
    for r in with_loss:
        dense_loss, plain_loss, reuse_loss = r["losses"]
        assert r["tokens"][0] == r["tokens"][1] > 0, r
        for loss in (dense_loss, plain_loss):
            assert abs(loss - reuse_loss) <= TOL * abs(loss), r
    for r in results:
        assert r["nonzero"] and r["grad_diff"] <= TOL, r
