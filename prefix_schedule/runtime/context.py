"""The reuse context of the forward being run: what the Megatron hooks read.

The executor sets exactly one context around each prefix or suffix action (forward, and backward
too: activation recompute re-runs the attention hook inside backward); the hooks installed into
Megatron (attention, RoPE positions) are inert when no context is set, so dense training in the
same process is untouched. Thread-local: Megatron runs a rank's steps on one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional, Union

import torch

__all__ = [
    "PrefixForwardContext",
    "SuffixForwardContext",
    "PrefixForwardDone",
    "current_context",
    "active_context",
]


class PrefixForwardDone(Exception):
    """Raised by the attention hook after the last layer's prefix K/V is cached.

    See [Note: prefix forward stops at the last cached K/V] in docs/DESIGN.md: nothing after that
    point is needed in Phase A, so the executor catches this and the rest never runs.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixForwardContext:
    """Phase A: the rows being run are group `group`'s cached prefix tokens (or one chunk of them:
    [Note: prefix chunks] in units.py)."""

    group: int
    """Group whose prefix is being run."""
    cache: "object"
    """The step's PrefixKVCache; the attention hook stores each layer's K/V there."""
    stop_after_layer: Optional[int]
    """Global layer number after whose K/V the forward stops (the model's last layer, on the last
    pipeline stage); None on earlier stages, whose output travels on."""
    recomputing: bool = False
    """True during Phase C: a recomputed attention must not store K/V again."""
    replay: bool = False
    """Phase C's re-run of a prefix forward under full activation recompute ([Note: prefix full
    recompute] in docs/DESIGN.md): Phase A ran without a graph and kept only the K/V; the re-run
    binds its fresh K/V (with their graph) to the stored entries and stops where Phase A did."""
    inject: bool = False
    """Phase C's re-run under full recompute with Megatron's checkpointing kept: wherever the
    attention runs with grad (CheckpointFunction's recompute in backward), the entry's gK/gV
    join the gradient of its K/V (PrefixKVCache.inject_grads); the forward never stops early."""
    full_recompute: bool = False
    """Phase A of a training step under full activation recompute (run under no_grad): the MoE
    routers record their prefix statistics as values and count the expert bias here, once;
    Phase C's re-run recomputes the statistics with their graph ([Note: prefix router stats
    under full recompute] in router_stats.py)."""
    chunk: int = 0
    """Chunk of the group's prefix being run; chunk c > 0 also attends to the cached K/V of the
    group's chunks < c."""
    position_offset: int = 0
    """Position of the row's first token (the chunk's start in the prefix; 0 unchunked)."""
    padding: int = 0
    """Padding tokens at the row's end ([Note: row padding] in planner.py): their K/V are never
    cached."""
    reads: Optional[tuple] = None
    """The chunks this chunk attends to, root first (a prefix tree: its ancestors); None: the
    group's chunks < chunk."""
    multiplicity: int = 1
    """How many trajectories of the step read this prefix (dense training routes each prefix
    token that many times): [Note: logical prefix tokens] in router_stats.py."""
    stop_in_router: bool = False
    """The forward stops after the router of layer `stop_after_layer` instead of after its K/V
    (an MoE last layer whose prefix router statistics count: aux losses, z-loss, expert bias)."""
    cp: Optional["object"] = None
    """runtime.cp.CPRow when the row runs context-parallel (this rank's zigzag rows of it)."""
    packed: tuple = ()
    """A packed CP row ([Note: packed CP prefix rows] in runtime/cp.py): per member prefix,
    (group, start, end) of its tokens among the row's real tokens; () for a row of one prefix
    unit (`group`)."""

    def __post_init__(self) -> None:
        for name in ("group", "chunk", "position_offset", "padding", "multiplicity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PrefixForwardContext.{name} must be an int >= 0, got {value!r}")
        if (self.chunk == 0) != (self.position_offset == 0):
            raise ValueError(f"chunk {self.chunk} at position offset {self.position_offset}: only "
                             "chunk 0 starts at position 0 (chunks are never empty)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixForwardContext:
    """Phase B: a packed row of suffix sequences reading cached prefixes."""

    microbatch: int
    """Index of the suffix microbatch in the step plan."""
    cache: "object"
    """The step's PrefixKVCache."""
    slot_groups: tuple
    """Per group slot of the packed row: the group whose cached prefix it reads, or None."""
    meta: "object"
    """prefix_schedule.attention.PackedMeta of the row (host-built)."""
    position_ids: torch.Tensor
    """[T] position of every row token (suffixes continue at their cached prefix length)."""
    max_position: int
    """Largest entry of position_ids (host int: no device sync in the RoPE hook)."""
    slot_reads: Optional[tuple] = None
    """Per slot, None (read all of the group's chunks) or (chunks, length): the chain of a
    prefix-tree node and how many of its cached tokens the slot attends to
    ([Note: prefix trees] in planning/tree.py)."""
    sequence_groups: tuple = ()
    """Per packed sequence: the group whose cached prefix it continues, or None (a sequence run
    whole, or the row's padding)."""
    num_padding: int = 0
    """Padding tokens at the row's end ([Note: row padding]): no router statistic counts them."""
    cp: Optional["object"] = None
    """runtime.cp.CPRow when the row runs context-parallel (position_ids then are the full
    row's; the hook reads the CPRow's local ones)."""


Context = Union[PrefixForwardContext, SuffixForwardContext]
_LOCAL = threading.local()


def current_context() -> Optional[Context]:
    """The context set by the executor around the running forward, or None (dense)."""
    return getattr(_LOCAL, "context", None)


@contextlib.contextmanager
def active_context(context: Context) -> Iterator[Context]:
    """Set `context` for the duration of one forward; nesting is a protocol error."""
    assert current_context() is None, "reuse contexts do not nest"
    _LOCAL.context = context
    try:
        yield context
    finally:
        _LOCAL.context = None
