"""Memory-aware planning: the packing, prefix chunking, offload and recompute that fit a budget.

`plan_microbatches(batch, ..., memory_budget_bytes=B, memory_model=ActivationModel(...))`
(planner.py) calls `plan_within_budget`. Every candidate is exact against stock dense training
(packing, chunks, offload and full recompute only change where and when the same rows run:
docs/DESIGN.md "Memory"); the search only decides how much memory the step holds, predicted by
the accounting model (memory_model.py, [Note: predicted device memory]). The budget is the
device bytes that model counts (activations, cache, gK/gV; not weights, gradients, optimizer
state: tools/capacity.py adds those).

The search, cheapest compute first: memory options in the order given (default: none, offload,
full recompute -- offload costs host traffic, full recompute an extra forward of every row);
within the first option that fits anything, the largest token budget (fewest microbatches),
then the largest prefix chunk (fewest prefix passes; no chunking first). Nothing fits: a
ValueError naming the smallest budget that would (and with what), before any compute.
`StepPlan.memory` (a MemoryChoice) says what was chosen and why; `describe()` prints it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from prefix_schedule.planning.memory_model import (ActivationModel, MemoryOptions,
                                                   dense_peak_bytes, reuse_phase_peaks)

__all__ = ["DEFAULT_MEMORY_OPTIONS", "MemoryChoice", "plan_within_budget",
           "dense_rows_within_budget"]

DEFAULT_MEMORY_OPTIONS = (MemoryOptions(), MemoryOptions(offload=True),
                          MemoryOptions(recompute="full"))
MIN_CHUNK_TOKENS = 16
"""Smallest prefix chunk the search tries."""
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryChoice:
    """What plan_within_budget chose, its predicted peaks, and the options that did not fit."""

    budget_bytes: int
    options: MemoryOptions
    token_budget: int
    prefix_chunk_tokens: Optional[int]
    peaks: Dict[str, float]
    """Predicted device bytes per phase (PF, suffix, PB, step) of the chosen plan."""
    rejected: Tuple[Tuple[str, float], ...] = ()
    """(option, its smallest predicted step peak) of each cheaper option that did not fit."""

    def describe(self) -> str:
        chunks = (f"prefix chunks of <= {self.prefix_chunk_tokens} tokens"
                  if self.prefix_chunk_tokens else "whole prefixes")
        p = self.peaks
        lines = [f"memory: budget {self.budget_bytes / MIB:.2f} MiB -> {self.options.describe()}, "
                 f"suffix microbatches of <= {self.token_budget} tokens, {chunks}; predicted "
                 f"peak {p['step'] / MIB:.2f} MiB (suffix phase {p['suffix'] / MIB:.2f}, Phase "
                 f"C {p['PB'] / MIB:.2f})"]
        lines += [f"  not {name}: needs >= {peak / MIB:.2f} MiB" for name, peak in self.rejected]
        return "\n".join(lines)


def _token_budgets(start: int, smallest: int, multiple: int) -> List[int]:
    out, tb = [], start
    while tb >= smallest:
        out.append(tb)
        tb //= 2
        tb -= tb % multiple
    if not out or out[-1] != smallest:
        out.append(smallest)
    return out


def _chunk_sizes(first: Optional[int], longest_prefix: int) -> List[Optional[int]]:
    out: List[Optional[int]] = [first]
    c = -(-longest_prefix // 2) if first is None else first // 2
    while c >= MIN_CHUNK_TOKENS:
        out.append(c)
        c //= 2
    return out


def plan_within_budget(batch, *, plan_fn, token_budget: int, memory_budget_bytes: int,
                       memory_model: ActivationModel, prefix_chunk_tokens: Optional[int],
                       row_multiple: int,
                       memory_options: Optional[Sequence[MemoryOptions]] = None):
    """The StepPlan of the search in the module docstring; `plan_fn(token_budget,
    prefix_chunk_tokens)` plans the batch (plan_microbatches without a memory budget);
    `memory_options` None: DEFAULT_MEMORY_OPTIONS."""
    if not isinstance(memory_model, ActivationModel):
        raise ValueError(f"memory_model={memory_model!r}; a memory budget needs a "
                         "memory_model.ActivationModel of the model (its shape and dtype)")
    if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, (int, float)) \
            or memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r}; give bytes > 0")
    options = tuple(DEFAULT_MEMORY_OPTIONS if memory_options is None else memory_options)
    if not options or not all(isinstance(o, MemoryOptions) for o in options):
        raise ValueError(f"memory_options={memory_options!r}; give MemoryOptions to choose from")
    if memory_options is None:  # what the model's layers support (GDN: no full recompute)
        options = tuple(o for o in options if memory_model.refusal(o) is None)
    for option in options:
        if memory_model.refusal(option):
            raise ValueError(f"memory_options: {memory_model.refusal(option)}")
    longest_suffix = max(t.num_tokens for g in batch.groups for t in g.trajectories)
    smallest = longest_suffix + (-longest_suffix % row_multiple)
    longest_prefix = max(g.prefix_len for g in batch.groups)
    budgets = _token_budgets(max(token_budget, smallest), smallest, row_multiple)
    plans = {}
    rejected, best_overall = [], None
    for option in options:
        fitting = []
        smallest_peak = None
        for tb in budgets:
            for chunk in _chunk_sizes(prefix_chunk_tokens, longest_prefix):
                if (tb, chunk) not in plans:
                    plans[tb, chunk] = plan_fn(tb, chunk)
                peaks = reuse_phase_peaks(memory_model, plans[tb, chunk], option)
                smallest_peak = min(smallest_peak or peaks["step"], peaks["step"])
                if best_overall is None or peaks["step"] < best_overall[0]:
                    best_overall = (peaks["step"], option, tb, chunk)
                if peaks["step"] <= memory_budget_bytes:
                    fitting.append((tb, chunk or float("inf"), chunk, peaks))
        if fitting:
            tb, _, chunk, peaks = max(fitting, key=lambda f: (f[0], f[1]))
            choice = MemoryChoice(budget_bytes=int(memory_budget_bytes), options=option,
                                  token_budget=tb, prefix_chunk_tokens=chunk, peaks=peaks,
                                  rejected=tuple(rejected))
            return dataclasses.replace(plans[tb, chunk], memory=choice)
        rejected.append((option.describe(), smallest_peak))
    peak, option, tb, chunk = best_overall
    raise ValueError(
        f"memory_budget_bytes={int(memory_budget_bytes)} ({memory_budget_bytes / MIB:.2f} MiB) "
        f"is too small for this batch under every option tried "
        f"({', '.join(o.describe() for o in options)}); the smallest budget that fits is "
        f"{int(-(-peak // 1))} bytes ({peak / MIB:.2f} MiB: {option.describe()}, suffix "
        f"microbatches of <= {tb} tokens, "
        f"{'prefix chunks of <= %d tokens' % chunk if chunk else 'whole prefixes'}); raise the "
        "budget or shorten the trajectories")


def dense_rows_within_budget(memory_model: ActivationModel, row_len: int, num_rows: int,
                             memory_budget_bytes: float, recompute: str = "none") -> int:
    """Dense packing under the same budget: the most equal-length rows per microbatch
    (micro_batch_size) whose predicted peak fits; ValueError if one row does not."""
    one = dense_peak_bytes(memory_model, [row_len], recompute)
    if one > memory_budget_bytes:
        raise ValueError(f"dense training needs {one / MIB:.2f} MiB for one {row_len}-token row "
                         f"(recompute {recompute}), over the budget "
                         f"{memory_budget_bytes / MIB:.2f} MiB; raise the budget or use full "
                         "recompute")
    rows = 1
    while rows < num_rows and dense_peak_bytes(memory_model, [(rows + 1) * row_len],
                                               recompute) <= memory_budget_bytes:
        rows += 1
    return rows
