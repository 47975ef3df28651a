"""When a timing is noise ([Note: timings that say when they are noise] in
megatron_patches/support/noise.py): the warning logic with injected timings and load, never a
measured time. `make demo` and tools/bench.py print what these functions return."""
from __future__ import annotations

import pytest

from megatron_patches.support.noise import noise_warning, speedup_line, timing_of

STEADY = [1.00, 1.02, 0.98, 1.00]


def test_steady_steps_on_an_idle_machine_are_a_measurement():
    assert noise_warning({"dense": STEADY, "reuse": [0.5, 0.51, 0.49]}, load=1.0, cores=2) is None
    line = speedup_line(STEADY, [0.5, 0.51, 0.49, 0.5], load=0.5, cores=2)
    assert line.startswith("speedup of reuse over dense: 2.00x (medians of 4 interleaved steps")
    assert "NOISE" not in line


@pytest.mark.parametrize("dense, load, cores, words", [
    ([8.1, 39.4, 9.0, 35.6], 1.0, 2, ["dense steps spread 8.1-39.4 s", "> 25%"]),   # issue 36
    (STEADY, 3.4, 2, ["busy (load average 3.4 > 2 core(s))"]),
    (STEADY[:2], 0.1, 2, ["fewer than 3 timed steps"]),
])
def test_noise_is_said_beside_the_figure(dense, load, cores, words):
    line = speedup_line(dense, [0.5, 0.5, 0.5, 0.5][:len(dense)], load=load, cores=cores)
    figure, warning = line.split("\n")
    assert figure.startswith("speedup of reuse over dense: ")
    assert warning.strip().startswith("NOISE: ") and "not a measurement" in warning
    assert all(w in warning for w in words), warning


def test_no_load_average_is_not_a_reason():
    assert noise_warning({"dense": STEADY}, load=None, cores=2) is None


def test_timing_of():
    t = timing_of([1.0, 3.0, 2.0])
    assert (t.median, t.spread, t.steps) == (2.0, 1.0, 3)
    with pytest.raises(ValueError, match="at least one step"):
        timing_of([])


def test_bench_table_prints_the_noise_line():
    """tools/bench.py's table: the warning on the line after the speedup."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from benchlib.adapter_bench import format_adapter
    result = {"adapter": "generic", "dense_seconds": 2.0, "reuse_seconds": 1.0, "speedup": 2.0,
              "ideal_speedup": 3.0, "efficiency": 0.67, "max_grad_rel_diff": 1e-7,
              "adapter_overhead_seconds": 0.1, "adapter_overhead_workload": {},
              "timing": {"noise": "NOISE: the machine is busy"}}
    lines = format_adapter(result).split("\n")
    assert lines[0].startswith("adapter generic:") and lines[1] == "  NOISE: the machine is busy"
