"""Prefix reuse with virtual pipeline stages (Megatron's interleaved layout: rank r holds model
chunks v = 0..V-1, chunk v being virtual stage v * PP + r) vs stock Megatron's
`forward_backward_pipelining_with_interleaving` on the same model chunks and data: the loss and
every parameter gradient of every chunk on every rank within 1e-5 relative (fp32).

Stock interleaving runs with Megatron-LM's setting for virtual stages (overlap_p2p_comm=True, so
batch_p2p_comm=False: training/arguments.py:966-983, argument_utils.py:307); its dense
microbatch count must satisfy its own rule (a multiple of PP here). The reuse steps run under
strict NCCL p2p semantics (tests/dist_harness.py) with deallocate_pipeline_outputs=True.
"""

import pytest

from dist_harness import run_distributed
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

SMALL = dict(hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
             vocab_size=256, max_seq_len=512)


def _grads(models):
    from megatron_patches.training import param_grads

    return {f"chunk{v}.{name}": g for v, model in enumerate(models)
            for name, g in param_grads(model).items()}


def vpp_rank(pp: int, vpp: int, shapes, budget: int, seed: int, chunk_tokens=None) -> dict:
    import megatron_patches
    from megatron.core import parallel_state as ps
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads, reuse_step,
                                           scale_grads_by_token_count)
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp, vpp=vpp)
    cfg = TinyLlamaConfig(num_layers=pp * vpp, **SMALL)
    models = [build_model(cfg, vp_stage=v, overlap_p2p_comm=True, batch_p2p_comm=False,
                          deallocate_pipeline_outputs=True) for v in range(vpp)]
    for model in models:
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    batch = make_batch(seed, shapes)
    dense = dense_step(models, batch, LOSS)
    dense_grads = _grads(models)
    for model in models:
        model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=SMALL["max_seq_len"],
                             prefix_chunk_tokens=chunk_tokens)
    reuse = reuse_step(models, batch, plan, LOSS)
    reuse_grads = _grads(models)
    return dict(rank=ps.get_pipeline_model_parallel_rank(), losses=(dense.loss, reuse.loss),
                tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
                chunks=len(models), layers=sum(len(m.decoder.layers) for m in models))


def _check(results, vpp):
    last = results[-1]
    assert last["tokens"][0] == last["tokens"][1] > 0
    assert abs(last["losses"][0] - last["losses"][1]) <= 1e-5 * abs(last["losses"][0])
    for r in results:
        assert r["chunks"] == vpp and r["layers"] == vpp, r
        assert not r["missing"], f"rank {r['rank']}: no (or a non-finite) gradient: {r['missing'][:5]}"
        assert r["grad_diff"] <= 1e-5, f"rank {r['rank']}: gradient diff {r['grad_diff']:.2e}"


def test_pp2_x_vpp2_equals_megatron_interleaved():
    shapes = [(22, [6, 5, 4, 7]), (13, [7, 3]), (17, [5, 6])]  # 8 dense microbatches
    _check(run_distributed(vpp_rank, world_size=2, args=(2, 2, shapes, 10, 21), timeout_s=240),
           vpp=2)


def test_pp2_x_vpp2_prefix_chunks_equal_megatron_interleaved():
    shapes = [(25, [6, 5, 4, 7]), (13, [7, 3])]
    _check(run_distributed(vpp_rank, world_size=2, args=(2, 2, shapes, 10, 22, 8),
                           timeout_s=240), vpp=2)


def test_pp4_x_vpp2_equals_megatron_interleaved():
    shapes = [(19, [6, 5, 4, 7]), (11, [7, 3, 5, 4])]  # 8 dense microbatches
    _check(run_distributed(vpp_rank, world_size=4, args=(4, 2, shapes, 9, 23), timeout_s=400),
           vpp=2)
