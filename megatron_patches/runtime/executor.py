"""Megatron forward-backward function for prefix reuse: walks the schedule, never decides order.

`forward_backward_prefix_reuse` has the signature of Megatron's own schedule functions, so a
training loop selects it through `get_forward_backward_func()` (see `use_prefix_reuse_schedule`)
and calls it the same way, with a `prefix_schedule.ReuseStep` as `data_iterator` and the model
(a list of V model chunks with virtual pipeline stages). This module checks the settings before
any compute, every rank refusing together if any rank's checks fail ([Note: agreed refusal] in
agreement.py), and brackets the step as Megatron's schedules do (embedding-wgrad buffers,
finalize_model_grads); megatron_patches/runtime/stage_runner.py runs this rank's row of the step's
lowered schedule, with all p2p traffic in megatron_patches/runtime/p2p.py.
"""

from __future__ import annotations

from prefix_schedule.planning.batch_checks import validate_batch
from prefix_schedule.pipeline import ActionKind
from prefix_schedule.pipeline.lowering import forward_only as forward_half
from prefix_schedule.runtime.step import ReuseStep

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config, unwrap_model

from megatron_patches.runtime.agreement import StepChecks, fingerprint
from megatron_patches.config.config_support import check_config_supported
from megatron_patches.support.cpu_support import cpu_support_enabled, refuse_with_nccl
from megatron_patches.runtime.layers import check_layers_supported, check_recurrent_step
from megatron_patches.runtime.moe import (check_moe_supported, expert_parallel_schedule,
                                  expert_parallel_schedule_mismatch)
from megatron_patches.runtime.stage_runner import StageRunner

__all__ = ["forward_backward_prefix_reuse", "check_reuse_supported"]

K = ActionKind


def check_reuse_supported(config, step, num_microbatches, model=None,
                          num_model_chunks: int = 1) -> None:
    """ValueErrors, before any compute, for settings where reuse would not equal dense."""
    if cpu_support_enabled():
        refuse_with_nccl()  # the CPU layer must never meet a GPU job
    if not isinstance(step, ReuseStep):
        raise ValueError(
            "the prefix-reuse schedule needs a prefix_schedule.ReuseStep as data_iterator "
            f"(got {type(step).__name__}); build one with ReuseStep(batch, plan)"
        )
    if num_microbatches is not None and num_microbatches != step.num_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} but the step plan has {step.num_microbatches} "
            "suffix microbatches; pass num_microbatches=step.num_microbatches"
        )
    check_config_supported(  # every TransformerConfig field: config_support.py
        config, global_loss_contract=getattr(step, "global_loss_contract", False))
    check_moe_supported(config)  # MoE settings that need the process groups to judge
    chosen = getattr(step.plan, "memory", None)  # plan_microbatches(memory_budget_bytes=...)
    if chosen is not None and chosen.options.recompute == "full" \
            and config.recompute_granularity != "full":
        raise ValueError("the plan fits its memory budget only with full activation recompute "
                         "(plan.memory); build the model with recompute_granularity='full', "
                         "recompute_method='uniform', recompute_num_layers=1")
    if config.recompute_granularity == "full":
        _check_full_recompute(config, step)
    if config.num_moe_experts and any(w.nodes is not None for w in step.plan.prefixes):
        raise ValueError("an MoE model with prefix trees: router statistics would have to count "
                         "a tree node's tokens once per trajectory below it, which is not built "
                         "yet; plan these groups with one shared prompt each (no nodes), or run "
                         "them dense")
    if model is not None:  # the data against the model: token ids and lengths
        gpt = unwrap_model(model)
        validate_batch(step.batch, max_seq_len=gpt.max_sequence_length, vocab_size=gpt.vocab_size)
    position_embedding = (getattr(unwrap_model(model), "position_embedding_type", "rope")
                          if model is not None else "rope")
    if position_embedding not in ("rope", "learned_absolute", "none"):
        raise ValueError(
            f"position_embedding_type={position_embedding!r}: only 'rope' (and learned absolute "
            "positions) continue at the prefix length in reuse steps; yarn / mrope are not hooked")
    _check_layout(step, num_model_chunks)
    if model is not None:
        _check_window_backend(config, model)
        check_layers_supported(config, model)  # HybridModel layer kinds, MTP
        check_recurrent_step(config, model, step)  # GDN: no prefix trees
    _check_context_parallel(config, step)
    _check_sequence_parallel_rows(config, step)
    _check_deferred_embedding_wgrad(config, step)
    step.check()  # rows that belong to the batch, CP layouts, not spent


def _check_window_backend(config, model) -> None:
    """Sliding windows run on backends with window kernels only ([Note: sliding windows]):
    refuse the others here, not at the first windowed layer's attention."""
    if config.window_size is None:
        return
    from prefix_schedule.attention.backends import select_backend

    param = next(unwrap_model(model).parameters())
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    backend = select_backend(device=param.device, dtype=config.params_dtype, head_dim=head_dim)
    if not backend.supports_window:
        raise ValueError(
            f"window_size={tuple(config.window_size)}: the attention backend {backend.name!r} "
            "has no sliding-window path in prefix reuse; choose 'torch' (CPU) or 'math' with "
            "--attention-backend / PREFIX_REUSE_ATTENTION_BACKEND")


def _check_full_recompute(config, step) -> None:
    """Full recompute re-runs each prefix unit in Phase C ([Note: prefix full recompute] in
    docs/DESIGN.md; MoE: [Note: prefix router stats under full recompute]); verified without
    prefix trees and CP, refused with them."""
    others = [name for name, on in (
        ("prefix trees", any(w.nodes is not None for w in step.plan.prefixes)),
        ("context parallelism", getattr(step, "cp", None) is not None)) if on]
    if others:
        raise ValueError(f"recompute_granularity='full' with {', '.join(others)} is not "
                         "verified with prefix reuse yet; use selective recompute or "
                         "offload_prefix_activations instead")


def _check_layout(step, num_model_chunks: int) -> None:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    planned = step.lowered
    if pp != planned.num_ranks:
        raise ValueError(
            f"the step was planned for {planned.num_ranks} pipeline stage(s) but the pipeline "
            f"size is {pp}; build it with ReuseStep(batch, plan, num_stages={pp})")
    if not planned.num_model_chunks == num_model_chunks == vpp:
        raise ValueError(
            f"the step was planned for {planned.num_model_chunks} model chunk(s) per rank, the "
            f"model has {num_model_chunks} and the virtual pipeline size is {vpp}; build the "
            f"step with ReuseStep(batch, plan, num_stages={pp}, num_model_chunks={vpp}) and "
            "pass the rank's model chunks as a list")


def _check_context_parallel(config, step) -> None:
    cp = parallel_state.get_context_parallel_world_size()
    planned = 1 if step.cp is None else step.cp.size
    if planned != cp or config.context_parallel_size != cp:
        raise ValueError(
            f"the context-parallel size is {cp} (config: {config.context_parallel_size}) but the "
            f"step runs CP={planned}; build it with ReuseStep(batch, plan, cp_group="
            "megatron_patches.training.context_parallel_group())")
    tp = config.tensor_model_parallel_size
    if cp > 1 and config.sequence_parallel and step.cp.row_multiple % tp:
        raise ValueError(
            f"sequence_parallel=True splits every CP rank's local row over the {tp} TP ranks, but "
            f"the step's CP group pads local rows to a multiple of {step.cp.row_multiple}; build "
            "it with ReuseStep(..., cp_group=megatron_patches.training.context_parallel_group("
            "config)) (or CPGroup(group, row_multiple=tp))")


def _check_deferred_embedding_wgrad(config, step) -> None:
    # Megatron's drain (utils.drain_embedding_wgrad_compute) pairs the output layer's buffered
    # inputs (appended per forward) with its buffered output gradients (per backward) in order.
    if not config.defer_embedding_wgrad_compute:
        return
    last, last_row = step.lowered.num_stages - 1, step.lowered.actions[-1]
    forwards = [a.index for a in last_row if a.kind is K.SUFFIX_FORWARD and a.stage == last]
    backwards = [a.index for a in last_row if a.kind is K.SUFFIX_BACKWARD and a.stage == last]
    if forwards != backwards:
        raise ValueError(
            "defer_embedding_wgrad_compute pairs the last stage's suffix forwards and backwards "
            f"in order, but this plan runs forwards {forwards} and backwards {backwards}; turn "
            "defer_embedding_wgrad_compute off for this plan")


def _check_sequence_parallel_rows(config, step) -> None:
    # Sequence parallelism scatters every row along the sequence over the TP ranks (the attention
    # hook still sees full-sequence q/k/v: the QKV projection gathers them first), so every row
    # must be a multiple of TP: the planner pads them ([Note: row padding] in planner.py).
    tp = config.tensor_model_parallel_size
    if not config.sequence_parallel or tp == 1:
        return
    units = {u: step.prefix_unit(u) for u in range(step.num_prefix_units)}
    chunked = step.plan.prefix_chunk_tokens is not None or any(c.chunk for c in units.values())
    rows = [(f"prefix unit {c.chunk} of group {c.group}" if chunked
             else f"the cached prefix of group {c.group}", step.prefix_length(u))
            for u, c in units.items()]
    rows += [(f"suffix microbatch {mb.index}", step.microbatch_length(mb.index))
             for mb in step.plan.microbatches]
    for what, length in rows:
        if length % tp:
            raise ValueError(
                f"sequence_parallel=True splits every row over the {tp} tensor-parallel ranks, but "
                f"{what} is {length} tokens long, not a multiple of {tp}: plan the step with "
                f"plan_microbatches(..., row_multiple={tp}), which pads every row exactly "
                f"(the plan has row_multiple={step.plan.row_multiple})"
            )


def _agreed_step(config, models, data_iterator, num_microbatches, forward_step_func) -> ReuseStep:
    """The step, once every rank's checks passed: each rank checks its own step, and all ranks
    raise together if any rank's checks failed ([Note: agreed refusal] in agreement.py)."""
    checks = StepChecks(models[0])
    step = checks.run(_the_step, data_iterator)
    checks.run(check_reuse_supported, config, step, num_microbatches, models[0],
               num_model_chunks=len(models))
    check_batch = getattr(forward_step_func, "check_batch", None)  # rl.make_policy_forward_step
    if check_batch is not None and checks.ok:
        checks.run(check_batch, step.batch)
    schedule = checks.run(expert_parallel_schedule, step) if config.num_moe_experts else None
    replica = checks.run(lambda: fingerprint(step.signature()))
    checks.agree(schedule, expert_parallel_schedule_mismatch, replica=replica)
    return step


def _the_step(data_iterator) -> ReuseStep:
    if isinstance(data_iterator, list):  # one per model chunk in Megatron; the step is shared
        if any(it is not data_iterator[0] for it in data_iterator):
            raise ValueError("prefix reuse takes one ReuseStep for all model chunks; pass the "
                             "same step for each (or the step itself)")
        data_iterator = data_iterator[0]
    return data_iterator


def forward_backward_prefix_reuse(*, forward_step_func, data_iterator, model, num_microbatches,
                                  seq_length=None, micro_batch_size=None,
                                  decoder_seq_length=None, forward_only=False,
                                  collect_non_loss_data=False, first_val_step=None,
                                  adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                  pg_collection=None, force_all_reduce=False):
    """Run one prefix-reuse step (Phases A, B, C interleaved as the step's schedule says).

    Same contract as Megatron's schedule functions: returns the list of what the loss function
    reported per suffix microbatch (last stage), and calls `config.finalize_model_grads_func`
    with the step's total loss-token count.
    """
    models = model if isinstance(model, list) else [model]
    config = get_model_config(models[0])
    step = _agreed_step(config, models, data_iterator, num_microbatches, forward_step_func)
    step.begin()
    if pg_collection is None:
        pg_collection = schedules._build_default_pg_collection()

    lowered = forward_half(step.lowered) if forward_only else step.lowered
    runner = StageRunner(step=step, models=models, forward_step_func=forward_step_func,
                         config=config, pg_collection=pg_collection,
                         actions=lowered.actions[parallel_state.get_pipeline_model_parallel_rank()],
                         collect_non_loss_data=collect_non_loss_data,
                         forward_only=forward_only, first_val_step=first_val_step)
    finalize = config.finalize_model_grads_func is not None and not forward_only
    last_rank = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    embedding = (schedules.clear_embedding_activation_buffer(config, models, last_rank)
                 if finalize else None)
    runner.run()
    for cache in step.caches:
        for group in cache.live_groups():  # forward-only steps keep nothing
            assert forward_only, f"group {group}: prefix cache left after a training step"
            cache.free(group)

    if finalize:
        # deferred output-layer weight gradients (defer_embedding_wgrad_compute), as Megatron
        schedules.finish_embedding_wgrad_compute(config, embedding, last_rank, pg_collection.tp)
        config.finalize_model_grads_func(
            models,
            runner.total_num_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection,
            force_all_reduce=force_all_reduce,
        )
    return runner.forward_data_store
