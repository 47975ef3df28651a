"""MoE routers in prefix-reuse steps: logical prefix-token accounting.

[Note: logical prefix tokens] (prefix_schedule/runtime/router_stats.py) says what is counted;
docs/DESIGN.md "MoE" says which dense packing a reuse step equals. Here is the Megatron side.

`install()` wraps megatron-core's `TopKRouter.routing` (a runtime wrapper, declared in
`ROUTING_WRAPPER`; the signature is checked at install, `tools/snapshot_signatures.py` keeps it):
with no reuse context it calls the stock method unchanged, so dense training is stock. In a
reuse context it runs the stock routing with the router's statistics switched off (the top-k
choice, scores and expert-bias routing are Megatron's own) and then:
- Phase A (prefix rows): records the prefix's aux-loss counts, score sums and z-loss sums per
  MoE layer in the cache, and adds `multiplicity` x the prefix's routed counts to the expert-bias
  statistics (never in a Phase C recompute); on the last stage an MoE last layer stops the
  forward here (`PrefixForwardContext.stop_in_router`). Under full recompute Phase A runs
  without grad and Phase C's re-run recomputes the sums with their graph ([Note: prefix router
  stats under full recompute] in router_stats.py);
- Phase B (suffix rows): computes Megatron's aux_loss / seq_aux_loss / global_aux_loss and
  z-loss with every prefix token of the row's trajectories counted with its multiplicity, and
  attaches them with Megatron's own `attach_and_log_load_balancing_loss` (loss scale, per-token
  scaling, logging): the prefix's share of the gradient lands in the cache (Phase C applies it).

[Note: MoE under sequence parallelism]
With TP > 1 Megatron-LM requires sequence parallelism for MoE: each TP rank routes its
contiguous shard of every row (a reuse row's padding sits at its end, so a rank's real tokens
are a prefix of its shard), all-reduces the expert counts over the TP group and keeps the score
sums and lse^2 local (the gradients of the shards add up). So in Phase A each rank records its
shard's prefix sums (and the whole prefix's token count), and in Phase B each rank adds n_g x its
own shard's prefix sums to its shard's sums. Megatron scales a rank's per-token aux terms and
divides its z-loss by that rank's own valid tokens: dense equals "T / TP per rank" only when
every TP rank holds as many valid tokens, i.e. dense microbatches of equal-length rows (no
padding); a reuse rank uses T_logical / TP, which equals that dense run. Expert tensor
parallelism (experts split over the ETP ranks) is a per-token function; its ranks must run the
same plan (`expert_parallel_schedule`).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import Dict, List, Optional

import torch

from prefix_schedule.runtime.context import (PrefixForwardContext, PrefixForwardDone,
                                              current_context)
from prefix_schedule.runtime.router_stats import RouterStats

from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler,
                                                     compute_routing_scores_for_aux_loss,
                                                     switch_load_balancing_loss_func)

__all__ = ["install", "uninstall", "routers", "needs_prefix_stats",
           "check_moe_supported", "expert_parallel_schedule",
           "expert_parallel_schedule_mismatch"]

ROUTING_WRAPPER = ("megatron.core.transformer.moe.router.TopKRouter.routing",
                   "(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None)")
"""The one Megatron method wrapped at run time, and the signature it was written against."""

_STOCK_ROUTING = router_module.TopKRouter.routing


def install() -> None:
    """Wrap `TopKRouter.routing` (idempotent); refuses a signature it was not written for."""
    signature = str(inspect.signature(_STOCK_ROUTING))
    if signature != ROUTING_WRAPPER[1]:
        raise RuntimeError(f"{ROUTING_WRAPPER[0]} has signature {signature}, not "
                           f"{ROUTING_WRAPPER[1]}: this megatron-core is not supported by "
                           "megatron_patches.runtime.moe")
    router_module.TopKRouter.routing = _routing


def uninstall() -> None:
    router_module.TopKRouter.routing = _STOCK_ROUTING


def routers(model) -> List["router_module.TopKRouter"]:
    return [m for m in model.modules() if isinstance(m, router_module.TopKRouter)]


def needs_prefix_stats(router) -> bool:
    """Whether a router's statistics see the prefix tokens: aux losses, z-loss, expert bias."""
    return (router.is_aux_loss_enabled() or router.config.moe_z_loss_coeff is not None
            or router.enable_expert_bias)


@contextlib.contextmanager
def _statistics_off(router):
    """Stock routing without aux losses, z-loss and expert-bias counting (we do those)."""
    training, bias = router.training, router.enable_expert_bias
    router.training, router.enable_expert_bias = False, False
    try:
        yield
    finally:
        router.training, router.enable_expert_bias = training, bias


def _routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
    context = current_context()
    if context is None:
        return _STOCK_ROUTING(self, logits, padding_mask)
    if padding_mask is not None:
        raise ValueError("reuse rows take no padding_mask: the step plan says where padding is")
    with _statistics_off(self):
        probs, routing_map = _STOCK_ROUTING(self, logits, None)
    flat = logits.view(-1, self.config.num_moe_experts)
    if isinstance(context, PrefixForwardContext):
        return _prefix_routing(self, flat, probs, routing_map, context), routing_map
    return _suffix_routing(self, flat, probs, routing_map, context), routing_map


def _counting(router, without_grad: bool = False) -> bool:
    """Megatron's gate for aux losses and z-loss (stock `routing` / `apply_z_loss`);
    `without_grad`: also under no_grad (Phase A of a full-recompute step)."""
    return router.training and (without_grad or torch.is_grad_enabled()) and (
        router.is_aux_loss_enabled() or router.config.moe_z_loss_coeff is not None)


def _local_real(router, flat, num_real: int) -> int:
    """How many of this rank's rows are real when the first `num_real` rows of the whole row
    are: under sequence parallelism (TP > 1) each tensor-parallel rank routes its contiguous
    shard of the row, and padding sits at the row's end ([Note: MoE under sequence
    parallelism])."""
    size = flat.shape[0]
    start = router.tp_cp_group.rank() * size
    return max(0, min(size, num_real - start))


def _prefix_routing(router, flat, probs, routing_map, context: PrefixForwardContext):
    """Phase A's statistics and expert-bias counts; the routed `probs` (with, in Phase C's
    re-run under full recompute, the statistics' gradient injected through them)."""
    real = flat.shape[0] * router.tp_cp_group.size() - context.padding  # the whole prefix unit
    local = _local_real(router, flat, real)
    if context.inject or context.replay:  # [Note: prefix router stats under full recompute]
        if _counting(router):  # with grad: Megatron's checkpoint re-runs, or the rebind re-run
            stats = _prefix_stats(router, flat[:local], real)
            if context.inject:
                probs = context.cache.inject_router_grads(
                    context.group, router.layer_number, probs, stats, chunk=context.chunk)
            else:
                context.cache.rebind_router_stats(context.group, router.layer_number, stats,
                                                  chunk=context.chunk)
    elif not context.recomputing:  # Phase A (Phase C recomputes nothing else: core_attn only)
        if _counting(router, without_grad=context.full_recompute):
            context.cache.store_router_stats(context.group, router.layer_number,
                                             _prefix_stats(router, flat[:local], real),
                                             chunk=context.chunk)
        if router.enable_expert_bias and (context.full_recompute or torch.is_grad_enabled()):
            with torch.no_grad():  # dense routes each prefix token `multiplicity` times
                router.local_tokens_per_expert += (context.multiplicity
                                                   * routing_map[:local].sum(0))
    if context.stop_in_router and context.stop_after_layer == router.layer_number:
        raise PrefixForwardDone()  # Phase A, or the rebind re-run (inject never stops)
    return probs


def _prefix_stats(router, logits, num_tokens: int) -> RouterStats:
    """Phase A's sums over this rank's real prefix tokens (`num_tokens`: the whole prefix's);
    only those a statistic reads carry a graph (the others are zeros, so Phase C runs no
    backward through them)."""
    num_experts = router.config.num_moe_experts
    counts = probs = logits.new_zeros(num_experts)
    if router.is_aux_loss_enabled():
        map_aux, scores = compute_routing_scores_for_aux_loss(
            logits, router.topk, router.score_function, fused=router.config.moe_router_fusion)
        counts, probs = map_aux.sum(0), scores.sum(0)
    lse2 = (torch.logsumexp(logits, dim=-1).square().sum()
            if router.config.moe_z_loss_coeff is not None else logits.new_zeros(()))
    return RouterStats(counts=counts, probs_graph=probs, lse2_graph=lse2, num_tokens=num_tokens)


class _Row:
    """A suffix row's sequences with their prefixes' statistics at one layer: `lengths` are
    this rank's tokens of each sequence, `num_tokens` the logical tokens of the whole row and
    `local_tokens` a tensor-parallel rank's equal share of them ([Note: MoE under sequence
    parallelism])."""

    def __init__(self, router, flat, context):
        cu = context.meta.cu_seqlens
        groups = list(context.sequence_groups)
        if context.num_padding:  # the row's padding sequence counts nowhere
            assert groups[-1] is None and cu[-1] - cu[-2] == context.num_padding
            cu, groups = cu[:-1], groups[:-1]
        start = router.tp_cp_group.rank() * flat.shape[0]
        local = [min(max(c - start, 0), flat.shape[0]) for c in cu]
        self.lengths, self.groups = [b - a for a, b in zip(local, local[1:])], groups
        self.logits = flat[:local[-1]]
        self.prefix = {g: context.cache.read_router_stats(g, router.layer_number)
                       for g in dict.fromkeys(g for g in groups if g is not None)}
        self.multiplicity: Dict[int, int] = collections.Counter(g for g in groups if g is not None)
        self.num_tokens = cu[-1] - cu[0] + sum(n * self.prefix[g].num_tokens
                                               for g, n in self.multiplicity.items())
        self.local_tokens = self.num_tokens / router.tp_cp_group.size()

    def prefix_sum(self, field: str):
        return sum(n * getattr(self.prefix[g], field) for g, n in self.multiplicity.items())


def _suffix_routing(router, flat, probs, routing_map, context):
    row = _Row(router, flat, context) if _counting(router) else None
    if row is not None:
        if router.config.moe_z_loss_coeff is not None:
            probs = _z_loss(router, probs, row)
        if router.is_aux_loss_enabled():
            map_aux, scores = compute_routing_scores_for_aux_loss(
                row.logits, router.topk, router.score_function,
                fused=router.config.moe_router_fusion)
            probs = _aux_loss(router, probs, row, map_aux, scores)
            probs = _seq_aux_loss(router, probs, row, map_aux, scores)
            probs = _global_aux_loss(router, probs, row, map_aux, scores)
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            valid = _local_real(router, flat, context.meta.total_len - context.num_padding)
            router.local_tokens_per_expert += routing_map[:valid].sum(0)
    return probs


def _per_token(router, loss, local_tokens):
    """Megatron's scaling of an aux term under calculate_per_token_loss (router.py)."""
    if router.calculate_per_token_loss:
        return loss * local_tokens * router.tp_cp_group.size()
    return loss


def _z_loss(router, probs, row: _Row):
    coeff = router.config.moe_z_loss_coeff / router.tp_cp_group.size()
    lse2 = torch.logsumexp(row.logits, dim=-1).square().sum() + row.prefix_sum("lse2")
    z_loss = lse2 / row.local_tokens * coeff
    # stock attaches to the logits; the probabilities carry it back to them alike
    probs = MoEAuxLossAutoScaler.apply(probs, _per_token(router, z_loss, row.local_tokens))
    get_moe_metrics_tracker().record("z_loss", z_loss / coeff, router.layer_number,
                                     router.config.num_layers, avg_group=router.tp_dp_cp_group)
    return probs


def _aux_loss(router, probs, row: _Row, map_aux, scores):
    coeff = router.get_aux_loss_coeff("aux_loss")
    if coeff == 0:
        return probs
    counts = map_aux.sum(0).float() + row.prefix_sum("counts")
    counts = reduce_from_tensor_model_parallel_region(counts, router.tp_cp_group)
    prob_sums = scores.sum(0) + row.prefix_sum("probs")
    aux = switch_load_balancing_loss_func(
        probs=prob_sums[None], tokens_per_expert=counts, total_num_tokens=counts.sum() / router.topk,
        topk=router.topk, num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff)
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, aux, "load_balancing_loss", router.tp_cp_group,
        valid_token_count=row.local_tokens)


def _seq_aux_loss(router, probs, row: _Row, map_aux, scores):
    """Dense packing: one trajectory per row of the microbatch (bsz = trajectories), so
    Megatron's per-sequence loss is per trajectory, prefix included."""
    coeff = router.get_aux_loss_coeff("seq_aux_loss")
    if coeff == 0:
        return probs
    prob_rows, count_rows, start = [], [], 0
    for length, group in zip(row.lengths, row.groups):
        p = scores[start:start + length].sum(0)
        c = map_aux[start:start + length].sum(0).float()
        if group is not None:
            p, c = p + row.prefix[group].probs, c + row.prefix[group].counts
        prob_rows.append(p)
        count_rows.append(c)
        start += length
    bsz = len(prob_rows)
    counts = reduce_from_tensor_model_parallel_region(torch.cat(count_rows), router.tp_cp_group)
    aux = switch_load_balancing_loss_func(
        probs=torch.cat(prob_rows)[None], tokens_per_expert=counts,
        total_num_tokens=counts.sum() / (router.topk * bsz), topk=router.topk,
        num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff) / bsz
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, aux, "seq_load_balancing_loss", router.tp_cp_group,
        valid_token_count=row.local_tokens)


def _global_aux_loss(router, probs, row: _Row, map_aux, scores):
    coeff = router.get_aux_loss_coeff("global_aux_loss")
    if coeff == 0:
        return probs
    counts = map_aux.sum(0).float() + row.prefix_sum("counts")
    counts = reduce_from_tensor_model_parallel_region(counts, router.tp_dp_cp_group)
    router.global_tokens_per_expert += counts
    router.ga_steps += 1
    prob_sums = scores.sum(0) + row.prefix_sum("probs")
    aux = switch_load_balancing_loss_func(
        probs=prob_sums[None], tokens_per_expert=router.global_tokens_per_expert / router.ga_steps,
        total_num_tokens=counts.sum() / router.topk, topk=router.topk,
        num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coeff)
    return router.attach_and_log_load_balancing_loss(
        probs, coeff, aux, "global_load_balancing_loss", router.tp_dp_cp_group,
        needs_dp_avg=False, valid_token_count=row.local_tokens)


def check_moe_supported(config) -> None:
    """ValueErrors, before any compute, for MoE settings whose reuse step would not equal dense
    and that need the process groups to tell (the fields alone: config_support_moe.py)."""
    if not config.num_moe_experts:
        return
    from megatron.core import parallel_state

    types = config.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    if "global_aux_loss" in types and parallel_state.get_data_parallel_world_size() > 1:
        raise ValueError("global_aux_loss all-reduces expert counts over the data-parallel ranks "
                         "once per microbatch, but reuse plans give data-parallel ranks different "
                         "numbers of microbatches; use aux_loss or seq_aux_loss with DP > 1")
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError("MoE with tensor_model_parallel_size > 1 needs sequence_parallel=True "
                         "(as Megatron-LM requires): every TP rank then routes its own shard "
                         "of a row ([Note: MoE under sequence parallelism])")
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if etp != config.tensor_model_parallel_size:
        raise ValueError(f"expert_tensor_parallel_size={etp} with tensor_model_parallel_size="
                         f"{config.tensor_model_parallel_size}: prefix reuse is verified with "
                         "expert TP equal to TP (Megatron's default); set them equal")
    if (getattr(config, "expert_gtp_weight_remat_size", 1) or 1) > 1:
        raise ValueError(f"expert_tensor_parallel_num_weight_shards="
                         f"{config.expert_tensor_parallel_num_weight_shards}: expert GTP (weight "
                         "shards beyond expert_tensor_parallel_size, whose ranks hold distinct "
                         "tokens) is not verified with prefix reuse; leave it None or equal to "
                         "expert_tensor_parallel_size")
    if config.context_parallel_size > 1:
        raise ValueError("MoE in prefix-reuse steps is verified with CP=1 (router statistics "
                         "over context-parallel rows are not yet accounted); set "
                         "context_parallel_size=1")
    modules = set(config.recompute_modules or ()) if config.recompute_granularity else set()
    if config.recompute_granularity == "selective" and modules - {"core_attn"}:
        raise ValueError(f"recompute_modules={sorted(modules)} with MoE: recomputing the MLP "
                         "re-runs the prefix router outside Phase A; recompute core_attn only")


def expert_parallel_schedule(step):
    """What must be equal on all expert-parallel ranks of a reuse step (`StepChecks.agree`
    compares it, [Note: agreed refusal] in agreement.py): the sequence of this rank's compute
    actions. Each MoE layer's token exchange is a collective over the expert-parallel group, so
    their forwards and backwards must pair up across ranks (as Megatron's equal microbatch counts
    make them in dense training). Token counts may differ."""
    from megatron.core import parallel_state

    from prefix_schedule.pipeline import ActionKind

    from megatron_patches.runtime.agreement import fingerprint

    compute = (ActionKind.PREFIX_FORWARD, ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD,
               ActionKind.PREFIX_BACKWARD)
    row = step.lowered.actions[parallel_state.get_pipeline_model_parallel_rank()]
    return fingerprint(" ".join(f"{a.kind.name}@{step.lowered.model_chunk_of(a)}" for a in row
                                if a.kind in compute))


def expert_parallel_schedule_mismatch(_values) -> str:
    return ("expert parallelism exchanges tokens in every MoE layer of every forward and "
            "backward, but the expert-parallel ranks' reuse plans run different sequences of "
            "prefix/suffix forwards and backwards; give every expert-parallel rank the same "
            "number of groups and microbatches in the same order (e.g. the same group shapes)")
