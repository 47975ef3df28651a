"""Memory options inside real Megatron, each held to stock dense (fp32, 1e-5) at PP=1 and PP=2:
prefix-activation offload ([Note: prefix activation offload] in runtime/offload.py) and the
device-memory accounting of a step ([Note: device-memory accounting] in runtime/memory.py)."""

import pytest
import torch

from dist_harness import run_distributed
from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS, TOL, make_batch

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


def _model(num_layers=2, **overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(**{**SMALL, "num_layers": num_layers}), **overrides)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


def _grads_of(model, run):
    from megatron_patches.training import param_grads

    model.zero_grad(set_to_none=True)
    run()
    grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def _compare(model, batch, plan, num_stages=1, **step_options):
    """Gradient differences: (reuse with options vs dense, vs plain reuse), and the step."""
    from megatron_patches.training import dense_step, max_relative_diff, reuse_step

    dense = _grads_of(model, lambda: dense_step(model, batch, LOSS))
    plain = _grads_of(model, lambda: reuse_step(model, batch, plan, LOSS))
    step = ReuseStep(batch, plan, num_stages=num_stages, **step_options)
    got = _grads_of(model, lambda: reuse_step(model, batch, plan, LOSS, step=step))
    return max_relative_diff(dense, got), max_relative_diff(plain, got), step


FULL = {"uniform": dict(recompute_granularity="full", recompute_method="uniform",
                        recompute_num_layers=2),
        "block": dict(recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=1)}


@pytest.mark.parametrize("method", sorted(FULL))
@pytest.mark.parametrize("chunk_tokens", [None, 12], ids=["whole", "chunks"])
def test_full_recompute_equals_dense(megatron_env, method, chunk_tokens):
    """[Note: prefix full recompute]: Phase A keeps the K/V only, Phase C re-runs the prefix
    forward with its graph; suffix microbatches recompute as Megatron does."""
    model = _model(num_layers=4, **FULL[method])
    batch = make_batch(5, [(30, [6, 9, 4]), (17, [8, 3])])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512,
                             prefix_chunk_tokens=chunk_tokens)
    vs_dense, _, _ = _compare(model, batch, plan)
    assert vs_dense <= TOL
    assert model.config.recompute_granularity == "full", "the prefix toggle was undone"


def test_full_recompute_keeps_only_the_cache_through_the_suffix_phase(megatron_env):
    """What Phase A leaves on the device under full recompute: the cached K/V, nothing saved;
    Phase C holds far less than plain reuse's."""
    model = _model(num_layers=4, **dict(FULL["uniform"], recompute_num_layers=1))
    batch = make_batch(3, [(40, [5, 6, 4, 7])])
    plan = plan_microbatches(batch, token_budget=7, max_seq_len=512)
    meter, step = _measured(model, batch, plan)
    # layers x (K, V) x 39 cached tokens (the last prompt token runs with the suffixes) x 2 kv
    # heads x 16 dims x fp32: only the K/V bytes (V is compacted out of the fused QKV output)
    cache_bytes = 4 * 2 * 39 * 2 * 16 * 4
    assert meter.phase_peaks["PF"] == cache_bytes
    plain, _ = _measured(_model(num_layers=4), batch, plan)
    assert meter.phase_peaks["suffix"] < plain.phase_peaks["suffix"] / 2
    # Phase C keeps Megatron's checkpoints: layer inputs and one layer's recompute at a time
    assert meter.phase_peaks["PB"] < plain.phase_peaks["PB"] / 2


def _pp_rank(pp, seed, chunk_tokens, model_options, step_options):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp)
    model = _model(num_layers=4, deallocate_pipeline_outputs=True, **model_options)
    batch = make_batch(seed, [(30, [6, 9, 4]), (17, [8, 3]), (41, [5, 7, 6])])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512,
                             prefix_chunk_tokens=chunk_tokens)
    vs_dense, vs_plain, step = _compare(model, batch, plan, num_stages=pp, **step_options)
    result = dict(stage=parallel_state.get_pipeline_model_parallel_rank(), vs_dense=vs_dense,
                  vs_plain=vs_plain)
    off = step.offloader
    if off is not None:
        result.update(stats=dict(off.stats), pending=off.pending_units(),
                      pool_in_use=off.pool.in_use_bytes, pool_peak=off.pool.peak_in_use_bytes,
                      resident=len(list(off.resident_tensors())))
    return result


@pytest.mark.parametrize("chunk_tokens, pool_bytes", [(None, None), (12, 64 * 1024)],
                         ids=["whole_prefixes", "chunks_bounded_pool"])
def test_offload_pp2_several_groups_in_flight(chunk_tokens, pool_bytes):
    """Three groups (or their chunks) in flight on each stage, offloaded until their Phase C;
    deallocate_pipeline_outputs as Megatron-LM sets it; NCCL-strict p2p."""
    options = dict(offload_prefix_activations=True, offload_pool_bytes=pool_bytes)
    results = run_distributed(_pp_rank, world_size=2, timeout_s=240,
                              args=(2, 21, chunk_tokens, {}, options))
    for r in results:
        assert r["vs_dense"] <= TOL, r
        assert r["vs_plain"] == 0.0, f"stage {r['stage']}: offload changed bits"
        assert r["stats"]["offloaded_bytes"] > 0 and r["stats"]["kept_params"] > 0
        assert r["pending"] == () and r["pool_in_use"] == 0 and r["resident"] == 0
        if pool_bytes is not None:
            assert r["pool_peak"] <= pool_bytes and r["stats"]["pool_full"] > 0


@pytest.mark.parametrize("method, chunk_tokens", [("uniform", None), ("block", 12)])
def test_full_recompute_pp2(method, chunk_tokens):
    """Phase C re-runs each prefix unit on every stage from the input it kept (the received
    hidden states on stage 1), under deallocate_pipeline_outputs and NCCL-strict p2p."""
    results = run_distributed(_pp_rank, world_size=2, timeout_s=240,
                              args=(2, 22, chunk_tokens, FULL[method], {}))
    for r in results:
        assert r["vs_dense"] <= TOL, r


def _measured(model, batch, plan, **options):
    from megatron_patches.training import reuse_step
    from prefix_schedule.runtime.memory import DeviceMemoryMeter, watch_step

    step = ReuseStep(batch, plan, **options)
    meter = DeviceMemoryMeter(exclude=list(model.parameters()))
    watch_step(step, meter)
    model.zero_grad(set_to_none=True)
    with meter:
        reuse_step(model, batch, plan, LOSS, step=step)
    model.zero_grad(set_to_none=True)
    return meter, step


def test_offload_moves_the_dormant_prefix_off_the_device(megatron_env):
    """Accounting on a real model: with offload the suffix phase holds no prefix activation on
    the device but the cache (and tensors below min_bytes); the offloaded bytes are host bytes
    while it runs and come back for Phase C."""
    model = _model()
    batch = make_batch(3, [(40, [5, 6, 4, 7])])
    plan = plan_microbatches(batch, token_budget=7, max_seq_len=512)
    plain, _ = _measured(model, batch, plan)
    offload, step = _measured(model, batch, plan, offload_prefix_activations=True)
    moved = step.offloader.stats["offloaded_bytes"]
    assert moved > 0 and offload.peak_host_bytes == moved and offload.host_bytes == 0
    # Phase A leaves only the cache (and tensors under min_bytes) on the device; the suffix phase
    # saves about as much (its own peak falls at another moment of the phase)
    dormant = plain.phase_peaks["PF"] - offload.phase_peaks["PF"]
    assert offload.phase_peaks["PF"] < plain.phase_peaks["PF"] / 4
    assert offload.phase_peaks["suffix"] < plain.phase_peaks["suffix"] - 0.9 * dormant
    assert offload.phase_peaks["PB"] >= dormant, "Phase C brings the activations back"
    assert set(plain.phase_peaks) == {"PF", "SF", "SB", "PB", "RG", "suffix"}
