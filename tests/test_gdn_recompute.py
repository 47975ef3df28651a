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
