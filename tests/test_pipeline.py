"""Prefix reuse under pipeline parallelism (gloo, 2 and 4 processes) vs stock Megatron 1F1B
(`forward_backward_pipelining_without_interleaving`) on the same data and weights: the loss and
every parameter gradient on every stage within 1e-5 relative (fp32).

The executor's p2p runs under strict NCCL semantics (tests/dist_harness.py): a send waits for its
receiver. Today's lowering groups crossing pairs into one exchange; the ungrouped lowering it
replaced deadlocks under these semantics (and passes on plain gloo, which buffers sends)."""

import pytest

from dist_harness import run_distributed

pytestmark = pytest.mark.megatron


def _pp_rank(pp, shapes, token_budget, seed, config_overrides=None):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step, scale_grads_by_token_count)
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=pp)
    cfg = TinyLlamaConfig(num_layers=4, hidden_size=64, ffn_hidden_size=176,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_model(cfg, **(config_overrides or {}))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(seed, shapes)
    dense = dense_step(model, batch, LOSS)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=token_budget, max_seq_len=512)
    reuse = reuse_step(model, batch, plan, LOSS)
    reuse_grads = param_grads(model)
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                dense_loss=dense.loss, reuse_loss=reuse.loss, tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
                num_microbatches=len(plan.microbatches))


def _check(results):
    last = results[-1]
    assert last["tokens"][0] == last["tokens"][1] > 0
    assert abs(last["dense_loss"] - last["reuse_loss"]) <= 1e-5 * abs(last["dense_loss"])
    for r in results:
        assert not r["missing"], f"stage {r['stage']}: no (or a non-finite) gradient: {r['missing'][:5]}"
        assert r["grad_diff"] <= 1e-5, f"stage {r['stage']}: gradient diff {r['grad_diff']:.2e}"


@pytest.mark.parametrize("strict_p2p", [True, False], ids=["strict", "batch_isend_irecv"])
def test_pp2_several_groups_variable_lengths(strict_p2p):
    """strict: the NCCL-semantics transport; batch_isend_irecv: the product transport on gloo."""
    shapes = [(30, [6, 9, 4, 7, 5]), (17, [8, 3]), (41, [5, 7, 6, 2])]
    results = run_distributed(_pp_rank, world_size=2, args=(2, shapes, 12, 3), timeout_s=180,
                              strict_p2p=strict_p2p)
    assert results[0]["num_microbatches"] >= 6
    _check(results)


def test_pp4_group_spanning_many_microbatches():
    shapes = [(37, [7, 8, 6, 9, 5, 7, 8]), (12, [4, 6])]
    results = run_distributed(_pp_rank, world_size=4, args=(4, shapes, 9, 4), timeout_s=240)
    _check(results)


def test_pp2_deallocate_pipeline_outputs():
    """What Megatron-LM's argument parser sets (training/argument_utils.py:305): each sent output
    is pseudo-freed and backward_step runs custom_backward on it, prefix outputs included."""
    shapes = [(22, [6, 5, 4]), (13, [7, 3])]
    results = run_distributed(_pp_rank, world_size=2, timeout_s=180,
                              args=(2, shapes, 10, 7, {"deallocate_pipeline_outputs": True}))
    _check(results)


def _p2p_log_rank():
    import logging
    import os

    os.environ["PREFIX_REUSE_P2P_LOG"] = "1"
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megatron_patches.runtime.p2p").addHandler(handler)
    _pp_rank(2, [(12, [3, 4])], 8, 5)
    return records


def test_p2p_log_names_every_operation_with_rank_and_counter():
    logs = run_distributed(_p2p_log_rank, world_size=2, timeout_s=180)
    for rank, lines in enumerate(logs):
        assert lines, f"rank {rank} logged no p2p operation"
        assert all(f"[p2p rank {rank} #" in line for line in lines)
        counters = [int(line.split("#")[1].split("]")[0]) for line in lines]
        assert counters == list(range(1, len(lines) + 1))
    assert any("send" in line and "PFS" in line for line in logs[0])
    assert any("recv" in line and "PFR" in line for line in logs[1])


def _ungrouped_rank():
    """The reuse step with the pre-exchange lowering (single sends/receives only)."""
    from prefix_schedule.pipeline.lowering import lower
    from prefix_schedule.runtime import step as step_module

    class Ungrouped(step_module.ReuseStep):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lowered = lower(self.schedule, group_exchanges=False)

    step_module.ReuseStep = Ungrouped
    from megatron_patches import training
    training.ReuseStep = Ungrouped
    return _pp_rank(2, [(20, [5, 6, 4, 7]), (11, [6, 3])], 8, 9)


def test_ungrouped_lowering_deadlocks_under_nccl_semantics_but_not_on_plain_gloo():
    # plain gloo buffers every send: the ungrouped plan runs (and is exact)
    _check(run_distributed(_ungrouped_rank, world_size=2, timeout_s=180, strict_p2p=False))
    # NCCL semantics: both ranks send to each other before either receives
    with pytest.raises(AssertionError, match="p2p deadlock") as info:
        run_distributed(_ungrouped_rank, world_size=2, timeout_s=180, strict_p2p=True,
                        stall_s=5)
    assert "send 0SFS" in str(info.value) and "send 1SBS" in str(info.value)


def _release_rank():
    import weakref

    from megatron_patches.runtime import p2p
    from megatron_patches.runtime import stage_runner

    sent, seen = {}, []
    post, backward = p2p._StrictGlooTransport.post, stage_runner.StageRunner.suffix_backward

    def recording_post(self, ops, buffers):
        sent.update((op.label, weakref.ref(op.tensor)) for op in ops if op.is_send)
        return post(self, ops, buffers)

    def recording_backward(self, action):
        backward(self, action)
        self.p2p.release_completed()
        seen.append((action.index, sorted(k for k, ref in sent.items() if ref() is not None)))

    p2p._StrictGlooTransport.post = recording_post
    stage_runner.StageRunner.suffix_backward = recording_backward
    result = _pp_rank(2, [(20, [5, 6, 4, 7]), (11, [6, 3])], 8, 9)
    return dict(result, alive=seen)


def test_sent_tensors_are_released_when_their_send_completes():
    """Rank 0 sends microbatch m's activations before it receives m's gradient; once SB m has
    run, that send has completed (the receiver took it) and the sent tensor is freed, so the
    held activations follow 1F1B, not the step."""
    results = run_distributed(_release_rank, world_size=2, timeout_s=180)
    _check(results)
    alive = results[0]["alive"]
    assert len(alive) >= 4
    for microbatch, labels in alive:
        stale = [label for label in labels if label.startswith("0SFS")
                 and int(label[4:]) <= microbatch]
        assert not stale, (microbatch, labels)


def _forward_only_rank():
    import torch

    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import LOSS, make_batch

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                        num_attention_heads=4, num_query_groups=2,
                                        vocab_size=256, max_seq_len=512),
                        deallocate_pipeline_outputs=True)
    batch = make_batch(11, [(18, [5, 6, 4]), (9, [6, 3])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=512, prefix_chunk_tokens=6)
    step = ReuseStep(batch, plan, num_stages=2)
    with torch.no_grad():
        dense = dense_step(model, batch, LOSS, forward_only=True)
        reuse = reuse_step(model, batch, plan, LOSS, forward_only=True, step=step)
    return dict(last=parallel_state.is_pipeline_last_stage(), losses=(dense.loss, reuse.loss),
                live=step.cache.live_groups())


def test_pp2_forward_only_exchanges_keep_their_forward_half():
    """Forward-only steps run the forward half of the lowered plan (exchanges keep their forward
    ops): same loss as stock dense, nothing left in the cache, no deadlock."""
    for result in run_distributed(_forward_only_rank, world_size=2, timeout_s=180):
        assert result["live"] == ()
        if result["last"]:
            dense, reuse = result["losses"]
            assert abs(dense - reuse) <= 1e-5 * abs(dense)
