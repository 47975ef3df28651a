"""The paper's speed and memory grid, scaled to the machine: prefix/suffix split x group size.

    python tools/sweep.py --csv docs/sweep/sweep.csv --png-dir docs/sweep     # this machine
    python tools/sweep.py --paper --csv paper.csv --png-dir out                 # the published grid (GPU)
    python tools/sweep.py --list                                                # print the points

Total length per trajectory fixed (`--total`, default 1536; the paper: 12,288), prefix:suffix
splits 1:5, 1:2, 1:1, 2:1, 5:1 (the paper's 2k/10k .. 10k/2k), group sizes 2..16 (paper: 2..128).
Each point times dense and reuse side by side (tools/sweep_measure.py), planned by the FLOP-model
policy (prefix_schedule/planning/policy.py: small-gain groups run dense, microbatches of at most
four dense rows' tokens; `--no-policy`: a group's suffixes in one microbatch, the bench's default).
Columns: speedup (wall) and cpu_speedup (process CPU time, the figure plotted: steadier on a
shared machine), ideal (FLOP ratio of the plan run) and ideal_full_reuse (of plain reuse),
efficiency = cpu_speedup / ideal, suffix_phase_reduction (held-for-backward bytes), the plan's
note, the gradient check, and every setting that changes a point (min-gain, token budget,
seed, reps, warm-up, memory, threads: the resume key with the point and the model). The CSV is
appended point by point; a rerun skips the points it holds under the same settings (a last row
cut short by a kill is dropped and measured again), so an interrupted sweep resumes. PNGs: speedup.png (measured and ideal speedup
vs prefix share, one line per group size), memory.png, efficiency.png.

`--compile` wraps both models' forward in torch.compile (dynamic shapes). Where it cannot be
used: the reuse attention hook -- dynamo (torch 2.13) fails inside its custom autograd Functions
(two-part attention, cache reads: InternalTorchDynamoError), so the hook runs eager under
torch.compiler.disable, a graph break at every attention layer in both paths (the hook is
process-wide); projections, MLP, norms, RoPE and the loss compile. The schedules, p2p and the
prefix cache are Python and stay eager in both paths. Memory is not measured when compiled
(tools/memory_probe.py's saved-tensor hooks break dynamo's guards). On CPU inductor needs a C++
compiler.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))

from argtypes import int_list, non_negative_int, point_list, positive_int  # noqa: E402
from prefix_schedule.planning.policy import DEFAULT_MIN_GAIN, ReusePolicy  # noqa: E402
from benchlib.progress import Progress  # noqa: E402
from outputs import check_output_dir  # noqa: E402
from sweep_measure import ModelSpec, Models, measure_point  # noqa: E402

__all__ = ["main", "grid", "PAPER"]

SPLITS = ((1, 5), (1, 2), (1, 1), (2, 1), (5, 1))
PAPER = {"total": 12288, "group_sizes": (2, 4, 8, 16, 32, 64, 128),
         "model": ModelSpec(num_layers=8, hidden_size=2048, ffn_hidden_size=5632,
                            num_attention_heads=16, num_query_groups=8, vocab_size=32768)}
KEY = ("total", "prefix", "suffix", "group_size", "num_groups", "policy_on", "compile", "model",
       "min_gain", "token_budget", "seed", "reps", "warmup", "memory", "threads")
"""Every setting that changes a point's numbers: a rerun skips a point only under all of them."""
FIELDS = KEY + ("prefix_share", "dense_s", "reuse_s", "speedup", "dense_cpu_s", "reuse_cpu_s",
                "cpu_speedup", "ideal", "ideal_full_reuse", "efficiency", "dense_peak_mib",
                "reuse_suffix_peak_mib", "suffix_phase_reduction", "microbatches", "policy",
                "grad_rel_diff", "load_avg")


def grid(total: int, group_sizes) -> list[tuple[int, int, int]]:
    """(prefix, suffix, group size) points, group size outermost."""
    points = []
    for g in group_sizes:
        for a, b in SPLITS:
            prefix = round(total * a / (a + b))
            points.append((prefix, total - prefix, g))
    return points


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", help="the published grid (needs a GPU)")
    p.add_argument("--total", type=positive_int, default=1536)
    p.add_argument("--group-sizes", type=int_list, default="2,4,8,16")
    p.add_argument("--points", type=point_list, default=None, help="only these, e.g. 256:1280:16,1280:256:2")
    p.add_argument("--num-groups", type=positive_int, default=1)
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--warmup", type=non_negative_int, default=1)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-policy", action="store_true", help="bench packing, never dense")
    p.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN)
    p.add_argument("--token-budget", type=int, default=None,
                   help="the policy's suffix microbatch tokens (default: 4 x the longest dense row)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--png-dir", type=Path, default=None)
    p.add_argument("--list", action="store_true", help="print the points and exit")
    for name, default in ModelSpec().__dict__.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"model (default {default}; --paper: {PAPER['model'].__dict__[name]})")
    return p.parse_args(argv)


def _spec(args) -> ModelSpec:
    base = PAPER["model"] if args.paper else ModelSpec()
    return ModelSpec(**{k: getattr(args, k) if getattr(args, k) is not None else v
                        for k, v in base.__dict__.items()})


def _points(args) -> list[tuple[int, int, int]]:
    if args.points:
        return list(args.points)  # argtypes.point_list checked them
    total = PAPER["total"] if args.paper else args.total
    sizes = PAPER["group_sizes"] if args.paper else args.group_sizes
    return grid(total, sizes)


def _key(row: dict) -> tuple:
    return tuple("" if row.get(k) is None else str(row[k]) for k in KEY)


def _load(path) -> list[dict]:
    """The CSV's complete rows: a last line without its newline (a run killed mid-write) and a
    row with empty fields are not points that were measured; ValueError for other columns."""
    if path is None or not path.is_file():
        return []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    reader = csv.DictReader(text.splitlines(keepends=True))
    if reader.fieldnames is not None and tuple(reader.fieldnames) != FIELDS:
        raise ValueError(f"{path} has columns {reader.fieldnames}, not this sweep.py's; use "
                         "another --csv (the resume key needs every setting of a point)")
    return [r for r in reader if all(r.get(k) not in (None, "") for k in FIELDS
                                     if k not in _OPTIONAL)]


_OPTIONAL = ("min_gain", "token_budget", "dense_peak_mib", "reuse_suffix_peak_mib",
             "suffix_phase_reduction")
"""Columns that may be empty in a complete row (no policy, default budget, memory off)."""


def _drop_partial_line(path) -> None:
    """Cut a last line without its newline (killed mid-write) so the next row starts clean."""
    if path is None or not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        print(f"sweep.py: {path}: dropping an incomplete last row", file=sys.stderr)
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def _append(path, row: dict) -> None:
    if path is None:
        return
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def run(args) -> list[dict]:
    import torch

    spec, points = _spec(args), _points(args)
    if args.paper and not torch.cuda.is_available():
        raise ValueError("--paper runs 12,288-token trajectories in groups of up to 128 on an "
                         "8-layer 2k-wide model: it needs a GPU (use --list to see the grid)")
    torch.set_num_threads(args.threads)
    policy = None if args.no_policy else ReusePolicy(dims=spec.dims(), min_gain=args.min_gain,
                                                     token_budget=args.token_budget)
    done = {_key(r) for r in _load(args.csv)}
    _drop_partial_line(args.csv)
    with Progress(len(points), name="sweep", unit="point") as progress:
        return _run_points(args, spec, points, policy, done, progress)


def _run_points(args, spec: ModelSpec, points: list, policy, done: set, progress) -> list[dict]:
    import os

    models, rows = None, []
    for prefix, suffix, g in points:
        row = {"total": prefix + suffix, "prefix": prefix, "suffix": suffix, "group_size": g,
               "num_groups": args.num_groups, "policy_on": policy is not None,
               "compile": args.compile, "model": "x".join(str(v) for v in spec.__dict__.values()),
               "min_gain": args.min_gain if policy is not None else None,
               "token_budget": args.token_budget if policy is not None else None,
               "seed": args.seed, "reps": args.reps, "warmup": args.warmup,
               "memory": not (args.no_memory or args.compile), "threads": args.threads}
        if _key(row) in done:
            progress.step(f"P={prefix} S={suffix} G={g}: in the CSV")
            continue
        if models is None:
            models = Models(spec, max(p + s for p, s, _ in points), seed=args.seed,
                            compile=args.compile)
        row.update(measure_point(models, spec.dims(), prefix_len=prefix, suffix_len=suffix,
                                 group_size=g, num_groups=args.num_groups, policy=policy,
                                 reps=args.reps, warmup=args.warmup,
                                 memory=not (args.no_memory or args.compile),
                                 seed=args.seed))
        row.update(prefix_share=prefix / (prefix + suffix), speedup=row["dense_s"] / row["reuse_s"],
                   cpu_speedup=row["dense_cpu_s"] / row["reuse_cpu_s"], load_avg=os.getloadavg()[0])
        row["efficiency"] = row["cpu_speedup"] / row["ideal"]
        _append(args.csv, row)
        rows.append(row)
        progress.step(f"P={prefix} S={suffix} G={g}: speedup {row['cpu_speedup']:.2f}x (wall "
                      f"{row['speedup']:.2f}x), ideal {row['ideal']:.2f}x; {row['policy']}")
    return rows


def check_outputs(args) -> None:
    """--csv (appended row by row; its directory is created) and --png-dir can be written,
    before the first point is measured."""
    if args.csv is not None:
        if args.csv.is_dir():
            raise ValueError(f"--csv {args.csv} is a directory; give a file name")
        check_output_dir(args.csv.parent, f"--csv {args.csv}: its directory")
    check_output_dir(args.png_dir, "--png-dir")


def main(argv=None) -> int:
    args = _args(argv)
    if args.list:
        for prefix, suffix, g in _points(args):
            print(f"prefix {prefix:>6} suffix {suffix:>6} G={g}")
        return 0
    try:
        check_outputs(args)
        run(args)
    except ValueError as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return 1
    if args.png_dir and args.csv:
        from sweep_plots import write_plots

        for path in write_plots(_load(args.csv), args.png_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
