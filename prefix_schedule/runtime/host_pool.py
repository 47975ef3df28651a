"""The bounded host memory that offloaded prefix activations wait in (runtime/offload.py).

[Note: pinned host pool]
Offloaded tensors come in many sizes (prefix lengths and chunk lengths differ between groups),
so the pool is a small allocator over a few large host slabs, never one block per size:
- a block is a 64-byte-aligned extent of a slab; `take` picks the smallest free extent that
  fits (best fit), splits off the rest, and `give` merges it back with its free neighbours, so a
  block freed by a long tensor serves several short ones and vice versa;
- a bounded pool (`capacity_bytes`) pins at most that: its slabs are the powers of two of the
  capacity's binary expansion (pieces >= 64 bytes), each pinned when first needed (the smallest
  piece that fits; a bound that is itself a power of two is one slab, pinned at the first
  offload). torch's pinned allocator rounds every allocation up to a power of two and keeps
  freed ones cached (the next step's pool gets them back without re-pinning), so exact powers
  of two make `allocated_bytes` the bytes really pinned. A request that fits no free extent and no
  unpinned piece gets None: its tensor stays on the device (memory, never the math, changes);
- an unbounded pool (None) pins a new slab (the request rounded up to a power of two, at least
  `min_slab_bytes`) when nothing free fits.
Ordering on CUDA: a block handed back with the event of the copy that reads it (`give(block,
event)`) is reused only after that event: `take(nbytes, stream)` makes `stream` wait for it on
the device (free when, as in the offloader, every copy of the pool's blocks runs on that one
stream: a stream runs its work in issue order), or the host waits (`stream=None`). Dropping a
pinned slab while a copy uses it is safe too: a non_blocking copy records its stream on torch's
pinned block (`CachingHostAllocator_recordEvent`), which is not reused before that copy ends.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Optional

import torch

__all__ = ["ALIGN", "PinnedHostPool"]

ALIGN = 64
"""Bytes: every block starts at a multiple of this (the offloader keeps views' alignment
modulo it)."""


def _pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass(eq=False)
class _Extent:
    slab: int
    start: int
    size: int
    events: list = dataclasses.field(default_factory=list)  # copies to wait for before reuse


class PinnedHostPool:
    """Host blocks (uint8) from at most `capacity_bytes` of slabs ([Note: pinned host pool])."""

    def __init__(self, capacity_bytes: Optional[int] = None, *, pin: bool = False,
                 min_slab_bytes: int = 1 << 20) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}; give bytes >= 0 or None")
        if min_slab_bytes < ALIGN:
            raise ValueError(f"min_slab_bytes={min_slab_bytes}; give bytes >= {ALIGN}")
        self.capacity_bytes, self.pin, self.min_slab_bytes = capacity_bytes, pin, min_slab_bytes
        self._pieces: List[int] = ([] if capacity_bytes is None else  # slabs not pinned yet
                                   [1 << b for b in range(capacity_bytes.bit_length())
                                    if capacity_bytes >> b & 1 and 1 << b >= ALIGN])
        self._slabs: List[torch.Tensor] = []
        self._free: Dict[int, List[_Extent]] = {}  # slab -> its free extents by start
        self._lent: Dict[int, _Extent] = {}  # data_ptr of a block handed out -> its extent
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocated_bytes = 0
        """Bytes of the slabs pinned so far (<= capacity_bytes)."""

    def take(self, nbytes: int, stream=None) -> Optional[torch.Tensor]:
        """A block of `nbytes`, or None if none fits the capacity. `stream`: where the block's
        next use runs (its reuse waits for earlier copies there; None: on the host)."""
        size = max(-(-nbytes // ALIGN) * ALIGN, ALIGN)
        extent = self._best_fit(size)
        if extent is None:
            extent = self._new_slab(size)
            if extent is None:
                return None
        self._remove(extent)
        if extent.size > size:  # the rest stays free (its pending copies with it)
            self._insert(_Extent(extent.slab, extent.start + size, extent.size - size,
                                 list(extent.events)))
            extent.size = size
        for event in extent.events:
            if stream is not None:
                stream.wait_event(event)
            else:
                event.synchronize()
        extent.events = []
        block = self._slabs[extent.slab][extent.start:extent.start + nbytes]
        self._lent[block.data_ptr()] = extent
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return block

    def give(self, block: torch.Tensor, event=None) -> None:
        """Return `block`; `event`: the copy still reading it (waited for before its reuse)."""
        extent = self._lent.pop(block.data_ptr())
        self.in_use_bytes -= extent.size
        extent.events = [] if event is None else [event]
        self._insert(extent)

    # ---- extents
    def _best_fit(self, size: int) -> Optional[_Extent]:
        fits = [e for free in self._free.values() for e in free if e.size >= size]
        return min(fits, key=lambda e: (e.size, e.slab, e.start), default=None)

    def _new_slab(self, size: int) -> Optional[_Extent]:
        if self.capacity_bytes is None:
            nbytes = max(_pow2_ceil(size), self.min_slab_bytes)
        else:
            nbytes = min((p for p in self._pieces if p >= size), default=None)
            if nbytes is None:
                return None
            self._pieces.remove(nbytes)
        self._slabs.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))
        self.allocated_bytes += nbytes
        extent = _Extent(len(self._slabs) - 1, 0, nbytes)
        self._free[extent.slab] = [extent]
        return extent

    def _remove(self, extent: _Extent) -> None:
        self._free[extent.slab].remove(extent)

    def _insert(self, extent: _Extent) -> None:
        """Put `extent` back among its slab's free extents, merged with free neighbours."""
        free = self._free[extent.slab]
        at = bisect.bisect([e.start for e in free], extent.start)
        if at < len(free) and extent.start + extent.size == free[at].start:
            extent.size += free[at].size
            extent.events += free.pop(at).events
        if at and free[at - 1].start + free[at - 1].size == extent.start:
            before = free.pop(at - 1)
            extent.start, extent.size = before.start, before.size + extent.size
            extent.events += before.events
            at -= 1
        extent.events = [e for e in extent.events if not e.query()]  # drop finished copies
        free.insert(at, extent)
