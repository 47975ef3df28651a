"""Offload of dormant prefix activations: Phase A's saved tensors wait for Phase C in host memory.

[Note: prefix activation offload] Between a group's Phase A and its Phase C (all of Phase B) the
prefix's saved activations are dormant; on an accelerator they can wait in pinned host memory.
Unlike `torch.autograd.graph.save_on_cpu`, which copies every saved tensor synchronously:
- parameters (a linear layer saves its weight) and tensors the cache keeps on the device anyway
  (the K/V, `keep`) are never copied; small tensors (< `min_bytes`) stay too;
- each saved tensor is copied once (the span of its view, so it comes back with its strides and
  alignment and Phase C rounds bit for bit as without offload), however
  often autograd saves it: a second save of the same live tensor, unchanged (same version), reuses
  the copy (copying a whole storage once would be wrong: a buffer may be written after one of
  its views is saved, so each view copies its own span when saved);
- copies run on a side stream (CUDA; synchronous on CPU, where host and device are one memory);
  the source storage is recorded on that stream so the allocator cannot reuse it too early;
- `prefetch(key)` starts copying a unit back when its Phase C starts (`prefetch_points`;
  earlier would hold it on the device during the suffix work before, the peak offload lowers),
  last-saved first: Phase C's first unpack (the last layer) waits for one copy, and each later
  copy overlaps the backward of the layers after it; an unpack without prefetch fetches
  synchronously;
- host blocks come from a bounded `PinnedHostPool` ([Note: pinned host pool] in host_pool.py:
  best-fit extents of a few slabs, so varying sizes never pin past the bound) and return to it
  once copied back; when nothing fits the tensor simply stays on the device (memory, never the
  math, changes). Every copy from or into the pool runs on the one side stream, so a block's
  reuse never waits on the host.
Bits are copied exactly, so gradients equal those without offload bit for bit. Every offload unit
is keyed (prefix unit, model chunk), so several groups in flight under PP never mix.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Sequence

import torch

from prefix_schedule.runtime.host_pool import ALIGN as _ALIGN
from prefix_schedule.runtime.host_pool import PinnedHostPool
from prefix_schedule.runtime.memory import active_meter, storage_key

__all__ = ["PinnedHostPool", "PrefixActivationOffloader", "prefetch_points"]  # pool: host_pool.py


class _Record:
    """One offloaded tensor (what pack returns): its host block until fetched, then its device
    buffer."""

    __slots__ = ("nbytes", "dtype", "shape", "stride", "lead", "host_box", "device_buf", "event",
                 "__weakref__")

    def __init__(self, t: torch.Tensor, host: torch.Tensor, lead: int) -> None:
        self.nbytes, self.dtype, self.shape, self.stride = host.numel(), t.dtype, t.shape, t.stride()
        self.lead = lead
        self.host_box = [host]  # emptied when fetched; returned to the pool if never fetched
        self.device_buf: Optional[torch.Tensor] = None
        self.event = None


def _span(t: torch.Tensor) -> tuple:
    """(elements of `t`'s storage its view spans, leading elements that keep its alignment)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    lead = (t.storage_offset() * t.element_size()) % _ALIGN // t.element_size()
    return extent, lead


def _typed(block: torch.Tensor, record: "_Record") -> torch.Tensor:
    return block.view(record.dtype).as_strided(record.shape, record.stride, record.lead)


class PrefixActivationOffloader:
    """Saved-tensor hooks for Phase A forwards; prefetch and unpack for Phase C."""

    def __init__(self, device, *, params: Iterable[torch.Tensor] = (),
                 keep: Callable[[torch.Tensor], bool] = lambda t: False,
                 pool: Optional[PinnedHostPool] = None, min_bytes: int = 1024) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compare with t.device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._params = {storage_key(p)[0] for p in params}
        self.keep, self.min_bytes = keep, min_bytes
        cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else PinnedHostPool(pin=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._units: Dict[Hashable, List[weakref.ref]] = {}
        self._resident: "weakref.WeakSet[_Record]" = weakref.WeakSet()
        self.stats = {"offloaded_bytes": 0, "kept_params": 0, "kept_other": 0, "pool_full": 0}

    # ---- Phase A
    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Offload what autograd saves inside this block under offload unit `key`."""
        copies: Dict[int, tuple] = {}  # id(tensor) -> (weakref, version, record), this forward
        units = self._units.setdefault(key, [])
        meter = active_meter()

        def keep(t: torch.Tensor, why: str):
            self.stats[why] += 1
            return meter.pack(t) if meter is not None else t

        def pack(t: torch.Tensor):
            if storage_key(t)[0] in self._params:
                return keep(t, "kept_params")
            extent, lead = _span(t)
            nbytes = (lead + extent) * t.element_size() if t.numel() else 0
            if nbytes < self.min_bytes or t.device != self.device or self.keep(t):
                return keep(t, "kept_other")
            known = copies.get(id(t))
            if known is not None and known[0]() is t and known[1] == t._version:
                return known[2]
            record = self._offload(t, nbytes, extent, lead)
            if record is None:
                return keep(t, "pool_full")
            copies[id(t)] = (weakref.ref(t), t._version, record)
            units.append(weakref.ref(record))
            return record

        def unpack(packed):
            if isinstance(packed, _Record):
                return self._unpack(packed)
            return meter.unpack(packed) if meter is not None else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _offload(self, t: torch.Tensor, nbytes: int, extent: int, lead: int) -> Optional[_Record]:
        # a reused block's earlier copies ran on this same stream, which keeps issue order: the
        # pool's wait for them costs the host nothing ([Note: pinned host pool])
        host = self.pool.take(nbytes, self._stream)
        if host is None:
            return None
        record = _Record(t, host, lead)
        # the view's whole span, so that it comes back with its own strides and alignment (the
        # kernels of Phase C then round exactly as without offload); only its elements are read
        target = host.view(t.dtype)[lead:lead + extent]
        t = t.as_strided((extent,), (1,), t.storage_offset())
        copied = None  # the copy into the block, if the record dies before it is fetched
        if self._stream is None:
            target.copy_(t)
        else:  # side stream: after the compute that produced t; t's memory waits for the copy
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                target.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            t.record_stream(self._stream)
        self.stats["offloaded_bytes"] += nbytes
        self._host_bytes(nbytes)
        weakref.finalize(record, self._release_host, record.host_box, nbytes, copied)
        return record

    # ---- Phase C
    def prefetch(self, key: Hashable) -> None:
        """Start copying unit `key`'s offloaded tensors back to the device, last saved first."""
        for ref in reversed(self._units.pop(key, ())):
            record = ref()
            if record is not None and record.device_buf is None:
                self._fetch(record)

    def _fetch(self, record: _Record) -> None:
        buf = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
        if self._stream is None:
            buf.copy_(record.host_box[0])
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                buf.copy_(record.host_box[0], non_blocking=True)
                record.event = torch.cuda.Event()
                record.event.record(self._stream)
            buf.record_stream(self._stream)
        record.device_buf = buf
        self._resident.add(record)
        self._release_host(record.host_box, record.nbytes, record.event)

    def _unpack(self, record: _Record) -> torch.Tensor:
        if record.device_buf is None:  # not prefetched: fetch now
            self._fetch(record)
        if record.event is not None:
            torch.cuda.current_stream(self.device).wait_event(record.event)
        return _typed(record.device_buf, record)

    # ---- accounting
    def resident_tensors(self) -> Iterator[torch.Tensor]:
        """Device buffers brought back for Phase C and still alive."""
        for record in list(self._resident):
            if record.device_buf is not None:
                yield record.device_buf

    def _host_bytes(self, delta: int) -> None:
        meter = active_meter()
        if meter is not None:
            meter.add_host_bytes(delta)

    def _release_host(self, host_box: list, nbytes: int, event=None) -> None:
        if host_box[0] is not None:
            self.pool.give(host_box.pop(), event)
            host_box.append(None)
            self._host_bytes(-nbytes)

    def pending_units(self) -> Sequence[Hashable]:
        """Units captured and not prefetched yet."""
        return tuple(self._units)


def prefetch_points(kinds: Sequence[str], keys: Sequence[Hashable], *, lookahead: int = 0,
                    prefetch_kind: str = "PB") -> Dict[int, List[Hashable]]:
    """Position in a rank's compute actions -> the offload keys to prefetch when it starts.

    Unit `keys[i]` of each `prefetch_kind` action at position i is prefetched at the start of
    the compute action `lookahead` positions before it (0: its own start; see the Note for why
    that is the default).
    """
    if lookahead < 0:
        raise ValueError(f"lookahead={lookahead}; give an int >= 0")
    points: Dict[int, List[Hashable]] = {}
    for i, kind in enumerate(kinds):
        if kind == prefetch_kind:
            points.setdefault(max(i - lookahead, 0), []).append(keys[i])
    return points
