"""Pack the suffixes of a GroupBatch into microbatches under a token budget -> StepPlan.

Each trajectory becomes one segment of a packed row, split as DESIGN.md
"[Note: the split of a trajectory]" says: with the cache, the row is
`[prefix[-1], suffix[0..n-2]]` at positions P-1..P+n-2 (length n, cached_len P-1) and the group's
first P-1 tokens run once as a `PrefixWork`; run dense, the row is the whole
`(prefix+suffix)[:-1]` at positions 0..P+n-2 (cached_len 0). Both are the last `length` entries of
the dense row, which is how the tensor builders produce them.

Packing is greedy and order-preserving: groups in order, trajectories in order; a segment joins the
current microbatch if it still fits the budget, else a new microbatch starts. So a group may span
many microbatches, a microbatch may hold several groups, and a group's segments inside one
microbatch are contiguous.

With `prefix_chunk_tokens`, each group's cached tokens run as chunks of at most that many tokens,
each its own prefix unit (PF/PB action): see [Note: prefix chunks] in units.py and
`StepPlan.prefix_units`. The suffix rows do not change.

[Note: row padding]
With `row_multiple=m` (TP under sequence parallelism: Megatron scatters every row along the
sequence over the TP ranks) every row is padded at its end to a multiple of m, exactly:
- a suffix microbatch gets `padding` tokens after its last segment, a sequence of its own (no
  cached prefix): no real token attends to it and it carries no loss, so its gradient is exactly
  zero and every real token computes as unpadded;
- a prefix unit (the P-1 cached tokens, or a chunk) gets `padding` tokens after its real ones:
  causal attention means no real token attends to them; the cache keeps only the real tokens'
  K/V (the attention hook slices them off), so no suffix or later chunk ever reads padding and
  Phase C's gradient reaches padding rows as exact zeros.
Padding tokens are token 0, label 0, loss mask / advantages / log-probs 0, position ids
0..padding-1 (valid for any position table; the RoPE angles come from the reuse context: a pad
sequence at positions 0.., prefix padding continuing after the real tokens -- inert either way).
The token budget bounds the padded row (`row_length`); FLOP estimates count padding as work.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from prefix_schedule.planning.batch_checks import validate_batch
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.budget import check_budget, check_dense_groups
from prefix_schedule.planning.plan_units import PrefixChunk, node_chunks, padding as _padding
from prefix_schedule.planning.tree import NodeSpan, cached_spans, is_tree

__all__ = [
    "Segment",
    "SuffixMicrobatch",
    "PrefixWork",
    "PrefixChunk",
    "StepPlan",
    "plan_microbatches",
]


def _check_int(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}; it must be an int >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class Segment:
    """One sequence (one trajectory) of a packed suffix row."""

    group: int
    """Index of the group in the batch."""
    trajectory: int
    """Index of the trajectory in its group."""
    row_start: int
    """Offset of the segment's first token in the packed row."""
    length: int
    """Tokens of the segment in the row: n with the cache, P+n-1 when run dense."""
    cached_len: int
    """Tokens of the group held in the prefix cache (P-1), or 0 (run dense, or P == 1).
    The row tokens sit at positions cached_len .. cached_len+length-1."""
    node: int = 0
    """The prefix-tree node the trajectory follows; it reads that node's chain
    ([Note: prefix trees] in tree.py)."""

    def __post_init__(self) -> None:
        for name, minimum in (("group", 0), ("trajectory", 0), ("row_start", 0), ("length", 1),
                              ("cached_len", 0), ("node", 0)):
            _check_int(getattr(self, name), f"Segment.{name}", minimum)


@dataclass(frozen=True, kw_only=True)
class SuffixMicrobatch:
    """One packed row of segments (one Megatron microbatch)."""

    index: int
    """Position of the microbatch in the step."""
    segments: tuple[Segment, ...]
    """The segments, in row order."""

    padding: int = 0
    """Padding tokens after the last segment ([Note: row padding]); the row is `row_length` long."""

    def __post_init__(self) -> None:
        _check_int(self.index, "SuffixMicrobatch.index", 0)
        _check_int(self.padding, "SuffixMicrobatch.padding", 0)
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments:
            raise ValueError(f"microbatch {self.index} has no segments; drop it")
        start = 0
        for segment in self.segments:
            if segment.row_start != start:
                raise ValueError(f"microbatch {self.index}: segment (group {segment.group}, trajectory "
                                 f"{segment.trajectory}) starts at {segment.row_start}, expected {start}; "
                                 "segments must tile the row without gaps")
            start += segment.length

    @property
    def num_tokens(self) -> int:
        """Real tokens of the row (its segments; padding excluded)."""
        return sum(segment.length for segment in self.segments)

    @property
    def row_length(self) -> int:
        """Length of the row as it runs: real tokens + padding."""
        return self.num_tokens + self.padding

    @property
    def groups(self) -> tuple[int, ...]:
        """Groups that read the prefix cache here (cached_len > 0), in row order."""
        return tuple(dict.fromkeys(s.group for s in self.segments if s.cached_len > 0))


@dataclass(frozen=True, kw_only=True)
class PrefixWork:
    """The cached part of one group's prompt: its first P-1 tokens, run once."""

    group: int
    """Index of the group in the batch."""
    length: int
    """Cached tokens (P-1 > 0; a tree: all its nodes' cached tokens)."""
    nodes: Optional[tuple] = None
    """A prefix tree's cached nodes (tree.NodeSpan, parents first); None: one node, the prompt."""

    def __post_init__(self) -> None:
        _check_int(self.group, "PrefixWork.group", 0)
        _check_int(self.length, "PrefixWork.length", 1)
        if self.nodes is not None:
            object.__setattr__(self, "nodes", tuple(self.nodes))
            if sum(n.length for n in self.nodes) != self.length or self.nodes[0].parent is not None:
                raise ValueError(f"group {self.group}: tree nodes {self.nodes} do not start at the "
                                 f"root or do not add up to length {self.length}")

    def spans(self) -> tuple:
        """The cached nodes (one NodeSpan for a one-level prefix)."""
        return self.nodes or (NodeSpan(node=0, parent=None, start=0, length=self.length),)


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What one optimizer step runs: cached prefixes and packed suffix microbatches."""

    microbatches: tuple[SuffixMicrobatch, ...]
    """Suffix microbatches in run order; microbatch i has index i."""
    prefixes: tuple[PrefixWork, ...]
    """One entry per group that uses the cache, in group order."""
    token_budget: int
    """Maximum tokens of one microbatch row (padding included)."""
    prefix_chunk_tokens: Optional[int] = None
    """Run each cached prefix as chunks of at most this many tokens (one PF/PB each); None: one
    chunk per group. See `prefix_units`."""
    row_multiple: int = 1
    """Every row (suffix microbatch, prefix unit) is padded to a multiple of this
    ([Note: row padding]); the TP size under sequence parallelism, else 1."""
    memory: Optional[object] = None
    """With a memory budget: the memory_plan.MemoryChoice (offload, recompute, predicted peaks)
    the step must run with; None: planned without one."""
    state_reads: bool = False
    """For models with recurrent layers (Gated DeltaNet, Mamba-2), whose prefix state exists only
    at a prefix unit's end: a tree node that a reader stops inside (a trajectory following a
    node with children reads its chain minus the node's last token, [Note: prefix trees]) is
    cut into units there. False: units as prefix_chunk_tokens alone makes them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "microbatches", tuple(self.microbatches))
        object.__setattr__(self, "prefixes", tuple(self.prefixes))
        _check_int(self.token_budget, "StepPlan.token_budget", 1)
        _check_int(self.row_multiple, "row_multiple", 1)
        if self.prefix_chunk_tokens is not None:
            _check_int(self.prefix_chunk_tokens, "prefix_chunk_tokens", 1)
        for i, mb in enumerate(self.microbatches):
            if mb.index != i:
                raise ValueError(f"microbatch at position {i} has index {mb.index}; number them 0, 1, ...")
            if mb.padding != _padding(mb.num_tokens, self.row_multiple):
                raise ValueError(f"microbatch {i} has {mb.num_tokens} tokens and padding "
                                 f"{mb.padding}; with row_multiple={self.row_multiple} its padding "
                                 f"must be {_padding(mb.num_tokens, self.row_multiple)}")
            if mb.row_length > self.token_budget:
                raise ValueError(f"microbatch {i} holds {mb.row_length} tokens (padding included), "
                                 f"over the token budget {self.token_budget}; split it or raise the "
                                 "budget")
        self._check_prefixes()

    def _check_prefixes(self) -> None:
        cached = {}
        trees = {w.group for w in self.prefixes if w.nodes is not None}  # lengths vary per node
        for mb in self.microbatches:
            for s in mb.segments:
                if s.cached_len > 0 and s.group in trees:
                    cached[s.group] = None
                elif s.cached_len > 0 and cached.setdefault(s.group, s.cached_len) != s.cached_len:
                    raise ValueError(f"group {s.group}: segments disagree on cached_len "
                                     f"({cached[s.group]} and {s.cached_len}); use P-1 for all")
        listed = {work.group: work.length for work in self.prefixes}
        cached = {g: (listed[g] if g in trees else n) for g, n in cached.items()}
        if len(listed) != len(self.prefixes) or listed != cached:
            raise ValueError(f"prefixes {listed} do not match the cached groups of the segments "
                             f"{cached}; give exactly one PrefixWork(group, length=cached_len) per "
                             "group that reads the cache")

    def prefix_units(self) -> dict[int, PrefixChunk]:
        """Prefix unit id (the PF/PB index of the schedule) -> its chunk.

        Without chunking a group's one unit has the group's id, so schedules read as before;
        with `prefix_chunk_tokens` units are numbered 0, 1, ... in (group, chunk) order."""
        m = self.row_multiple
        if self.prefix_chunk_tokens is None and all(w.nodes is None for w in self.prefixes):
            return {w.group: PrefixChunk(group=w.group, chunk=0, start=0, length=w.length,
                                         padding=_padding(w.length, m))
                    for w in self.prefixes}
        chunks = [chunk for w in self.prefixes for chunk in node_chunks(self, w)]
        return dict(enumerate(chunks))

    def chain_chunks(self, group: int, node: int) -> tuple[int, ...]:
        """Chunks of `group` that a reader after tree node `node` attends to, root first."""
        chunks = {c.chunk: c for c in self.prefix_units().values() if c.group == group}
        last = max(c.chunk for c in chunks.values() if c.node == node)
        chain = [last]
        while chunks[chain[-1]].parent_chunk is not None:
            chain.append(chunks[chain[-1]].parent_chunk)
        return tuple(reversed(chain))

    def microbatch_groups(self) -> list[tuple[int, ...]]:
        """Groups that read the prefix cache, per microbatch."""
        return [mb.groups for mb in self.microbatches]

    def _uses(self, group: int) -> list[int]:
        uses = [mb.index for mb in self.microbatches if group in mb.groups]
        if not uses:
            raise ValueError(f"group {group} reads no cached prefix in this plan (it runs dense, has a "
                             "1-token prefix, or is not in the batch); ask only about cached groups")
        return uses

    def first_use(self, group: int) -> int:
        """Index of the first microbatch that reads the group's cached prefix."""
        return self._uses(group)[0]

    def last_use(self, group: int) -> int:
        """Index of the last microbatch that reads the group's cached prefix (then Phase C may run)."""
        return self._uses(group)[-1]

    def describe(self) -> str:
        """A short human summary: prefixes (tree units), then each microbatch's segments."""
        from prefix_schedule.planning.plan_text import describe_plan

        return describe_plan(self)


def _prefix_work(batch: GroupBatch, group: int, cached_len: int) -> PrefixWork:
    if not is_tree(batch.groups[group]):
        return PrefixWork(group=group, length=cached_len)
    spans = cached_spans(batch.groups[group])
    return PrefixWork(group=group, length=sum(n.length for n in spans), nodes=spans)


def _segment_lengths(batch: GroupBatch, *, capacity: int, multiple: int,
                     run_singletons_dense: bool, dense_groups: frozenset = frozenset()):
    """Yield (group, trajectory, length, cached_len) in packing order."""
    for g, group in enumerate(batch.groups):
        singleton = len(group.trajectories) == 1
        for t, trajectory in enumerate(group.trajectories):
            p, n = group.context_len(t), trajectory.num_tokens
            full = p - 1 + n
            dense = p == 1 or g in dense_groups or (run_singletons_dense and singleton
                                                    and full + _padding(full, multiple) <= capacity)
            yield (g, t, full, 0, trajectory.node) if dense else (g, t, n, p - 1, trajectory.node)


def plan_microbatches(batch: GroupBatch, *, token_budget: int, max_seq_len: int,
                      run_singletons_dense: bool = True,
                      prefix_chunk_tokens: Optional[int] = None,
                      row_multiple: int = 1, vocab_size: Optional[int] = None,
                      dense_groups=(), memory_budget_bytes: Optional[int] = None,
                      memory_model=None, memory_options=None,
                      state_reads: bool = False) -> StepPlan:
    """Greedy, order-preserving packing of every trajectory's row; see the module docstring.
    `dense_groups`: indices of groups whose rows run whole, without the cache (as a dense
    trainer would; exact either way). prefix_schedule.planning.policy decides which, by FLOPs.
    `prefix_chunk_tokens`: see StepPlan (None: each cached prefix runs as one chunk).
    `row_multiple`: pad every row to a multiple of it ([Note: row padding]); pass the TP size
    when Megatron runs with sequence_parallel=True. The padded row fits the token budget.
    `vocab_size`: also check every token id (the executor checks both against the model).
    `memory_budget_bytes` (with `memory_model`, a memory_model.ActivationModel, and optionally
    `memory_options` to choose from): the token budget and chunking become upper bounds and the
    plan fits the budget (memory_plan.py); its `memory` says what the step must run with.
    `state_reads`: see StepPlan (pass True for a model with Gated DeltaNet or Mamba-2 layers and
    prefix trees; the executor refuses a tree plan those layers cannot read otherwise)."""
    if memory_budget_bytes is not None:
        from prefix_schedule.planning.memory_plan import plan_within_budget

        common = dict(max_seq_len=max_seq_len, run_singletons_dense=run_singletons_dense,
                      row_multiple=row_multiple, vocab_size=vocab_size, dense_groups=dense_groups,
                      state_reads=state_reads)
        plan_fn = lambda tb, chunk: plan_microbatches(  # noqa: E731
            batch, token_budget=tb, prefix_chunk_tokens=chunk, **common)
        plan_fn(token_budget, prefix_chunk_tokens)  # bad input: its own error first
        return plan_within_budget(batch, plan_fn=plan_fn, token_budget=token_budget,
                                  memory_budget_bytes=memory_budget_bytes,
                                  memory_model=memory_model, prefix_chunk_tokens=prefix_chunk_tokens,
                                  row_multiple=row_multiple, memory_options=memory_options)
    _check_int(token_budget, "token_budget", 1)
    _check_int(row_multiple, "row_multiple", 1)
    if prefix_chunk_tokens is not None:
        _check_int(prefix_chunk_tokens, "prefix_chunk_tokens", 1)
    validate_batch(batch, max_seq_len=max_seq_len, vocab_size=vocab_size)
    check_budget(batch, token_budget, row_multiple)
    capacity = token_budget - token_budget % row_multiple  # the longest row that pads within budget
    dense = check_dense_groups(batch, dense_groups, capacity, row_multiple)
    rows: list[list[Segment]] = []
    used = capacity  # forces a new microbatch for the first segment
    for g, t, length, cached_len, node in _segment_lengths(batch, capacity=capacity,
                                                     multiple=row_multiple,
                                                     run_singletons_dense=run_singletons_dense,
                                                     dense_groups=dense):
        if used + length > capacity:
            rows.append([])
            used = 0
        rows[-1].append(Segment(group=g, trajectory=t, row_start=used, length=length,
                                cached_len=cached_len, node=node))
        used += length
    microbatches = tuple(
        SuffixMicrobatch(index=i, segments=tuple(r),
                         padding=_padding(sum(s.length for s in r), row_multiple))
        for i, r in enumerate(rows))
    prefixes = {}
    for mb in microbatches:
        for s in mb.segments:
            if s.cached_len > 0 and s.group not in prefixes:
                prefixes[s.group] = _prefix_work(batch, s.group, s.cached_len)
    return StepPlan(microbatches=microbatches, prefixes=tuple(prefixes.values()), token_budget=token_budget,
                    prefix_chunk_tokens=prefix_chunk_tokens, row_multiple=row_multiple,
                    state_reads=bool(state_reads))

