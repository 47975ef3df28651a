"""Mamba-2 layers (HybridModel 'M', Nemotron-H layout) with prefix reuse == stock Megatron dense.

Mamba layers cache their SSD state and conv tail per group instead of K/V ([Note: recurrent
prefix state] in prefix_schedule/runtime/state_cache.py; megatron_patches/runtime/mamba_hooks.py);
attention layers cache K/V. Every case: loss and every fp32 parameter gradient within 1e-5
relative of stock dense on the same data, both sides through the CPU layer's torch kernels
(megatron_patches/support/mamba_cpu.py; those are checked against HF NemotronH in tests/test_mamba_hf.py).
"""

import zlib

import pytest
import torch

from prefix_schedule.planning.planner import plan_microbatches
from test_equivalence import LOSS, assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)


def _model(pattern, **overrides):
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_hybrid_model(cfg, pattern, **{**MAMBA, **overrides})
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # slow decay, as a trained model has: the prefix state reaches suffixes
        for module in model.modules():
            if isinstance(module, MambaMixer):
                module.chunk_size = 16  # several scan chunks per row on these lengths
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.05, 0.5,
                                                                            generator=gen).log())
                module.dt_bias.copy_(torch.empty(module.dt_bias.shape).uniform_(
                    -3.0, -1.0, generator=gen))
    return model


CASES = {
    "several groups, packed rows": ("M*M-", [(33, [6, 9, 4]), (17, [8, 3]), (50, [5, 7, 6, 2])], 20, {}),
    "one group over many microbatches": ("M*M-", [(40, [9, 7, 12, 5, 8, 11])], 16, {}),
    "prefix shorter than the conv window": ("M*M-", [(1, [7, 5]), (2, [4, 6]), (3, [3, 3])], 16, {}),
    "suffix length 1": ("M*M-", [(24, [1, 1, 3, 1])], 8, {}),
    "Mamba after the last attention layer": ("*-MM", [(30, [6, 9]), (21, [4, 4, 4])], 24, {}),
    "Mamba only": ("MM", [(30, [6, 9]), (21, [4, 4, 4])], 24, {}),
    "prefix chunks: each chunk resumes the last one's state": (
        "M*M-", [(45, [6, 9, 4]), (29, [8, 3])], 20, {"prefix_chunk_tokens": 12}),
    "group of one runs dense beside cached groups": ("M*M-", [(30, [6]), (20, [5, 4])], 64, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mamba_reuse_equals_dense(megatron_env, name):
    pattern, shapes, budget, plan_kwargs = CASES[name]
    model = _model(pattern)
    batch = make_batch(zlib.crc32(name.encode()) % 1000, shapes)
    dense, dense_grads, reuse, reuse_grads, plan = run_both(model, batch, budget, **plan_kwargs)
    if name == "several groups, packed rows":
        assert any(len({s.group for s in mb.segments}) > 1 for mb in plan.microbatches)
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)


@pytest.mark.parametrize("pattern,chunk", [("M*M-", None), ("*-MM", 4)])
def test_mamba_prefix_trees_equal_dense(megatron_env, pattern, chunk):
    """Prefix trees: a node's units resume their parent unit's SSD state and conv tail; readers
    of a node with children stop at the unit StepPlan.state_reads cuts there; without it the
    step is refused before compute."""
    from megatron_patches.training import reuse_step
    from tree_batches import make_tree_batch

    model = _model(pattern)
    batch = make_tree_batch(5, [dict(depth=3, branching=2, node_len=5, suffix_len=3, inner=1),
                                dict(depth=2, branching=3, node_len=7, suffix_len=4, inner=2)])
    *result, plan = run_both(model, batch, 16, prefix_chunk_tokens=chunk, state_reads=True)
    assert_equal_step(*result)
    uncut = plan_microbatches(batch, token_budget=16, max_seq_len=512, prefix_chunk_tokens=chunk)
    assert len(plan.prefix_units()) > len(uncut.prefix_units())
    with pytest.raises(ValueError, match="state_reads=True"):
        reuse_step(model, batch, uncut, LOSS)


def test_without_the_state_hook_reuse_is_far_from_dense(megatron_env):
    """The hook is what makes it exact: without it suffixes start from a zero state. (The last
    cache layer is attention here: a last Mamba layer is where its hook stops the prefix.)"""
    from megatron.core.ssm import mamba_mixer
    from megatron_patches.training import max_relative_diff

    model = _model("MM*-")
    batch = make_batch(11, [(33, [6, 9, 4]), (17, [8, 3])])
    installed, mamba_mixer._mamba_state_hook = mamba_mixer._mamba_state_hook, None
    try:
        _, dense_grads, _, reuse_grads, _ = run_both(model, batch, 20)
    finally:
        mamba_mixer._mamba_state_hook = installed
    assert installed is not None
    assert max_relative_diff(dense_grads, reuse_grads) > 1e-3


@pytest.mark.parametrize("overrides,message", [
    ({"use_mamba_mem_eff_path": False}, "use_mamba_mem_eff_path=False"),
])
def test_refused_mamba_options(megatron_env, overrides, message):
    from megatron_patches.training import reuse_step

    model = _model("M*M-", **overrides)
    batch = make_batch(9, [(20, [5, 6])])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    with pytest.raises(ValueError, match=message):
        reuse_step(model, batch, plan, LOSS)
    assert all(p.grad is None for p in model.parameters()), "compute ran before the refusal"


def _parallel_rank(pattern, pp, tp):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import max_relative_diff, missing_grads, param_grads

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp, tp=tp)
    model = _model(pattern)
    batch = make_batch(4, [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])])
    dense, dense_grads, reuse, reuse_grads, _ = run_both(model, batch, 10)
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                layers="".join(model.decoder.layer_type_list),
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                nonzero=missing_grads(dense=dense_grads, reuse=reuse_grads))


@pytest.mark.parametrize("pattern,pp,tp,stages", [
    ("M*|MM-", 2, 1, ["M*", "MM-"]),  # the second stage holds only Mamba (and MLP) layers
    ("M*M-", 1, 2, ["M*M-"] * 2),     # Mamba heads, groups and conv channels split over TP
])
def test_mamba_reuse_equals_dense_across_ranks(pattern, pp, tp, stages):
    from dist_harness import DistributedRunError, run_distributed
    from test_equivalence import TOL

    try:
        results = run_distributed(_parallel_rank, world_size=pp * tp, args=(pattern, pp, tp),
                                  timeout_s=300)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert [r["layers"] for r in results] == stages
    dense_loss, reuse_loss = results[-1]["losses"]
    assert results[-1]["tokens"][0] == results[-1]["tokens"][1] > 0
    assert abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss)
    for r in results:
        assert not r["nonzero"] and r["grad_diff"] <= TOL, r
