"""HybridModel (`G` `M` `*` `-` patterns, Qwen3.5 / Nemotron-H layouts) with Megatron's full
activation recompute, uniform and block, as HybridStack runs it (megatron/core/recompute.py
`checkpointed_forward`).

[Note: prefix full recompute] in docs/DESIGN.md: Phase A runs the prefix under no_grad and keeps
K/V and each GDN / Mamba layer's states; Phase C re-runs the prefix with Megatron's checkpoints
up to the last stage's `final_norm`, and the hooks hand each recomputed state the fp32 gradient
its suffixes accumulated. Every case: loss and every fp32 parameter gradient within 1e-5
relative of stock dense with the same full recompute, and of stock dense without recompute.
"""

import zlib

import pytest
import torch

from dist_harness import DistributedRunError, run_distributed
from test_equivalence import LOSS, TOL, make_batch
from test_gdn_recompute import _assert_equal, _three_ways, assert_ranks_equal, rank_summary

pytestmark = pytest.mark.megatron

UNIFORM = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)


def _model(pattern, **kwargs):
    """A tiny HybridModel of `pattern` with trained-model decay rates (the prefix state reaches
    the suffixes; test_gdn.weak_decay, test_mamba._model) and 16-token Mamba scan chunks.
    Mamba is imported only for `M` patterns: Megatron-LM main's mixer needs triton."""
    from test_gdn import weak_decay
    from test_mamba import MAMBA

    from megatron_patches.models.gdn import GDN_TINY_SHAPE
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_hybrid_model(cfg, pattern, **{**GDN_TINY_SHAPE, **MAMBA, **kwargs})
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    weak_decay(model)
    if "M" in pattern:
        _slow_mamba_decay(model)
    return model


def _slow_mamba_decay(model):
    from megatron.core.ssm.mamba_mixer import MambaMixer

    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MambaMixer):
                module.chunk_size = 16  # several scan chunks per row on these lengths
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(
                    0.05, 0.5, generator=gen).log())
                module.dt_bias.copy_(torch.empty(module.dt_bias.shape).uniform_(
                    -3.0, -1.0, generator=gen))


# id: (pattern, recompute, (prefix, suffixes) per group, token budget, plan options). The
# first two have no Mamba layer: tests/test_versions.py runs them on Megatron-LM main too.
CASES = {
    "attention-mlp": ("*-*-", UNIFORM, [(33, [6, 9, 4]), (17, [8, 3])], 20, {}),
    "gdn-attention-chunks-12": ("G-*-", UNIFORM, [(30, [6, 9, 4]), (17, [8, 3])], 12,
                                {"prefix_chunk_tokens": 12}),
    "gdn-mamba-several-groups": (
        "G*M-", UNIFORM, [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])], 20, {}),
    "mamba-uniform-2-chunks-12": (
        "M-M*M-", dict(UNIFORM, recompute_num_layers=2), [(30, [6, 9, 4]), (17, [8, 3])], 12,
        {"prefix_chunk_tokens": 12}),
    # block 2 of 4: M and G run whole in Phase C's forward; chunks shorter than the conv window
    "block-2-chunks-3": ("*-MG", BLOCK, [(23, [6, 4, 5]), (9, [3, 7])], 12,
                         {"prefix_chunk_tokens": 3}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_full_recompute_equals_dense(megatron_env, name):
    pattern, recompute, shapes, budget, plan_kwargs = CASES[name]
    model = _model(pattern, **recompute)
    runs, plan = _three_ways(model, make_batch(zlib.crc32(name.encode()) % 1000, shapes),
                             budget, **plan_kwargs)
    if "several-groups" in name:
        assert any(len({s.group for s in mb.segments}) > 1 for mb in plan.microbatches)
    if "chunks" in name:
        assert any(c.chunk > 0 for c in plan.prefix_units().values()), "no prefix was chunked"
    _assert_equal(runs)


def _record(monkeypatch, calls):
    """Record the cache's Phase C calls ((method, layer, state name) for states) and HybridStack's checkpointed
    forwards, passing each through."""
    from megatron.core.models.hybrid import hybrid_block
    from prefix_schedule.runtime.cache import PrefixKVCache

    for method in ("inject_state_grad", "rebind_state", "inject_grads", "rebind"):
        original = getattr(PrefixKVCache, method)

        def wrapped(self, *args, _f=original, _m=method, **kwargs):
            calls.append((_m, *args[1:3]) if "state" in _m else (_m,))
            return _f(self, *args, **kwargs)

        monkeypatch.setattr(PrefixKVCache, method, wrapped)
    checkpointed = hybrid_block.checkpointed_forward
    monkeypatch.setattr(hybrid_block, "checkpointed_forward", lambda *a, **k: (
        calls.append(("checkpointed_forward",)), checkpointed(*a, **k))[1])


def test_phase_c_runs_megatrons_checkpoints_and_injects_every_state(megatron_env, monkeypatch):
    """The re-run goes through HybridStack's checkpointed_forward and hands the GDN rule state,
    the Mamba SSD state, both conv tails and the attention K/V their gradients (no rebind)."""
    calls = []
    _record(monkeypatch, calls)
    model = _model("G*M-", **UNIFORM)
    _assert_equal(_three_ways(model, make_batch(3, [(21, [5, 6]), (14, [4, 4])]), 12)[0])
    seen = set(calls)  # layers: G 1, * 2, M 3
    assert {("inject_state_grad", 1, "rule"), ("inject_state_grad", 1, "conv"),
            ("inject_state_grad", 3, "ssm"), ("inject_state_grad", 3, "conv"),
            ("inject_grads",), ("checkpointed_forward",)} <= seen, seen
    assert not {c[0] for c in calls} & {"rebind", "rebind_state"}, seen


def test_without_a_final_norm_the_last_stage_rebinds(megatron_env, monkeypatch):
    """A HybridStack without `final_norm` (post_layer_norm off): Phase C re-runs the last
    stage's prefix whole and binds the re-run's K/V and states to the entries; dense runs
    without the norm too."""
    calls = []
    _record(monkeypatch, calls)
    model = _model("M*G-", **UNIFORM)
    model.decoder.post_layer_norm, model.decoder.final_norm = False, None
    _assert_equal(_three_ways(model, make_batch(6, [(25, [6, 4, 5]), (11, [3, 7])]), 12,
                              prefix_chunk_tokens=9)[0])
    methods = {c[0] for c in calls}
    assert {"rebind", "rebind_state"} <= methods, methods
    assert not methods & {"inject_grads", "inject_state_grad"}, methods


@pytest.mark.parametrize("dropped", ["ssm", "conv"])
def test_without_the_mamba_state_gradient_the_step_differs(megatron_env, monkeypatch, dropped):
    """The checks above can fail: a Phase C that leaves out a Mamba layer's SSD state or conv
    tail gradient is far from dense (the forward is untouched)."""
    from prefix_schedule.runtime.cache import PrefixKVCache

    from megatron_patches.training import max_relative_diff

    inject = PrefixKVCache.inject_state_grad

    def without(self, group, layer, name, out, tensor, **kwargs):
        if name == dropped and layer == 1:  # the Mamba layer of M*M-
            return out
        return inject(self, group, layer, name, out, tensor, **kwargs)

    monkeypatch.setattr(PrefixKVCache, "inject_state_grad", without)
    model = _model("M*M-", **UNIFORM)
    (dense, dense_grads), _, (reuse, reuse_grads) = _three_ways(
        model, make_batch(8, [(30, [6, 9, 4]), (17, [8, 3])]), 12)[0]
    assert abs(dense.loss - reuse.loss) <= TOL * abs(dense.loss)
    assert max_relative_diff(dense_grads, reuse_grads) > 1e-3


def test_full_recompute_refusal_with_prefix_trees_stays(megatron_env):
    """Full recompute stays refused with prefix trees, as for GPTModels: before any compute
    (MoE `E` layers run: tests/test_moe_recompute.py)."""
    from prefix_schedule.planning.planner import plan_microbatches

    from megatron_patches.training import reuse_step
    from tree_batches import make_tree_batch

    model = _model("G*M-", **UNIFORM)
    batch = make_tree_batch(5, [dict(depth=2, branching=2, node_len=5, suffix_len=3, inner=1)])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512, state_reads=True)
    with pytest.raises(ValueError, match="recompute_granularity='full' with prefix trees"):
        reuse_step(model, batch, plan, LOSS)
    assert all(p.grad is None for p in model.parameters())


def _pp2_rank(pattern, recompute, tp=1):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2 if tp == 1 else 1, tp=tp)
    model = _model(pattern, **recompute)
    runs, _ = _three_ways(model, make_batch(4, [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])]),
                          10, prefix_chunk_tokens=14)
    return rank_summary(runs, tp=parallel_state.get_tensor_model_parallel_world_size(),
                        layers="".join(model.decoder.layer_type_list))


def test_pp2_full_recompute():
    """PP=2, stages `G*M` | `-M-`: stage 0's re-run ends at its output (the received gradient)
    and injects its states' gradients; the last stage's (a Mamba layer between MLPs) stops at
    its final_norm."""
    try:
        results = run_distributed(_pp2_rank, world_size=2, args=("G*M|-M-", UNIFORM),
                                  timeout_s=400)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert [r["layers"] for r in results] == ["G*M", "-M-"]
    assert_ranks_equal(results, results[-1:])


def test_tp2_full_recompute():
    """TP=2, `G*M-`: GDN heads, attention heads and the Mamba mixer's heads split over the TP
    ranks; every rank's re-run injects its own shards' state and K/V gradients."""
    try:
        results = run_distributed(_pp2_rank, world_size=2, args=("G*M-", UNIFORM, 2),
                                  timeout_s=400)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert [(r["tp"], r["layers"]) for r in results] == [(2, "G*M-")] * 2
    assert_ranks_equal(results, results)
