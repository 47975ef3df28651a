"""Prefix reuse under Megatron-LM's production settings vs stock Megatron under the same ones.

The configs come from Megatron-LM's own argument parser and builders (tests/megatron_lm_args.py):
deallocate_pipeline_outputs=True, overlap_grad_reduce=True with the distributed optimizer and
overlap_param_gather, align_grad_reduce (grad_sync_func), fp32; plus variable_seq_lengths (RL
rows). The training loop mirrors Megatron-LM's (training/training.py: the config hooks at
3531-3550, zero_grad_buffer / optimizer.zero_grad / forward_backward / optimizer.step in
train_step, forward pre-hooks off for the first iteration at 3700 and on after it at 3895).
Two optimizer steps whose plans differ; Megatron's distributed Adam with eps=1, which makes its
update linear in the gradient (see tests/megatron_lm_args.py). Every rank: the loss, every
main_grad and every weight after each step within 1e-5 relative of stock dense (Megatron's 1F1B
pipeline over full rows) under the same settings.
"""

import dataclasses

import pytest
import torch

from dist_harness import run_distributed
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256)
MAX_SEQ = 512
TOL = 1e-5
# two steps with different plans; every row even (sequence parallelism splits rows over TP=2)
STEPS_EVEN = ([(33, [6, 8, 4]), (17, [8, 2]), (9, [4, 4, 6])], [(25, [4, 6, 2, 8]), (13, [6, 4])])
STEPS = ([(26, [6, 5, 8]), (15, [7, 4]), (33, [5, 6, 3, 4])], [(21, [5, 9, 4, 6]), (12, [3, 8])])


def _build(settings):
    """Model + Megatron DDP + Megatron's optimizer, wired as Megatron-LM's train() does."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    from megatron_patches.models.tiny import TinyLlamaConfig, build_model

    config = dataclasses.replace(settings.transformer_config)  # one config object per model
    module = build_model(TinyLlamaConfig(**MODEL, max_seq_len=MAX_SEQ), transformer_config=config)
    model = DistributedDataParallel(config, settings.ddp_config, module)
    optimizer = get_megatron_optimizer(settings.optimizer_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    if settings.ddp_config.overlap_grad_reduce:  # training.py:3531-3543
        config.no_sync_func = model.no_sync
        if settings.align_grad_reduce:
            config.grad_sync_func = model.start_grad_sync
    if settings.ddp_config.overlap_param_gather and settings.align_param_gather:
        config.param_sync_func = model.start_param_sync
    config.finalize_model_grads_func = finalize_model_grads
    if settings.ddp_config.overlap_param_gather:  # training.py:3700: off for the first step
        model.disable_forward_pre_hook(param_sync=False)
    return model, optimizer


def _weights(model):
    model.start_param_sync(force_sync=True)  # the overlapped all-gather, done now
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _grads(model):
    from megatron_patches.training import param_grads

    return param_grads(model)


def production_rank(tp: int, pp: int, sequence_parallel: bool, steps, budget: int) -> dict:
    import megatron_patches
    from megatron.core import parallel_state as ps
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import dense_step, max_relative_diff, missing_grads, reuse_step
    from megatron_lm_args import production_settings
    from prefix_schedule.planning.placement import place_groups
    from prefix_schedule.planning.planner import plan_microbatches

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=tp, pp=pp)
    settings = production_settings(tp=tp, pp=pp, dp=ps.get_data_parallel_world_size(),
                                   sequence_parallel=sequence_parallel, model=MODEL,
                                   seq_length=MAX_SEQ)
    (dense, dense_opt), (reuse, reuse_opt) = _build(settings), _build(settings)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    out = {"steps": [], "last_stage": ps.is_pipeline_last_stage(), "source": settings.source,
           "buckets": len(reuse.bucket_groups), "first_stage": ps.is_pipeline_first_stage(),
           "config": {k: getattr(dense.config, k) for k in (
               "deallocate_pipeline_outputs", "variable_seq_lengths", "sequence_parallel")}}
    for i, shapes in enumerate(steps):
        batch = make_batch(70 + i, shapes)
        if dp > 1:
            batch = place_groups(batch, dp_size=dp, token_budget=budget,
                                 max_seq_len=MAX_SEQ).ranks[dp_rank].batch
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=MAX_SEQ)
        results = []
        for model, optimizer, run in ((dense, dense_opt, lambda m: dense_step(m, batch, LOSS)),
                                      (reuse, reuse_opt, lambda m: reuse_step(m, batch, plan,
                                                                              LOSS))):
            model.zero_grad_buffer()  # train_step
            optimizer.zero_grad()
            result = run(model)
            results.append((result, _grads(model)))
            optimizer.step()
            if i == 0 and settings.ddp_config.overlap_param_gather:
                model.enable_forward_pre_hook()  # training.py:3895: on after the first step
        (d, dense_grads), (r, reuse_grads) = results
        out["steps"].append(dict(
            plan=[mb.num_tokens for mb in plan.microbatches],
            tokens=(d.num_tokens, r.num_tokens),
            loss=(d.loss, r.loss), grads=max_relative_diff(dense_grads, reuse_grads),
            missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
            weights=max_relative_diff(_weights(dense), _weights(reuse))))
    return out


def _check(results, expect_sp: bool):
    for rank, result in enumerate(results):
        assert result["config"] == {"deallocate_pipeline_outputs": True,
                                    "variable_seq_lengths": True,
                                    "sequence_parallel": expect_sp}, result["config"]
        plans = [s["plan"] for s in result["steps"]]
        for step in result["steps"]:
            assert not step["missing"], (rank, step)
            assert step["grads"] <= TOL, (rank, step)
            assert step["weights"] <= TOL, (rank, step)
            if result["last_stage"]:
                assert step["tokens"][0] == step["tokens"][1] > 0
                dense_loss, reuse_loss = step["loss"]
                assert abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss), (rank, step)
        assert len(result["steps"]) == 2 and plans[0] != plans[1], plans  # the plans differ
        # DDP buckets only the first stage (distributed_data_parallel.py:95-106): several there
        assert result["buckets"] > 1 or not result["first_stage"], result


def test_dp2_x_pp2_production_settings_two_steps():
    results = run_distributed(production_rank, world_size=4, args=(1, 2, False, STEPS, 12),
                              timeout_s=400)
    _check(results, expect_sp=False)


def test_tp2_sequence_parallel_x_pp2_production_settings():
    results = run_distributed(production_rank, world_size=4, args=(2, 2, True, STEPS_EVEN, 16),
                              timeout_s=400)
    _check(results, expect_sp=True)


def test_dp2_overlapped_grad_reduce_with_distributed_optimizer():
    """PP=1: the step's last backward is a prefix backward (Phase C), which does not touch the
    output layer; Megatron's DDP must still reduce every bucket, in both steps."""
    results = run_distributed(production_rank, world_size=2, args=(1, 1, False, STEPS, 12),
                              timeout_s=300)
    _check(results, expect_sp=False)


def parsed_rank() -> dict:
    from megatron_lm_args import production_settings

    settings = production_settings(tp=1, pp=2, dp=1, sequence_parallel=False, model=MODEL,
                                   seq_length=MAX_SEQ)
    return dict(source=settings.source, raw=settings.raw)


def test_megatron_lm_parser_gives_the_mirrored_production_values():
    """The values the tests rely on, read from Megatron-LM's own parser and builders, equal
    MIRRORED (the fallback where megatron.training is not installed, each value cited)."""
    from megatron_lm_args import MIRRORED

    result = run_distributed(parsed_rank, world_size=2, timeout_s=120)[0]
    assert result["source"] == "megatron-lm parser"
    assert result["raw"] == MIRRORED
