"""One prefix-reuse training step as data: the batch, its plan, the schedule and the cache.

A `ReuseStep` is what the user passes to Megatron's forward-backward function as
`data_iterator`. The executor walks the schedule; before each forward it calls `prepare(action)`,
and the user's `forward_step_func` takes exactly that action's inputs with `next(data_iterator)`:
the executor decides the order, the user's function never needs to know it.

Items are dicts of [1, L] tensors. Prefix items (`kind == "prefix"`) carry only `tokens` and
`position_ids`; suffix items (`kind == "suffix"`) also carry `labels`, `loss_mask`, `advantages`
and, when the batch has them, `old_logprobs` / `ref_logprobs` (see
planning.inputs.build_suffix_inputs). Rows include their padding ([Note: row padding] in
planner.py); `prefix_length` / `microbatch_length` are the padded lengths every rank uses.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from prefix_schedule.runtime.cache import PrefixKVCache
from prefix_schedule.runtime import step_contexts
from prefix_schedule.runtime.context import PrefixForwardContext, SuffixForwardContext
from prefix_schedule.runtime.cp import CPGroup, CPRow, ZigzagLayout, balance_owners
from prefix_schedule.planning.batch_checks import (batch_digest, check_batch_arrays,
                                                   check_plan_covers)
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.inputs import (build_prefix_inputs, build_prefix_loss,
                                             build_suffix_inputs, check_plan_rows)
from prefix_schedule.planning.planner import PrefixChunk, StepPlan
from prefix_schedule.pipeline.lowering import lower
from prefix_schedule.pipeline import Action, ActionKind, Schedule, build_schedule
from prefix_schedule.pipeline.support import check_count

__all__ = ["ReuseStep"]

_SPENT = ("this ReuseStep has already run a forward-backward step (its prefix cache is spent); "
          "build a new ReuseStep(batch, plan) for every step")


class ReuseStep:
    """Data, plan, schedule and prefix cache of one step (one per rank)."""

    def __init__(self, batch: GroupBatch, plan: StepPlan, *, num_stages: int = 1,
                 num_model_chunks: int = 1,
                 offload_prefix_activations: Optional[bool] = None,
                 cp_group: Optional[CPGroup] = None,
                 offload_pool_bytes: Optional[int] = None) -> None:
        """`num_stages`: the pipeline size (ranks); `num_model_chunks`: Megatron's virtual
        pipeline size V (each rank holds V model chunks: [Note: virtual stages] in ir.py);
        `cp_group`: this rank's context-parallel group (None or size 1: no CP); each row then
        runs as this rank's zigzag rows ([Note: zigzag CP layout] in runtime/cp.py)."""
        check_batch_arrays(batch)  # [Note: checks at step build] in planning/batch_checks.py
        check_plan_covers(batch, plan)
        self.batch = batch
        self.plan = plan
        self.cp = cp_group if cp_group is not None and cp_group.size > 1 else None
        if self.cp is not None and plan.row_multiple != 1:
            raise ValueError(f"context parallelism pads every sequence itself; plan the step "
                             f"with row_multiple=1 (got {plan.row_multiple}) and give the CP "
                             "group the row multiple sequence parallelism needs: "
                             "CPGroup(group, row_multiple=tp)")
        if offload_prefix_activations is None:  # what a memory-budget plan chose (plan.memory)
            chosen = getattr(plan, "memory", None)
            offload_prefix_activations = chosen is not None and chosen.options.offload
        self.offload_prefix_activations = bool(offload_prefix_activations)
        """Keep what Phase A saves for backward in (pinned) host memory until Phase C, parameters
        and the cached K/V excepted ([Note: prefix activation offload] in runtime/offload.py)."""
        if offload_pool_bytes is not None and offload_pool_bytes < 0:
            raise ValueError(f"offload_pool_bytes={offload_pool_bytes}; give bytes >= 0 or None")
        self.offload_pool_bytes = offload_pool_bytes
        """Bound of the host pool that offloaded activations take (None: unbounded): the pinned
        bytes, whatever the tensor sizes ([Note: pinned host pool] in runtime/host_pool.py);
        what does not fit stays on the device."""
        self.offloader = None
        """The step's PrefixActivationOffloader, set by the executor when offloading."""
        self.observers: list = []
        """(on_action, on_release) pairs told of every compute action (None after the last) and
        every released suffix microbatch: memory accounting (runtime/memory.watch_step)."""
        self.in_flight = lambda: ()
        """Pipeline tensors the executor holds between actions (set by the executor)."""
        self._units: Dict[int, PrefixChunk] = plan.prefix_units()
        self._trees = {w.group for w in plan.prefixes if w.nodes is not None}
        if self.cp is not None and self._trees:
            raise ValueError("context parallelism with prefix trees is not supported yet (a tree "
                             "node's chain read is not sharded over the CP group); plan these "
                             "groups with one shared prompt each, or run with CP=1")
        self._unit_loss = {u: build_prefix_loss(batch, c) for u, c in self._units.items()}
        """Loss entries of prefix-tree units ([Note: loss inside shared nodes] in tree.py)."""
        for name, value in (("num_stages", num_stages), ("num_model_chunks", num_model_chunks)):
            check_count(name, value, 1)  # before the product: blame the argument given
        self._rows: Dict[int, Tuple[int, ...]] = self._pack_rows(num_stages * num_model_chunks)
        """Step unit (the PF/PB index) -> the plan units its row runs: one, or several whole
        prefixes packed into one CP row ([Note: packed CP prefix rows] in runtime/cp.py)."""
        self._prefix_layouts: Dict[int, ZigzagLayout] = {}
        unit_of = {(c.group, c.chunk): u for u, c in self._units.items()}
        parents = ({u: (None if c.parent_chunk is None else unit_of[c.group, c.parent_chunk])
                    for u, c in self._units.items()} if self._trees else None)
        # a packed row runs as one schedule group: its first member's
        sid = {self._units[u].group: self._units[m[0]].group
               for m in self._rows.values() for u in m}
        self.schedule: Schedule = build_schedule(
            unit_parents=parents,
            num_stages=num_stages * num_model_chunks,
            microbatch_groups=[tuple(sorted({sid.get(g, g) for g in groups}))
                               for groups in plan.microbatch_groups()],
            prefix_groups=sorted({sid[work.group] for work in plan.prefixes}),
            prefix_units={u: (sid[self._units[m[0]].group], self._units[m[0]].chunk)
                          for u, m in self._rows.items()},
            num_model_chunks=num_model_chunks,
        )
        self.lowered: Schedule = lower(self.schedule)
        """The schedule with p2p actions and grouped exchanges: what each pipeline rank runs."""
        self.caches = tuple(PrefixKVCache() for _ in range(num_model_chunks))
        """One prefix cache per model chunk: a chunk's Phase C runs exactly its own layers."""
        for group in self._trees:  # [Note: prefix trees] in planning/tree.py
            tree = {c.chunk: c.parent_chunk for c in self._units.values() if c.group == group}
            for cache in self.caches:
                cache.set_tree(group, tree)
        self.cache = self.caches[0]
        self._pending: Optional[Dict[str, torch.Tensor]] = None
        self._suffix_contexts: Dict[tuple, SuffixForwardContext] = {}
        self._mb_layouts: Dict[int, ZigzagLayout] = {}
        self._chains: Dict[tuple, tuple] = {}
        self._started = False

    def _pack_rows(self, num_stages: int) -> Dict[int, Tuple[int, ...]]:
        """[Note: packed CP prefix rows]: under CP without pipelining, every whole (unchunked)
        prefix goes into one Phase A row; other units stay one row each."""
        units = self._units
        whole = [u for u, c in units.items()
                 if c.chunk == 0 and sum(1 for d in units.values() if d.group == c.group) == 1
                 and self._unit_loss.get(u) is None]
        if self.cp is None or num_stages > 1 or self._trees or len(whole) < 2:
            return {u: (u,) for u in sorted(units)}
        firsts = sorted([whole[0]] + [u for u in units if u not in whole])
        return {i: (tuple(whole) if u == whole[0] else (u,)) for i, u in enumerate(firsts)}

    @classmethod
    def from_trajectories(cls, trajectories, *, dims, max_seq_len: int, num_stages: int = 1,
                          num_model_chunks: int = 1, **options) -> "ReuseStep":
        """Flat trajectories -> shared prefixes found, reuse decided and planned
        (planning.auto.plan_trajectories with `options`) -> the step; `step.report` holds the
        TrajectoryPlan (its describe() says what was shared and the expected speedup)."""
        from prefix_schedule.planning.auto import plan_trajectories

        report = plan_trajectories(trajectories, dims=dims, max_seq_len=max_seq_len, **options)
        step = cls(report.batch, report.plan, num_stages=num_stages,
                   num_model_chunks=num_model_chunks)
        step.report = report
        return step

    def check(self) -> None:
        """ValueError, before any compute, for what would otherwise fail mid-step on this rank
        only (the executor agrees on it with every rank: [Note: agreed refusal] in
        megatron_patches/runtime/agreement.py): a spent step, a plan whose rows do not belong to the
        batch, a CP layout that cannot be built."""
        if self._started:
            raise ValueError(_SPENT)
        check_plan_rows(self.batch, self.plan)
        if self.cp is not None:
            for unit in self._rows:
                self.prefix_layout(unit)
            for microbatch in range(self.num_microbatches):
                self.microbatch_layout(microbatch)

    def signature(self) -> str:
        """What the ranks that run this step together (its TP, PP and CP ranks) must share: the
        plan's rows and units and the schedule's shape (every p2p and collective follows from
        them), and a digest of its data (same-shaped but different token ids would pair up and
        train on: batch_checks.batch_digest). Host work linear in the number of tokens."""
        return repr((batch_digest(self.batch), self.lowered.num_ranks, len(self.caches),
                     None if self.cp is None else (self.cp.size, self.cp.row_multiple),
                     tuple(self.plan.microbatches), sorted(self._units.items()),
                     sorted(self._rows.items())))

    def begin(self) -> None:
        """Called by the reuse executor once its checks passed, before any compute: a step (its
        prefix cache, its contexts) serves one forward-backward call."""
        if self._started:
            raise ValueError(_SPENT)
        self._started = True

    @property
    def num_microbatches(self) -> int:
        """Suffix microbatches in the step (what Megatron calls num_microbatches)."""
        return len(self.plan.microbatches)

    @property
    def num_prefix_units(self) -> int:
        """Prefix units of the schedule (PF/PB indices 0..n-1): one per row."""
        return len(self._rows)

    def prefix_members(self, unit: int) -> Tuple[PrefixChunk, ...]:
        """The plan units (group prefixes or their chunks) that step unit `unit`'s row runs:
        one, or several packed whole prefixes ([Note: packed CP prefix rows])."""
        return tuple(self._units[u] for u in self._rows[unit])

    def prefix_unit(self, unit: int) -> PrefixChunk:
        """The chunk that prefix unit `unit` (a PF/PB index of the schedule) runs (of a packed
        row: its first member)."""
        return self._units[self._rows[unit][0]]

    def prefix_has_loss(self, unit: int) -> bool:
        """Whether prefix unit `unit` predicts loss tokens (a trained-on token inside a shared
        tree node): its last-stage forward then runs to the loss, and Phase C starts there."""
        return self._unit_loss.get(self._rows[unit][0]) is not None

    def prefix_length(self, unit: int) -> int:
        """Length of prefix unit `unit`'s row (the whole cached prefix unchunked), padding
        included: a multiple of `plan.row_multiple`. Under sequence parallelism a stage's
        hidden states are this / TP long."""
        if self.cp is not None:
            return self.prefix_layout(unit).local_len
        return self.prefix_unit(unit).row_length

    def microbatch_length(self, microbatch: int) -> int:
        """Length of suffix microbatch `microbatch`'s packed row, padding included: a multiple of
        `plan.row_multiple`. Under sequence parallelism a stage's hidden states are this / TP
        long."""
        if self.cp is not None:
            return self.microbatch_layout(microbatch).local_len
        return self.plan.microbatches[microbatch].row_length

    def prefix_layout(self, unit: int) -> ZigzagLayout:
        """CP layout of prefix unit `unit`'s row (CP steps only): one sequence, or a packed
        row's prefixes, whole on one rank each where that balances ([Note: packed CP prefix
        rows])."""
        if unit not in self._prefix_layouts:
            lengths = [c.length for c in self.prefix_members(unit)]
            owners = (balance_owners(lengths, [0] * len(lengths), self.cp.size)
                      if len(lengths) > 1 else ())
            self._prefix_layouts[unit] = self.cp.layout(lengths, owners)
        return self._prefix_layouts[unit]

    def microbatch_layout(self, microbatch: int) -> ZigzagLayout:
        """CP layout of suffix microbatch `microbatch`'s row: its packed sequences, whole on
        one rank each where that balances ([Note: whole suffixes per CP rank] in cp.py)."""
        if microbatch not in self._mb_layouts:
            segments = self.plan.microbatches[microbatch].segments
            lengths = [s.length for s in segments]
            owners = balance_owners(lengths, [s.cached_len for s in segments], self.cp.size)
            self._mb_layouts[microbatch] = self.cp.layout(lengths, owners)
        return self._mb_layouts[microbatch]

    def _cp_row(self, layout: ZigzagLayout, offsets) -> CPRow:
        return CPRow(group=self.cp, layout=layout, position_ids=layout.positions(offsets),
                     max_position=max(o + n - 1 for o, n in zip(offsets, layout.lengths)))

    def _shard(self, item: Dict[str, torch.Tensor], layout: ZigzagLayout,
               offsets) -> Dict[str, torch.Tensor]:
        """This rank's zigzag rows of a [1, L] item; padding: 0 everywhere (no loss), positions
        as ZigzagLayout.positions gives them."""
        out = {name: layout.shard(value[0]).unsqueeze(0) for name, value in item.items()
               if name != "position_ids"}
        out["position_ids"] = layout.positions(offsets).unsqueeze(0)
        return out

    @property
    def num_loss_tokens(self) -> int:
        """Loss tokens of the whole step on this rank."""
        return int(self.batch.num_loss_tokens)

    # ---- the data-iterator protocol
    def prepare(self, action: Action) -> None:
        """Make `action`'s inputs the next item (called by the executor before a forward; before
        a prefix backward too when Phase C re-runs the prefix forward under full recompute)."""
        assert self._pending is None, f"{action}: the previous forward was not finished"
        if action.kind in (ActionKind.PREFIX_FORWARD, ActionKind.PREFIX_BACKWARD):
            members = self.prefix_members(action.index)
            items = [build_prefix_inputs(self.batch, c) for c in members]
            item = {k: torch.cat([i[k] for i in items], dim=1) for k in items[0]}
            item.update(self._unit_loss.get(self._rows[action.index][0]) or {})
            if self.cp is not None:
                item = self._shard(item, self.prefix_layout(action.index),
                                   [c.start for c in members])
            item["kind"] = "prefix"
        elif action.kind is ActionKind.SUFFIX_FORWARD:
            mb = self.plan.microbatches[action.index]
            item = build_suffix_inputs(self.batch, mb)
            if self.cp is not None:
                item = self._shard(item, self.microbatch_layout(action.index),
                                   [s.cached_len for s in mb.segments])
            item["kind"] = "suffix"
        else:
            raise AssertionError(f"{action} has no inputs")
        self._pending = item

    def taken(self) -> bool:
        """True once the prepared item was consumed by `next()`."""
        return self._pending is None

    def finish_forward(self) -> None:
        """Drop the prepared item if this rank's forward_step_func did not read it.

        Megatron's own `get_batch` reads the iterator on tensor-parallel rank 0 only and
        broadcasts the batch; the other ranks never call `next()`, and that is fine: the hooks
        take positions and cache slots from the reuse context, not from the item.
        """
        self._pending = None

    def __iter__(self) -> "ReuseStep":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        if not self._started:
            raise ValueError(
                "a ReuseStep was read by a schedule other than prefix reuse (Megatron's stock "
                "schedule?): call megatron_patches.install() once, then select the schedule with "
                "`with megatron_patches.use_prefix_reuse_schedule(): forward_backward = "
                "get_forward_backward_func()` and pass the ReuseStep to that function")
        if self._pending is None:
            raise RuntimeError(
                "forward_step_func called next(data_iterator) twice in one forward; with prefix "
                "reuse each forward takes exactly one item"
            )
        item, self._pending = self._pending, None
        return item

    # ---- contexts for the hooks (built in runtime/step_contexts.py)
    def prefix_context(self, unit: int, *, stop_after_layer: Optional[int],
                       recomputing: bool = False, replay: bool = False,
                       inject: bool = False, model_chunk: int = 0,
                       stop_in_router: bool = False,
                       full_recompute: bool = False) -> PrefixForwardContext:
        """Context of prefix unit `unit`'s forward (or of its recompute in Phase C) on model
        chunk `model_chunk` of this rank."""
        return step_contexts.prefix_context(
            self, unit, stop_after_layer=stop_after_layer, recomputing=recomputing, replay=replay,
            inject=inject, model_chunk=model_chunk, stop_in_router=stop_in_router,
            full_recompute=full_recompute)

    def suffix_context(self, microbatch: int, model_chunk: int = 0) -> SuffixForwardContext:
        """Context of suffix microbatch `microbatch` (its forward and its backward) on model
        chunk `model_chunk` of this rank."""
        key = (microbatch, model_chunk)
        if key not in self._suffix_contexts:
            self._suffix_contexts[key] = step_contexts.suffix_context(self, microbatch, model_chunk)
        return self._suffix_contexts[key]

    def prefix_multiplicity(self, group: int) -> int:
        """Trajectories of the step that read `group`'s cached prefix: dense training routes
        each of its tokens that many times ([Note: logical prefix tokens])."""
        return sum(1 for mb in self.plan.microbatches for s in mb.segments
                   if s.group == group and s.cached_len > 0)

    def release_microbatch(self, microbatch: int) -> None:
        """Forget microbatch `microbatch`'s contexts once its last backward here is done."""
        for key in [k for k in self._suffix_contexts if k[0] == microbatch]:
            del self._suffix_contexts[key]
        for _, on_release in self.observers:
            on_release(microbatch)

    # ---- observation (memory accounting)
    def notify(self, action: Optional[Action]) -> None:
        """The executor starts compute action `action` (None: the step's actions are done)."""
        for on_action, _ in self.observers:
            on_action(action)

    def resident_tensors(self):
        """Tensors held outside autograd besides the caches: pipeline tensors in flight and
        offloaded prefix activations brought back for Phase C."""
        yield from self.in_flight()
        if self.offloader is not None:
            yield from self.offloader.resident_tensors()
