"""Suffix-microbatch orders of one rank: classic 1F1B and Megatron's interleaved 1F1B.

Both are a forward sequence, a backward sequence and a warmup count W: W forwards, then one
forward and one backward in turn, then the remaining backwards (`BaseOrder`).

[Note: Megatron's interleaved order] (megatron-core 0.19.2,
pipeline_parallel/schedules.py: get_schedule_table, get_pp_rank_microbatches,
forward_backward_pipelining_with_interleaving)
Microbatches are taken in groups of N = `microbatch_group_size_per_vp_stage` (default PP); the
forward sequence runs each group through model chunk 0, then chunk 1, ... (the last group holds
every remaining microbatch), and the backward sequence is the same table with the chunks
reversed. Rank r warms up with W = (PP - r - 1) * 2 + (V - 1) * N forwards (at most all of
them). Megatron refuses N outside [PP, M] (ValueError) and 0 < M % N < PP (RuntimeError, "it
introduces dependency bubbles"); with such counts this order can indeed deadlock.
`check_megatron_interleaving` mirrors both refusals as ValueErrors. The prefix-reuse generator
still accepts any M: when every rank waits it gives one rank one more warmup forward
(`BaseOrder.extend_warmup`), which never happens for the counts Megatron accepts.
"""

from __future__ import annotations

from typing import Optional

from prefix_schedule.pipeline.ir import ActionKind, check_count

__all__ = ["BaseOrder", "check_megatron_interleaving", "interleaved_order", "megatron_table",
           "one_f_one_b_order"]

_SF, _SB = ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD


class BaseOrder:
    """One rank's suffix order: `forwards` / `backwards` as (microbatch, stage), W warmup."""

    __slots__ = ("forwards", "backwards", "warmup", "pos_f", "pos_b")

    def __init__(self, forwards: list, backwards: list, warmup: int) -> None:
        self.forwards, self.backwards = forwards, backwards
        self.warmup = min(warmup, len(forwards))
        self.pos_f = self.pos_b = 0

    def peek(self) -> Optional[tuple]:
        """(kind, microbatch, stage) of the next action, or None when done."""
        if self.pos_f < len(self.forwards) and self.pos_f - self.pos_b <= self.warmup:
            m, stage = self.forwards[self.pos_f]
            return _SF, m, stage
        if self.pos_b < len(self.backwards):
            m, stage = self.backwards[self.pos_b]
            return _SB, m, stage
        return None

    def peek_forward(self) -> Optional[tuple]:
        """(microbatch, stage) of the next forward, or None when all ran."""
        return self.forwards[self.pos_f] if self.pos_f < len(self.forwards) else None

    def advance(self, kind: ActionKind) -> None:
        if kind is _SF:
            self.pos_f += 1
        else:
            self.pos_b += 1

    def extend_warmup(self) -> None:
        """One more forward before the next backward (breaks a stall; see the note)."""
        self.warmup += 1

    def actions(self) -> list:
        """The whole order as (kind, microbatch, stage), without playing it."""
        saved = self.pos_f, self.pos_b
        out = []
        while (nxt := self.peek()) is not None:
            out.append(nxt)
            self.advance(nxt[0])
        self.pos_f, self.pos_b = saved
        return out


def one_f_one_b_order(rank: int, num_ranks: int, num_microbatches: int) -> BaseOrder:
    """Classic 1F1B on one model chunk: W = PP - rank - 1 (Megatron's non-interleaved order)."""
    sequence = [(m, rank) for m in range(num_microbatches)]
    return BaseOrder(sequence, list(sequence), num_ranks - 1 - rank)


def megatron_table(num_microbatches: int, num_chunks: int, group_size: int) -> list:
    """(microbatch, model chunk) in forward order: Megatron's get_schedule_table."""
    table = []
    for low in range(0, num_microbatches, group_size):
        high = min(low + group_size, num_microbatches)
        if low + group_size >= num_microbatches:
            high = num_microbatches  # the last group takes every remaining microbatch
        table += [(m, v) for v in range(num_chunks) for m in range(low, high)]
    return table


def interleaved_order(rank: int, num_ranks: int, num_chunks: int, num_microbatches: int,
                      group_size: Optional[int] = None) -> BaseOrder:
    """Megatron's interleaved 1F1B order of `rank` ([Note: Megatron's interleaved order]);
    model chunk v of rank r is virtual stage v * num_ranks + r."""
    group_size = num_ranks if group_size is None else group_size
    table = megatron_table(num_microbatches, num_chunks, group_size)
    forwards = [(m, v * num_ranks + rank) for m, v in table]
    backwards = [(m, (num_chunks - 1 - v) * num_ranks + rank) for m, v in table]
    warmup = (num_ranks - rank - 1) * 2 + (num_chunks - 1) * group_size
    return BaseOrder(forwards, backwards, warmup)


def check_megatron_interleaving(num_ranks: int, num_microbatches: int,
                                group_size: Optional[int] = None) -> int:
    """The microbatch group size N Megatron 0.19.2 would use; ValueError where it refuses."""
    check_count("num_microbatches", num_microbatches, 1)
    group_size = num_ranks if group_size is None else group_size
    if not num_ranks <= group_size <= num_microbatches:
        raise ValueError(
            f"Megatron's interleaved schedule needs microbatch_group_size_per_vp_stage in "
            f"[PP={num_ranks}, M={num_microbatches}], got {group_size}: use at least "
            f"{max(num_ranks, group_size)} microbatches")
    remainder = num_microbatches % group_size
    if 0 < remainder < num_ranks:
        raise ValueError(
            f"Megatron's interleaved schedule refuses M={num_microbatches} microbatches in "
            f"groups of N={group_size}: the last group would hold {remainder} < PP={num_ranks} "
            "(a dependency bubble); use a multiple of N, or a remainder >= PP")
    return group_size
