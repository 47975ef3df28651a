

@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
    ids=["full", "selective-core_attn"])
def test_recompute_reuse_equals_dense(megatron_env, recompute):
    """Megatron's recompute re-runs the hooked attention (full: Phase C re-runs each prefix unit
    and injects its K/V gradients): the sinks and windows must come along."""
    model = build(**recompute)
    batch = make_batch(21, [(17, [5, 1, 7]), (4, [6, 3])])
    dense, dg, reuse, rg, plan = run_both(model, batch, 12, prefix_chunk_tokens=6)
    assert plan.prefixes
    assert_equal_step(dense, dg, reuse, rg)
