"""When prefix reuse pays, and how to pack it: a planner policy driven by the FLOP model.

Reuse saves the (G-1) repeated prompt computations of a group but adds work a FLOP count does
not see: a prefix pass of its own (a pipeline job, a kernel launch per layer), the two-part
attention merge, the cache's K/V copies and fp32 gK/gV. When the prompt is a small share of a
group's tokens or the group is small, the saving is about that overhead and reuse is no faster
than dense (prefix 256 / suffix 1280 / G=2, ideal 1.09x: 1.06x in CPU time but 0.72x in wall
time under load, docs/BENCHMARKS.md "Sweep"). And packing a
whole group's suffixes into one long row (G x n tokens) runs slower per token than rows of a few
thousand tokens (measured on CPU: prefix 256 / suffix 1280 / G=16 at 0.90-1.01x dense, ideal
1.13x, with one 20,480-token row; 1.18x with rows of <= 6,140).

`plan_with_policy` therefore decides per group and says why (`PolicyPlan.describe()`):
- a group whose FLOP gain dense / reuse (flops.py, the group alone) is below `min_gain` runs
  dense: its trajectories' whole rows go into the microbatches, no cache (exact either way:
  DESIGN.md "[Note: the split of a trajectory]"); a group of one is judged the same way (it
  uses the cache when that pays, e.g. a long prompt);
- the suffix microbatches hold at most `token_budget` tokens, by default four times the longest
  dense row of the batch: large enough that a big group's short suffixes share microbatches
  (one dense row's worth ran G=16 groups up to 22% slower), small enough that a microbatch's
  memory does not grow with G (a whole group's suffixes in one row did).
Both choices only change which rows run where; gradients are those of stock dense training
(tests/test_policy.py checks it against Megatron like any plan).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from prefix_schedule.planning.batch_checks import validate_batch
from prefix_schedule.planning.data import Group, GroupBatch
from prefix_schedule.planning.flops import ModelDims, dense_flops, reuse_flops
from prefix_schedule.planning.planner import StepPlan, plan_microbatches
from prefix_schedule.planning.tree import cached_spans

__all__ = ["ReusePolicy", "GroupDecision", "PolicyPlan", "group_gain", "plan_with_policy",
           "DENSE_ROWS_PER_MICROBATCH", "DEFAULT_MIN_GAIN"]

DENSE_ROWS_PER_MICROBATCH = 4
"""Default suffix microbatch size, in dense rows. Measured on CPU (docs/BENCHMARKS.md "Sweep"):
a cap of one dense row ran G=16 groups slower (768/768: 1.41x vs 1.80x at 4 rows' worth, 1.82x
at 8,192 tokens), one row per whole group (20,480 tokens at 256/1280, G=16) slower still (0.96x
vs 1.18x at 4 rows' worth)."""

DEFAULT_MIN_GAIN = 1.10
"""Below this FLOP gain a group runs dense: a margin for the overhead the FLOP model does not
count. On this machine's sweep (docs/sweep) the smallest gain, 1.09 (prefix 256 / suffix 1280 /
G=2), was break-even with reuse; every point at >= 1.11 ran faster than dense."""


@dataclass(frozen=True, kw_only=True)
class ReusePolicy:
    """How plan_with_policy decides."""

    dims: ModelDims
    """The model's shape (the FLOP model's input)."""
    min_gain: float = DEFAULT_MIN_GAIN
    """A group runs dense when dense_flops / reuse_flops of the group alone is below this
    (1.0: reuse whenever it saves FLOPs at all)."""
    token_budget: Optional[int] = None
    """Tokens per suffix microbatch; None = `DENSE_ROWS_PER_MICROBATCH` x the longest dense row
    (P + n - 1) of the batch."""

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ModelDims):
            raise ValueError(f"ReusePolicy.dims={self.dims!r}; give a flops.ModelDims")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) \
                or not 0 < self.min_gain < 100:
            raise ValueError(f"ReusePolicy.min_gain={self.min_gain!r}; give a number in (0, 100), "
                             "e.g. 1.1")
        if self.token_budget is not None and (isinstance(self.token_budget, bool) or not isinstance(
                self.token_budget, int) or self.token_budget < 1):
            raise ValueError(f"ReusePolicy.token_budget={self.token_budget!r}; give an int >= 1 or None")


@dataclass(frozen=True)
class GroupDecision:
    group: int
    reuse: bool
    gain: float
    """dense_flops / reuse_flops of the group alone (flops.py)."""
    reason: str


@dataclass(frozen=True)
class PolicyPlan:
    """A StepPlan and the decisions behind it."""

    plan: StepPlan
    decisions: tuple
    token_budget: int

    @property
    def dense_groups(self) -> tuple:
        return tuple(d.group for d in self.decisions if not d.reuse)

    def describe(self) -> str:
        lines = [f"policy: suffix microbatches of <= {self.token_budget} tokens"]
        lines += [f"  g{d.group}: {'reuse' if d.reuse else 'dense'} ({d.reason})"
                  for d in self.decisions]
        return "\n".join(lines)


def group_gain(dims: ModelDims, group: Group) -> float:
    """FLOP gain of reuse on one group: its dense rows / its prefix pass plus suffix rows."""
    contexts = [group.context_len(t) for t in range(len(group.trajectories))]
    dense = dense_flops(dims, [p - 1 + t.num_tokens for p, t in zip(contexts, group.trajectories)])
    if max(contexts) == 1:
        return 1.0
    spans = cached_spans(group)  # one span (P-1 tokens) for a one-level prompt
    segments = [SimpleNamespace(length=t.num_tokens, cached_len=p - 1)
                for p, t in zip(contexts, group.trajectories)]
    work = SimpleNamespace(length=sum(s.length for s in spans), nodes=spans)
    plan_like = SimpleNamespace(prefixes=[work], row_multiple=1,
                                microbatches=[SimpleNamespace(segments=segments, padding=0)])
    return dense / reuse_flops(dims, plan_like)


def _decide(g: int, group: Group, policy: ReusePolicy, budget: int, multiple: int) -> GroupDecision:
    gain = group_gain(policy.dims, group)
    share = f"prompt {group.prefix_len} tokens, G={len(group.trajectories)}"
    if group.nodes:
        share += f", a tree of {group.num_nodes} nodes"
    if group.prefix_len == 1 and not group.nodes:
        return GroupDecision(g, False, gain, "a 1-token prompt caches nothing")
    if gain >= policy.min_gain:
        return GroupDecision(g, True, gain, f"FLOP gain {gain:.2f} >= {policy.min_gain:.2f}; {share}")
    longest = max(group.context_len(t) - 1 + tr.num_tokens
                  for t, tr in enumerate(group.trajectories))
    if longest + (-longest % multiple) > budget:
        return GroupDecision(g, True, gain, f"FLOP gain {gain:.2f} < {policy.min_gain:.2f} but its "
                             f"{longest}-token rows exceed the budget, so it keeps the cache")
    return GroupDecision(g, False, gain, f"FLOP gain {gain:.2f} < {policy.min_gain:.2f}: reuse "
                         f"cannot pay its overhead; {share}")


def plan_with_policy(batch: GroupBatch, *, policy: ReusePolicy, max_seq_len: int,
                     row_multiple: int = 1, prefix_chunk_tokens: Optional[int] = None,
                     vocab_size: Optional[int] = None, state_reads: bool = False) -> PolicyPlan:
    """Plan `batch` as the module docstring says; ValueError on bad input (as plan_microbatches;
    `state_reads` as there: a model with Gated DeltaNet or Mamba-2 layers)."""
    validate_batch(batch, max_seq_len=max_seq_len, vocab_size=vocab_size)
    longest_dense = max(g.context_len(i) - 1 + t.num_tokens for g in batch.groups
                        for i, t in enumerate(g.trajectories))
    longest_suffix = max(t.num_tokens for g in batch.groups for t in g.trajectories)
    budget = policy.token_budget or DENSE_ROWS_PER_MICROBATCH * max(longest_dense, longest_suffix)
    budget += -budget % row_multiple
    decisions = tuple(_decide(g, group, policy, budget, row_multiple)
                      for g, group in enumerate(batch.groups))
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=max_seq_len,
                             prefix_chunk_tokens=prefix_chunk_tokens, row_multiple=row_multiple,
                             vocab_size=vocab_size, run_singletons_dense=False,
                             dense_groups=[d.group for d in decisions if not d.reuse],
                             state_reads=state_reads)
    return PolicyPlan(plan=plan, decisions=decisions, token_budget=budget)
