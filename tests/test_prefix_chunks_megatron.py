"""Chunked prefixes ([Note: prefix chunks] in prefix_schedule/pipeline/units.py) inside real Megatron equal
stock Megatron dense training: fp32, loss and every parameter gradient within 1e-5 relative, at
PP=1 (one process) and PP=2 (gloo, tests/dist_harness.py)."""

import pytest

from dist_harness import run_distributed
from test_equivalence import LOSS, assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


@pytest.fixture(scope="module")
def model(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    built = build_model(TinyLlamaConfig(**SMALL))
    built.config.finalize_model_grads_func = scale_grads_by_token_count
    return built


# (shapes, token budget, prefix_chunk_tokens); P-1 is the cached length of a group.
CASES = {
    "chunk divides P-1, several groups": ([(33, [6, 9, 4]), (17, [8, 3]), (25, [5, 7])], 12, 8),
    "chunk does not divide P-1": ([(30, [6, 9, 4]), (20, [8, 3, 5])], 12, 7),
    "chunk size 1": ([(9, [4, 6, 3]), (6, [5, 2])], 8, 1),
    "chunk >= P-1 (one chunk each)": ([(21, [5, 6]), (13, [4, 4, 4])], 10, 20),
    "groups share microbatches, a dense group": ([(21, [5, 5, 5]), (19, [5, 5, 5]), (1, [4, 3])],
                                                 11, 6),
}


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_reuse_equals_dense(model, name):
    shapes, budget, chunk_tokens = CASES[name]
    batch = make_batch(sum(map(ord, name)) % 1000, shapes)
    dense, dense_grads, reuse, reuse_grads, plan = run_both(model, batch, budget,
                                                            prefix_chunk_tokens=chunk_tokens)
    chunks = plan.prefix_units().values()
    per_group = {w.group: sum(c.group == w.group for c in chunks) for w in plan.prefixes}
    expected = {w.group: -(-w.length // chunk_tokens) for w in plan.prefixes}
    assert per_group == expected and (max(per_group.values()) > 1) == (chunk_tokens < 20)
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)


def test_chunked_selective_recompute_equals_dense(megatron_env):
    """Recompute re-runs a chunk's attention inside its backward: it must read the earlier
    chunks again (still live: PB runs in reverse chunk order) and store nothing."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    recompute = build_model(TinyLlamaConfig(**SMALL), recompute_granularity="selective",
                            recompute_modules=["core_attn"])
    recompute.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(61, [(26, [7, 4, 9]), (15, [5, 6])])
    assert_equal_step(*run_both(recompute, batch, 12, prefix_chunk_tokens=6)[:4])


def test_chunked_forward_only_matches_dense_and_frees_the_cache(model):
    import torch

    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep

    batch = make_batch(62, [(20, [6, 3, 5]), (11, [4, 4])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=512, prefix_chunk_tokens=4)
    step = ReuseStep(batch, plan)
    with torch.no_grad():
        dense = dense_step(model, batch, LOSS, forward_only=True)
        reuse = reuse_step(model, batch, plan, LOSS, forward_only=True, step=step)
    assert abs(dense.loss - reuse.loss) <= 1e-5 * abs(dense.loss)
    assert step.cache.live_groups() == ()


def _pp_rank(shapes, token_budget, chunk_tokens, seed):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step, scale_grads_by_token_count)
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    cfg = TinyLlamaConfig(**{**SMALL, "num_layers": 4})
    model = build_model(cfg)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(seed, shapes)
    dense = dense_step(model, batch, LOSS)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=token_budget, max_seq_len=512,
                             prefix_chunk_tokens=chunk_tokens)
    reuse = reuse_step(model, batch, plan, LOSS)
    reuse_grads = param_grads(model)
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
                num_units=len(plan.prefix_units()))


def test_pp2_chunked_reuse_equals_stock_1f1b_dense():
    shapes = [(30, [6, 9, 4, 7]), (17, [8, 3]), (1, [5, 4])]
    results = run_distributed(_pp_rank, world_size=2, args=(shapes, 12, 7, 5), timeout_s=180)
    last = results[-1]
    assert results[0]["num_units"] == 5 + 3  # ceil(29/7) + ceil(16/7)
    assert last["tokens"][0] == last["tokens"][1] > 0
    assert abs(last["losses"][0] - last["losses"][1]) <= 1e-5 * abs(last["losses"][0])
    for r in results:
        assert not r["missing"], f"stage {r['stage']}: no (or a non-finite) gradient: {r['missing'][:5]}"
        assert r["grad_diff"] <= 1e-5, f"stage {r['stage']}: gradient diff {r['grad_diff']:.2e}"
