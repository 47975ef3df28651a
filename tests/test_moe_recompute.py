"""MoE with Megatron's full activation recompute in prefix-reuse steps vs stock Megatron dense
with the same full recompute (fp32, the dense packing of the reuse plan: tests/test_moe.py).

[Note: prefix router stats under full recompute] (prefix_schedule/runtime/router_stats.py):
Phase A runs the prefix under no_grad, records the prefix router sums as values and counts the
expert bias once; Phase C's re-run with Megatron's checkpoints recomputes the sums with their
graph and injects their accumulated gradients through the router's probabilities. Stock dense
counts aux losses, z-loss and expert bias only in its own re-run. Every case: loss, every aux
loss Megatron logs, every gradient (router weights and experts included), the weights after an
SGD step and the expert bias within 1e-5 relative; also on gloo: EP=2, PP=2, TP=2 x ETP=2,
EP=2 x PP=2 and PP=2 x VPP=2 (Megatron's interleaved schedule).
"""

import pytest

from dist_harness import DistributedRunError, run_distributed
from megatron_patches.training import worst_of
from test_moe import CASES as MOE_CASES, EQUAL_ROWS, STEPS, TOL, _run_steps, _spans_and_mixes

pytestmark = pytest.mark.megatron

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
AUX_Z = MOE_CASES["aux_loss+z_loss+shared"]

# id: (overrides, steps, token budget, plan options); STEPS[0]: group 0 spans three
# microbatches and microbatch 2 holds groups 0 and 1
CASES = {
    "aux_loss+z_loss": (dict(AUX_Z, **FULL), STEPS[:1], 9, {}),
    "seq_aux_loss": (dict(MOE_CASES["seq_aux_loss"], **FULL), STEPS[:1], 9, {}),
    # two steps: the bias the first step's counts moved routes the second
    "expert_bias": (dict(MOE_CASES["expert_bias"], **FULL), EQUAL_ROWS, 12, {}),
    "all_three+alltoall, chunks of 8": (dict(MOE_CASES["all_three+alltoall"], **FULL),
                                        STEPS[:1], 9, {"prefix_chunk_tokens": 8}),
    # block 1 of 2: the last layer runs whole in Phase C's forward (injected there, with grad)
    "block 1 of 2": (dict(AUX_Z, recompute_granularity="full", recompute_method="block",
                          recompute_num_layers=1), STEPS[:1], 9, {}),
}


def _assert_equal(records):
    for record in records:
        assert _spans_and_mixes(record["plan"])
        assert record["dense_metrics"].keys() == record["reuse_metrics"].keys()
        assert worst_of(*(record[k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL, \
            record
        assert all(b <= TOL for b in record["bias"]), record["bias"]


def _record_calls(monkeypatch, calls):
    from prefix_schedule.runtime.cache import PrefixKVCache

    for method in ("inject_router_grads", "rebind_router_stats", "store_router_stats"):
        original = getattr(PrefixKVCache, method)
        monkeypatch.setattr(PrefixKVCache, method, lambda *a, _f=original, _m=method, **k: (
            calls.append(_m), _f(*a, **k))[1])


@pytest.mark.parametrize("name", list(CASES))
def test_moe_full_recompute_equals_dense(megatron_env, monkeypatch, name):
    overrides, steps, budget, plan_kwargs = CASES[name]
    calls = []
    _record_calls(monkeypatch, calls)
    records = _run_steps(overrides, steps, budget=budget, **plan_kwargs)
    _assert_equal(records)
    if plan_kwargs:
        assert any(c.chunk > 0 for c in records[0]["plan"].prefix_units().values())
    if name == "expert_bias":  # no aux statistic: nothing recorded, nothing injected
        assert len(records[-1]["bias"]) == 2 and not calls
    else:
        assert "load_balancing_loss" in records[0]["dense_metrics"] or \
            "seq_load_balancing_loss" in records[0]["dense_metrics"]
        assert {"store_router_stats", "inject_router_grads"} == set(calls), set(calls)


def test_without_the_injected_router_gradient_the_step_differs(megatron_env, monkeypatch):
    """The checks above can fail: a Phase C re-run that leaves out the prefix sums' accumulated
    aux-loss / z-loss gradient keeps every forward value and misses the router gradient."""
    from prefix_schedule.runtime.cache import PrefixKVCache

    monkeypatch.setattr(PrefixKVCache, "inject_router_grads",
                        lambda self, group, layer, probs, recomputed, **kwargs: probs)
    records = _run_steps(CASES["aux_loss+z_loss"][0], STEPS[:1])
    assert records[0]["metrics"] <= TOL and records[0]["loss"] <= TOL
    assert max(records[0]["router_grads"]) > 1e-4


def test_without_the_phase_a_expert_bias_count_the_bias_differs(megatron_env, monkeypatch):
    """Counting by grad mode in Phase A (no_grad under full recompute: nothing counted) moves
    the expert bias away from dense: the count must be keyed on the step's recompute mode."""
    from prefix_schedule.runtime import step_contexts

    prefix_context = step_contexts.prefix_context
    monkeypatch.setattr(step_contexts, "prefix_context", lambda *args, **kwargs: prefix_context(
        *args, **dict(kwargs, full_recompute=False)))
    overrides, steps, budget, _ = CASES["expert_bias"]
    records = _run_steps(overrides, steps[:1], budget=budget)
    assert max(records[0]["bias"]) > 1e-3


def test_without_a_final_norm_the_last_stage_rebinds_router_stats(megatron_env, monkeypatch):
    """A last stage without a final norm re-runs its prefix whole (no checkpoints), on to the
    last MoE layer's router, and binds the re-run's sums to the entries; dense runs without the
    norm too."""
    from megatron.core.utils import unwrap_model

    def build(overrides):
        from test_moe import _twin

        model = _twin(overrides)
        unwrap_model(model).decoder.final_layernorm = None
        return model

    calls = []
    _record_calls(monkeypatch, calls)
    _assert_equal(_run_steps(CASES["aux_loss+z_loss"][0], STEPS[:1], build=build))
    assert "rebind_router_stats" in calls and "inject_router_grads" not in calls, set(calls)


def _hybrid_builder(pattern):
    """test_hybrid_moe's twins, with GDN / Mamba layers of test_hybrid_recompute's shapes."""
    def build(overrides):
        from test_hybrid_recompute import _model

        from megatron_patches.training import prepare_for_training

        return prepare_for_training(_model(pattern, num_moe_experts=4, **overrides), ddp=True)

    return build


@pytest.mark.parametrize("pattern", ["*E*-E", "G*ME"])
def test_hybrid_moe_full_recompute(megatron_env, pattern):
    """HybridModel with HybridStack's checkpointed forward: `*E*-E` and `G*ME` (an `E` after
    the last `*`: Phase A stops in its router; GDN and Mamba states injected beside it)."""
    from test_hybrid_moe import STATS

    records = _run_steps(dict(STATS, **FULL), STEPS[:1], build=_hybrid_builder(pattern))
    _assert_equal(records)
    assert {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"} <= set(
        records[0]["dense_metrics"])


@pytest.mark.parametrize("pattern", [None, "G*ME"])
def test_forward_only_counts_what_dense_counts(megatron_env, pattern):
    """A forward-only step with grad enabled (model in training mode): stock dense runs its
    layers in Megatron's checkpoints without grad and counts no expert bias; so does reuse,
    whose Phase A keeps the checkpoints in forward-only steps (a GPTModel, whose prefix stops
    in the last layer's router, and a HybridModel with GDN and Mamba layers). Same loss."""
    import torch

    from megatron_patches.runtime.moe import routers
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch
    from test_hybrid_moe import BIAS
    from test_moe import _twin

    batch = make_batch(*EQUAL_ROWS[0])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    counts, losses = [], []
    for run in ("dense", "reuse"):
        model = (_twin(CASES["expert_bias"][0]) if pattern is None
                 else _hybrid_builder(pattern)(dict(BIAS, **FULL)))
        with torch.enable_grad():
            result = (dense_step(model, batch, LOSS, forward_only=True, packing=plan)
                      if run == "dense" else reuse_step(model, batch, plan, LOSS,
                                                        forward_only=True))
        losses.append(result.loss)
        counts.append(torch.stack([r.local_tokens_per_expert for r in routers(model)]))
    assert torch.equal(counts[0], counts[1]) and not counts[1].any(), counts
    assert abs(losses[0] - losses[1]) <= TOL * abs(losses[0])


@pytest.mark.parametrize("ep,pp,tp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)])
def test_moe_full_recompute_parallel(megatron_env, ep, pp, tp):
    """EP=2 (alltoall: every re-run's token exchange pairs up across the expert-parallel ranks,
    whose plans run the same actions), PP=2 (stage 0's re-run ends at its output with the
    received gradient, the last stage's at its final norm), TP=2 with sequence parallelism and
    expert TP=2 (each TP rank recomputes and injects its own shard's sums) and EP=2 x PP=2 (4
    processes)."""
    from test_moe_parallel import _check, ep_rank

    try:
        results = run_distributed(ep_rank, world_size=ep * pp * tp,
                                  kwargs=dict(ep=ep, pp=pp, tp=tp, recompute=FULL,
                                              num_steps=1),
                                  timeout_s=150 * ep * pp * tp)
    except DistributedRunError as error:
        pytest.fail(str(error))
    _check(results)
    assert all({"load_balancing_loss", "seq_load_balancing_loss", "z_loss"}
               <= set(out["steps"][0]["metric_names"]) for out in results)


def vpp_moe_rank(overrides: dict, steps, budget: int) -> list:
    """PP=2 x VPP=2 (rank r holds layers r+1 and r+3): DDP-wrapped dense and reuse twins, stock
    `forward_backward_pipelining_with_interleaving` over the plan's packing vs reuse; per step
    this rank's loss (last stage), aux losses, gradients, expert bias, weights and the
    PrefixKVCache router-stat methods its reuse step called."""
    import megatron_patches
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step, zero_grads)
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.cache import PrefixKVCache
    from test_equivalence import LOSS, make_batch
    from test_moe import SMALL, _expert_bias, _metrics, _rel, _sgd_step
    from test_moe_parallel import MOE

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2, vpp=2)
    calls = set()  # this rank process's own class: recorded for the reuse step
    for method in ("inject_router_grads", "rebind_router_stats", "store_router_stats"):
        setattr(PrefixKVCache, method, lambda *a, _f=getattr(PrefixKVCache, method), _m=method,
                **k: (calls.add(_m), _f(*a, **k))[1])

    def twin():
        chunks = [DistributedDataParallel(m.config, DistributedDataParallelConfig(), m) for m in (
            build_model(TinyLlamaConfig(**dict(SMALL, num_layers=4)), vp_stage=v,
                        overlap_p2p_comm=True, batch_p2p_comm=False,
                        deallocate_pipeline_outputs=True, **dict(MOE, **overrides))
            for v in range(2))]
        for chunk in chunks:
            chunk.config.finalize_model_grads_func = finalize_model_grads
            chunk.config.no_sync_func = [c.no_sync for c in chunks]
        return chunks

    def every(fn, chunks):
        return {f"chunk{v}.{k}": t for v, c in enumerate(chunks) for k, t in fn(c).items()}

    twins = twin(), twin()
    optimizers = [torch.optim.SGD([p for c in t for p in c.parameters()], lr=0.1, momentum=0.9)
                  for t in twins]
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    _metrics()
    last = ps.get_pipeline_model_parallel_rank() == 1
    out = []
    for seed, shapes in steps:
        batch = make_batch(seed, shapes)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512)
        for chunk in (*twins[0], *twins[1]):
            zero_grads(chunk)
        dense = dense_step(twins[0], batch, LOSS, packing=plan)
        dense_metrics, dense_grads = _metrics(), every(param_grads, twins[0])
        calls.clear()
        reuse = reuse_step(twins[1], batch, plan, LOSS)
        reuse_metrics, reuse_grads = _metrics(), every(param_grads, twins[1])
        for chunks, optimizer in zip(twins, optimizers):
            for chunk in chunks:
                _sgd_step(chunk, optimizer)
        weights = [every(lambda c: {n: p.detach() for n, p in c.named_parameters()}, t)
                   for t in twins]
        biases = [[b for c in t for b in _expert_bias(c)] for t in twins]
        out.append(dict(
            microbatches=len(plan.microbatches), calls=sorted(calls),
            recompute=[c.config.recompute_granularity for t in twins for c in t],
            metric_names=sorted(dense_metrics),
            reuse_metric_names=sorted(reuse_metrics),
            loss=abs(dense.loss - reuse.loss) / abs(dense.loss) if last else 0.0,
            grads=max_relative_diff(dense_grads, reuse_grads),
            router_grads=[n for n in dense_grads if n.endswith("router.weight")],
            expert_grads=sum("local_experts" in n for n in dense_grads),
            missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
            metrics=worst_of(*(_rel(dense_metrics[k], reuse_metrics[k]) for k in dense_metrics)),
            weights=max_relative_diff(weights[0], weights[1]),
            bias=[_rel(a, b) for a, b in zip(*biases)],
            bias_moved=[float(b.abs().max()) for b in biases[1]]))
    return out


# PP=2 x VPP=2: stock interleaving needs an even number of dense microbatches here (Megatron's
# microbatch_group_size_per_vp_stage = PP); expert bias: equal rows per dense microbatch
VPP_CASES = {
    "aux+seq_aux+z_loss+shared": (FULL, STEPS[:1], 9),  # test_moe_parallel's MOE: 4 microbatches
    "expert_bias": (dict(MOE_CASES["expert_bias"], moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                         **FULL), ((8, EQUAL_ROWS[1][1]), (9, EQUAL_ROWS[1][1])), 12),
}


@pytest.mark.parametrize("name", list(VPP_CASES))
def test_moe_full_recompute_virtual_pipeline(megatron_env, name):
    """PP=2 x VPP=2 (Megatron's interleaved schedule, overlap_p2p_comm, one MoE layer per model
    chunk; rank 1's chunk 1 is the last stage): aux_loss + seq_aux_loss + z-loss with a shared
    expert over one step (router sums stored and injected on both ranks), and the expert bias
    over two steps (nothing stored or injected); an expert no token reached has no gradient
    in both runs."""
    overrides, steps, budget = VPP_CASES[name]
    try:
        results = run_distributed(vpp_moe_rank, world_size=2, args=(overrides, steps, budget),
                                  timeout_s=300)
    except DistributedRunError as error:
        pytest.fail(str(error))
    for rank, out in enumerate(results):
        for step in out:
            assert step["microbatches"] % 2 == 0 and step["router_grads"] and step["expert_grads"]
            # only an expert no token reached in either run may have no gradient (both sides)
            dense, reuse = ({m.split(": ")[1] for m in step["missing"] if m.startswith(side)}
                            for side in ("dense", "reuse"))
            assert dense == reuse and all("local_experts" in n for n in dense), (rank, dense, reuse)
            assert name == "expert_bias" or not dense, (rank, dense)
            assert step["metric_names"] == step["reuse_metric_names"]
            assert worst_of(*(step[k] for k in ("loss", "grads", "metrics", "weights"))) <= TOL, (
                rank, step)
            assert all(b <= TOL for b in step["bias"]), (rank, step["bias"])
    assert all(step["recompute"] == ["full"] * 4 for out in results for step in out)
    if name == "expert_bias":  # no aux statistic: nothing recorded, nothing injected
        assert all(not step["calls"] for out in results for step in out)
        assert all(len(step["bias"]) == 2 for out in results for step in out)
        assert all(min(out[0]["bias_moved"]) > 0 for out in results)  # step 1 moved every bias
    else:
        assert all(step["calls"] == ["inject_router_grads", "store_router_stats"]
                   for out in results for step in out)
        assert all({"load_balancing_loss", "seq_load_balancing_loss", "z_loss"}
                   <= set(step["metric_names"]) for out in results for step in out)
