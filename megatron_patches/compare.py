"""`python -m megatron_patches compare RUN_A RUN_B [--tol 1e-5]`: a dense and a reuse run, side by
side, with the test suite's metric.

A run is a directory (or, for scalars, a log file) of the Megatron-LM entry point or any Megatron
training script:
* scalars per iteration: tensorboard event files under it (`--tensorboard-dir`: every scalar tag)
  and Megatron's console lines in `*.log` / `*.txt` / `*.out` files (`iteration N/ M | key: value
  | ...`: every numeric key). Per tag: max over the common iterations of |a - b| / |a|; an
  iteration only one side has is listed.
* tensors: `--prefix-reuse-dump-params` dumps under it (`iter_<i>/<rank>.safetensors`: weights,
  and gradients when dumped). Per iteration and rank: `max_relative_diff` of
  megatron_patches/training.py (max over tensors of max|a - b| / max|a|; inf on a NaN or inf on
  either side), as tests/megatron_lm_runs.py::assert_dumps_equal uses it.
Megatron's own checkpoints (`--save`, torch_dist) are not read: dump the parameters instead.
Exit status: 0 every compared number within --tol; 1 something differs (named); 2 nothing to
compare (what was looked for is named). Tests: tests/test_compare.py.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

__all__ = ["main", "read_scalars", "read_dumps", "compare_runs"]

_LOG_SUFFIXES = (".log", ".txt", ".out")
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|(.*)")
_TIMING_WORDS = ("time", "throughput", "per sec", "tflop")
"""Keys of a timing (they differ between any two runs): not compared."""

Scalars = Dict[str, Dict[int, float]]


def _files(run: Path, pattern: str) -> List[Path]:
    return [run] if run.is_file() else sorted(run.rglob(pattern))


def _pairs(text: str):
    """(key, number) of each `key: number` segment of an iteration line, timings left out."""
    for segment in text.split("|"):
        key, sep, value = segment.rpartition(":")
        key = key.strip()
        if not sep or not key or any(w in key.lower() for w in _TIMING_WORDS):
            continue
        try:
            yield key, float(value)
        except ValueError:
            continue


def _log_scalars(run: Path) -> Scalars:
    out: Scalars = {}
    for path in _files(run, "*"):
        if path.is_file() and (path == run or path.suffix in _LOG_SUFFIXES):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                match = _ITERATION.search(line)
                if match:
                    for key, value in _pairs(match.group(2)):
                        out.setdefault(f"log/{key}", {})[int(match.group(1))] = value
    return out


def _tensorboard_scalars(run: Path) -> Scalars:
    if not run.is_dir() or not any(run.rglob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: Scalars = {}
    for directory in sorted({p.parent for p in run.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            out.setdefault(f"tb/{tag}", {}).update({e.step: e.value for e in events.Scalars(tag)})
    return out


def read_scalars(run: Path) -> Scalars:
    """tag -> {iteration: value} from the run's tensorboard events and console logs."""
    return {**_tensorboard_scalars(run), **_log_scalars(run)}


def read_dumps(run: Path) -> Dict[Tuple[int, str], Path]:
    """(iteration, rank file) -> path of the run's --prefix-reuse-dump-params files."""
    if not run.is_dir():
        return {}
    out = {}
    for path in run.rglob("iter_*/*.safetensors"):
        try:
            out[(int(path.parent.name[len("iter_"):]), path.name)] = path
        except ValueError:
            continue
    return out


def _scalar_lines(a: Scalars, b: Scalars, tol: float) -> Tuple[List[str], bool]:
    lines, ok = [], True
    for tag in sorted(set(a) & set(b)):
        steps = sorted(set(a[tag]) & set(b[tag]))
        only = sorted(set(a[tag]) ^ set(b[tag]))
        worst, at = 0.0, None
        for step in steps:
            x, y = a[tag][step], b[tag][step]
            diff = math.inf if not (math.isfinite(x) and math.isfinite(y)) else (
                abs(x - y) / abs(x) if x != 0 else abs(y))
            if at is None or diff > worst:
                worst, at = diff, step
        ok &= worst <= tol and not only and bool(steps)
        lines.append(f"{'ok  ' if worst <= tol and not only else 'DIFF'} {tag}: max rel diff "
                     f"{worst:.2e} over {len(steps)} iteration(s)"
                     + (f" (worst at {at})" if steps else "")
                     + (f"; only on one side: {only[:8]}" if only else ""))
    return lines, ok


def _tensor_lines(a: Dict, b: Dict, tol: float) -> Tuple[List[str], bool]:
    from safetensors.torch import load_file

    from megatron_patches.training import max_relative_diff

    lines, ok = [], True
    for key in sorted(set(a) & set(b)):
        ta, tb = load_file(a[key]), load_file(b[key])
        if set(ta) != set(tb):
            lines.append(f"DIFF iter {key[0]} {key[1]}: different tensors "
                         f"({sorted(set(ta) ^ set(tb))[:4]})")
            ok = False
            continue
        per = {name: max_relative_diff({name: ta[name]}, {name: tb[name]}) for name in ta}
        name = max(per, key=per.get) if per else None
        worst = per.get(name, 0.0)
        ok &= worst <= tol
        lines.append(f"{'ok  ' if worst <= tol else 'DIFF'} iter {key[0]} {key[1]}: "
                     f"max_relative_diff {worst:.2e} over {len(per)} tensors"
                     + (f" (worst {name})" if name else ""))
    for key in sorted(set(a) ^ set(b)):
        lines.append(f"DIFF iter {key[0]} {key[1]}: only in {'RUN_A' if key in a else 'RUN_B'}")
        ok = False
    return lines, ok


def compare_runs(a: Path, b: Path, tol: float = 1e-5) -> Tuple[int, str]:
    """(exit status, report) of RUN_A vs RUN_B (module docstring)."""
    for run in (a, b):
        if not run.exists():
            return 2, f"compare: {run} does not exist; give a run directory or log file"
    sa, sb = read_scalars(a), read_scalars(b)
    da, db = read_dumps(a), read_dumps(b)
    if not (set(sa) & set(sb)) and not (da or db):
        return 2, (f"compare: nothing to compare in {a} and {b}: looked for tensorboard event "
                   f"files, Megatron iteration lines in *{'/*'.join(_LOG_SUFFIXES)} files, and "
                   "--prefix-reuse-dump-params dumps (iter_<i>/*.safetensors)")
    scalar_lines, scalars_ok = _scalar_lines(sa, sb, tol)
    tensor_lines, tensors_ok = _tensor_lines(da, db, tol) if (da or db) else ([], True)
    ok = scalars_ok and tensors_ok
    head = (f"{a} vs {b}: {'within' if ok else 'NOT within'} {tol:.0e} relative "
            "(scalars: |a-b|/|a|; tensors: max|a-b|/max|a| per tensor)")
    return (0 if ok else 1), "\n".join([head, *scalar_lines, *tensor_lines])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_patches compare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path, help="the reference run (e.g. dense)")
    parser.add_argument("run_b", type=Path, help="the run compared with it (e.g. reuse)")
    parser.add_argument("--tol", type=float, default=1e-5,
                        help="relative tolerance (default: 1e-5, the tests' fp32 bound)")
    args = parser.parse_args(argv)
    if not args.tol >= 0:
        parser.error(f"--tol {args.tol}: give a tolerance >= 0")
    status, report = compare_runs(args.run_a, args.run_b, args.tol)
    print(report, file=sys.stderr if status == 2 else sys.stdout)
    return status
