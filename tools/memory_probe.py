"""Device memory of one training step, modelled the same way on CPU and GPU.

The counting is prefix_schedule.runtime.memory's ([Note: device-memory accounting]): the bytes
that would live on the accelerator -- tensors autograd saves for backward (each storage once,
recompute inputs included), the prefix cache's K/V and fp32 gK/gV, pipeline buffers in flight,
offloaded prefix activations once brought back for Phase C -- with offloaded bytes counted as
host. Parameters, gradients, optimizer state and short-lived temporaries are not counted: they
are the same for dense and reuse, or transient. On a GPU, tools/gpu_check.py sets this model
beside `torch.cuda.max_memory_allocated`.

The suffix phase of a reuse step is its suffix forwards and backwards (a group's Phase C that
runs between other groups' suffix microbatches is not in it: it is "PB"); `phase_peaks` has one
peak per compute-action kind (PF, SF, SB, PB, RG) and "suffix".
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

from prefix_schedule.runtime.memory import DeviceMemoryMeter, watch_step

__all__ = ["MemoryReport", "measure_dense", "measure_reuse"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Byte counts of one accounted step (see the module docstring for what is counted)."""

    peak_saved_bytes: int
    """Max over the step of the device bytes (saved activations, plus cache and buffers)."""
    peak_host_bytes: int = 0
    """Max of the offloaded bytes parked in host memory."""
    suffix_phase_peak_bytes: Optional[int] = None
    """Max of the device bytes while suffix microbatches run (reuse only; None for dense)."""
    cache_peak_bytes: Optional[int] = None
    """Max of PrefixKVCache.nbytes() over the step (reuse only; None for dense)."""
    phase_peaks: Dict[str, int] = dataclasses.field(default_factory=dict)
    """Device peak per compute-action kind and "suffix" (reuse only)."""

    def __post_init__(self) -> None:
        for name in ("peak_saved_bytes", "peak_host_bytes", "suffix_phase_peak_bytes",
                     "cache_peak_bytes"):
            value = getattr(self, name)
            assert value is None or value >= 0, (name, value)


def measure_dense(model, run: Callable[[], object]) -> MemoryReport:
    """Device bytes of one dense step `run()` on `model` (parameters excluded)."""
    with DeviceMemoryMeter(exclude=list(model.parameters())) as meter:
        run()
    return MemoryReport(peak_saved_bytes=meter.peak_bytes)


def measure_reuse(model, step, run: Callable[[object], object]) -> MemoryReport:
    """Device bytes of one reuse step `run(step)` for a fresh ReuseStep `step` on `model`."""
    cache_peak = [0]

    def cache_bytes():
        cache_peak[0] = max(cache_peak[0], sum(c.nbytes() for c in step.caches))
        return ()

    meter = DeviceMemoryMeter(exclude=list(model.parameters()), sources=[cache_bytes])
    watch_step(step, meter)
    with meter:
        run(step)
    assert "suffix" in meter.phase_peaks, "the step ran no suffix microbatch"
    return MemoryReport(peak_saved_bytes=meter.peak_bytes, peak_host_bytes=meter.peak_host_bytes,
                        suffix_phase_peak_bytes=meter.phase_peaks["suffix"],
                        cache_peak_bytes=cache_peak[0], phase_peaks=dict(meter.phase_peaks))
