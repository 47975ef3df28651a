"""Say when a timing is noise: median and spread of interleaved steps, and the machine's load.

[Note: timings that say when they are noise]
`make demo` printed 22.25x and, on a rerun of the same tree, 0.98x (issue 36): with other work on
a 2-core machine (load average 3-4) one step of the same path took 8 s and the next 39 s. A
speedup is only printed as a result when its steps agree: each path's median over several
interleaved steps with its spread, (max - min) / median, and a warning beside the figure when a
path's spread exceeds `MAX_SPREAD` or the load average (1 minute) exceeds the cores this process
may use. The warning logic takes the timings and the load as arguments (tests inject them:
tests/test_noise.py); no timing is asserted anywhere. No Megatron import here.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["MAX_SPREAD", "PathTiming", "timing_of", "machine_load", "noise_warning",
           "speedup_line"]

MAX_SPREAD = 0.25
"""A path whose steps spread more than this fraction of their median is called noisy."""


@dataclass(frozen=True, kw_only=True)
class PathTiming:
    """One path's timed steps."""

    median: float
    spread: float
    """(max - min) / median of the steps (0 for one step)."""
    steps: int


def timing_of(seconds: Sequence[float]) -> PathTiming:
    if not seconds:
        raise ValueError("no timed steps; time at least one step per path")
    median = statistics.median(seconds)
    spread = (max(seconds) - min(seconds)) / median if median > 0 else float("inf")
    return PathTiming(median=median, spread=spread, steps=len(seconds))


def machine_load() -> Tuple[Optional[float], int]:
    """(1-minute load average or None where the OS has none, cores this process may use)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return load, cores or 1


def noise_warning(times: Dict[str, Sequence[float]], *, load: Optional[float], cores: int,
                  max_spread: float = MAX_SPREAD) -> Optional[str]:
    """Why the timings of `times` (path -> seconds per step) are noise, or None."""
    reasons = []
    for name, seconds in times.items():
        t = timing_of(seconds)
        if t.spread > max_spread:
            reasons.append(f"{name} steps spread {min(seconds):.3g}-{max(seconds):.3g} s "
                           f"({t.spread:.0%} of their median, > {max_spread:.0%})")
    if load is not None and load > cores:
        reasons.append(f"the machine is busy (load average {load:.1f} > {cores} core(s))")
    if any(len(s) < 3 for s in times.values()):
        reasons.append("fewer than 3 timed steps per path")
    if not reasons:
        return None
    return ("NOISE: " + "; ".join(reasons) + ": this figure is not a measurement; rerun on an "
            "idle machine with more steps")


def speedup_line(dense: Sequence[float], reuse: Sequence[float], *, load: Optional[float],
                 cores: int, label: str = "speedup of reuse over dense") -> str:
    """The speedup of the medians, each path's median and spread, and the noise warning (if any)
    on the next line."""
    d, r = timing_of(dense), timing_of(reuse)
    line = (f"{label}: {d.median / r.median:.2f}x (medians of {d.steps} interleaved steps: "
            f"dense {d.median:.3g} s +-{d.spread / 2:.0%}, reuse {r.median:.3g} s "
            f"+-{r.spread / 2:.0%})")
    warning = noise_warning({"dense": dense, "reuse": reuse}, load=load, cores=cores)
    return line if warning is None else f"{line}\n  {warning}"
