"""Prefix trees ([Note: prefix trees] in prefix_schedule/planning/tree.py) inside real Megatron
equal stock Megatron dense over the flattened trajectories: fp32, loss and every parameter
gradient within 1e-5 relative; depth 1-4, branching 1-8, trajectories under inner nodes (their
reads stop short of the node's last cached row), prefix chunks splitting nodes, loss tokens
inside shared nodes (counted once per trajectory with its own arrays); PP=1 in this
process, PP=2 and TP=2 through tests/dist_harness.py (gloo)."""

import pytest

from dist_harness import run_distributed
from test_equivalence import LOSS, assert_equal_step, run_both
from tree_batches import make_tree_batch

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)

# name -> (group specs, token budget, prefix_chunk_tokens)
CASES = {
    "depth 1 (today's groups)": ([dict(depth=1, branching=1, node_len=12, suffix_len=5,
                                       per_leaf=3)], 12, None),
    "depth 2, branching 2, inner trajectories": ([dict(depth=2, branching=2, node_len=8,
                                                       suffix_len=5, per_leaf=2, inner=1)],
                                                 14, None),
    "depth 3, branching 3, chunks split nodes": ([dict(depth=3, branching=3, node_len=6,
                                                       suffix_len=4, inner=1)], 16, 4),
    "depth 4, branching 2": ([dict(depth=4, branching=2, node_len=5, suffix_len=4)], 16, None),
    "branching 8, next to a depth-1 group": ([dict(depth=2, branching=8, node_len=6,
                                                  suffix_len=3),
                                             dict(depth=1, branching=1, node_len=9,
                                                  suffix_len=4, per_leaf=2)], 12, None),
    "branching 1 (a chain of nodes)": ([dict(depth=3, branching=1, node_len=5, suffix_len=4,
                                            per_leaf=3, inner=1)], 10, None),
    "loss tokens inside shared nodes": ([dict(depth=3, branching=2, node_len=6, suffix_len=4,
                                              inner=1, node_loss=True)], 12, None),
    "loss inside nodes, chunks, depth 1 next to it": (
        [dict(depth=2, branching=3, node_len=7, suffix_len=3, per_leaf=2, node_loss=True),
         dict(depth=1, branching=1, node_len=9, suffix_len=4, per_leaf=3, node_loss=True)],
        12, 4),
}


@pytest.fixture(scope="module")
def model(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    built = build_model(TinyLlamaConfig(**SMALL))
    built.config.finalize_model_grads_func = scale_grads_by_token_count
    return built


@pytest.mark.parametrize("name", list(CASES))
def test_tree_reuse_equals_dense(model, name):
    specs, budget, chunk_tokens = CASES[name]
    batch = make_tree_batch(sum(map(ord, name)) % 1000, specs)
    dense, dense_grads, reuse, reuse_grads, plan = run_both(model, batch, budget,
                                                            prefix_chunk_tokens=chunk_tokens)
    nodes = sum(g.num_nodes for g in batch.groups)
    assert len(plan.prefix_units()) >= nodes  # every node ran once (or as chunks)
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)


def test_tree_selective_recompute_equals_dense(megatron_env):
    """Recompute re-runs a node's attention inside its backward: it reads its ancestors again
    (still live: children run backward first) and stores nothing."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    recompute = build_model(TinyLlamaConfig(**SMALL), recompute_granularity="selective",
                            recompute_modules=["core_attn"])
    recompute.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_tree_batch(7, [dict(depth=3, branching=2, node_len=6, suffix_len=4, inner=1)])
    assert_equal_step(*run_both(recompute, batch, 12)[:4])


SPECS_DIST = [dict(depth=3, branching=2, node_len=6, suffix_len=4, inner=1, node_loss=True),
              dict(depth=1, branching=1, node_len=8, suffix_len=4, per_leaf=2)]


def _grads(models):
    from megatron_patches.training import param_grads

    return {f"{v}.{name}": g for v, m in enumerate(models) for name, g in param_grads(m).items()}


def _rank(pp, tp, vpp, chunk_tokens, seed):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads, reuse_step,
                                           scale_grads_by_token_count)
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp, tp=tp, vpp=vpp if vpp > 1 else None)
    config = TinyLlamaConfig(**{**SMALL, "num_layers": 2 * pp * vpp})
    models = ([build_model(config)] if vpp == 1 else  # Megatron's interleaved layout
              [build_model(config, vp_stage=v, overlap_p2p_comm=True, batch_p2p_comm=False,
                           deallocate_pipeline_outputs=True) for v in range(vpp)])
    for m in models:
        m.config.finalize_model_grads_func = scale_grads_by_token_count
    model = models if vpp > 1 else models[0]
    specs = SPECS_DIST if vpp == 1 else SPECS_DIST[:1]  # 7 + 1: a multiple of PP for Megatron
    batch = make_tree_batch(seed, specs if vpp == 1 else specs + [
        dict(depth=1, branching=1, node_len=8, suffix_len=4, per_leaf=1)])
    dense = dense_step(model, batch, LOSS)
    dense_grads = _grads(models)
    for m in models:
        m.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512,
                             prefix_chunk_tokens=chunk_tokens)
    reuse = reuse_step(model, batch, plan, LOSS)
    reuse_grads = _grads(models)
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads))


@pytest.mark.parametrize("pp,tp,vpp,chunk_tokens",
                         [(2, 1, 1, None), (2, 1, 1, 4), (1, 2, 1, None), (2, 1, 2, None)],
                         ids=["pp2", "pp2-chunks", "tp2", "pp2-vpp2"])
def test_tree_reuse_equals_stock_dense_distributed(pp, tp, vpp, chunk_tokens):
    results = run_distributed(_rank, world_size=pp * tp, args=(pp, tp, vpp, chunk_tokens, 5),
                              timeout_s=240)
    last = results[-1]
    assert last["tokens"][0] == last["tokens"][1] > 0
    assert abs(last["losses"][0] - last["losses"][1]) <= 1e-5 * abs(last["losses"][0])
    for r in results:
        assert not r["missing"], f"stage {r['stage']}: no (or a non-finite) gradient: {r['missing'][:5]}"
        assert r["grad_diff"] <= 1e-5, f"stage {r['stage']}: gradient diff {r['grad_diff']:.2e}"


def test_tree_full_recompute_is_refused_before_compute(megatron_env):
    """Full recompute re-runs each prefix unit in Phase C; with trees (loss units, chain reads)
    that is not verified: refused before any compute."""
    import torch

    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.planning.planner import plan_microbatches

    full = build_model(TinyLlamaConfig(**SMALL), recompute_granularity="full",
                       recompute_method="uniform", recompute_num_layers=1)
    full.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_tree_batch(9, [dict(depth=2, branching=2, node_len=6, suffix_len=4)])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=SMALL["max_seq_len"])
    with pytest.raises(ValueError, match="recompute_granularity='full' with prefix trees"):
        reuse_step(full, batch, plan, LOSS)
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in full.parameters())
