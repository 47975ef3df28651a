"""Timing a region the same way on every device: on a GPU, CUDA events recorded around it after
a synchronize, read after another (kernels are asynchronous: wall time alone measures launches);
on a CPU, perf_counter. Peak memory per phase on a GPU from the caching allocator."""
from __future__ import annotations

import time
from typing import Optional

import torch

__all__ = ["PhaseMemory", "RegionTimer", "device_of"]


def device_of(model) -> torch.device:
    return next(model.parameters()).device


class RegionTimer:
    """`with RegionTimer(device) as t: ...` then `t.seconds` (wall) and `t.cpu_seconds` (this
    process's CPU time over all its threads: on a shared, overloaded CPU it moves far less with
    other jobs' load than wall time does; on a GPU it is host time only)."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.seconds: Optional[float] = None
        self.cpu_seconds: Optional[float] = None

    def __enter__(self) -> "RegionTimer":
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            torch.cuda.synchronize(self.device)
            self.seconds = self._start.elapsed_time(self._end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0

    @property
    def basis(self) -> str:
        return ("CUDA events around the region, synchronized before and after" if self.cuda
                else "time.perf_counter around the region (CPU)")


class PhaseMemory:
    """`with PhaseMemory(device) as m: ...` then `m.peak_bytes` (the allocator's peak during the
    phase, counters reset at entry) and `m.peak_extra_bytes` (minus what was allocated at entry);
    both None off CUDA."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.peak_bytes: Optional[int] = None
        self.peak_extra_bytes: Optional[int] = None

    def __enter__(self) -> "PhaseMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            self.peak_extra_bytes = self.peak_bytes - self._base
