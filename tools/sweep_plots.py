"""PNG plots of a tools/sweep.py CSV (matplotlib: tools/benchlib/plotting.py).

Per setting (policy on/off, eager/compiled): speedup{tag}.png (measured CPU-time speedup, solid,
and the FLOP model's ideal speedup of plain reuse, dashed, vs prefix share, one colour per
group size), memory{tag}.png (suffix-phase reduction of held-for-backward bytes, %),
efficiency{tag}.png (measured / ideal of the plan run, with the 0.9 target).

Re-plot a committed CSV without measuring again (tools/sweep.py --png-dir plots after a run):

    python tools/sweep_plots.py docs/sweep/sweep.csv docs/sweep
"""
from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, however run

from benchlib.plotting import line_chart, panels, save  # noqa: E402

__all__ = ["write_plots", "main"]


def _tag(policy_on: str, compiled: str) -> str:
    return ("" if policy_on == "True" else "-nopolicy") + ("-compile" if compiled == "True" else "")


def _series(rows: list, column: str, scale: float = 1.0) -> dict:
    by_g = defaultdict(list)
    for r in rows:
        if r.get(column) not in (None, ""):
            by_g[int(r["group_size"])].append((float(r["prefix_share"]), float(r[column]) * scale))
    return {g: sorted(points) for g, points in sorted(by_g.items())}


def _xy(points: list) -> tuple:
    return [x for x, _ in points], [y for _, y in points]


def write_plots(rows: list, directory: Path) -> list[Path]:
    """Write the PNGs of every setting present in `rows` (CSV dicts); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = defaultdict(list)
    for r in rows:
        settings[_tag(r["policy_on"], r["compile"])].append(r)
    written = []
    for tag, group in settings.items():
        speed, ideal = _series(group, "cpu_speedup"), _series(group, "ideal_full_reuse")
        fig, (ax,) = panels(1)
        series, styles, colours = {}, {}, {}
        for k, g in enumerate(speed):
            series[f"G={g}"] = _xy(speed[g])
            series[f"G={g} ideal"] = _xy(ideal[g])
            styles[f"G={g} ideal"] = "dashed"
            colours[f"G={g}"] = colours[f"G={g} ideal"] = k
        line_chart(ax, title="speedup vs dense (CPU time); dashed: ideal", series=series,
                   styles=styles, colours=colours, xlabel="prefix share", ylabel="speedup",
                   markers=True)
        written.append(save(fig, directory / f"speedup{tag}.png"))
        memory = _series(group, "suffix_phase_reduction", 100.0)
        if memory:
            fig, (ax,) = panels(1)
            line_chart(ax, title="suffix-phase memory reduction", xlabel="prefix share",
                       ylabel="reduction (%)", markers=True,
                       series={f"G={g}": _xy(p) for g, p in memory.items()})
            written.append(save(fig, directory / f"memory{tag}.png"))
        eff = _series(group, "efficiency")
        fig, (ax,) = panels(1)
        ax.axhline(0.9, color="0.45", linestyle="dashed", linewidth=1, label="target 0.9")
        line_chart(ax, title="efficiency = speedup / ideal", xlabel="prefix share",
                   ylabel="efficiency", markers=True,
                   series={f"G={g}": _xy(p) for g, p in eff.items()})
        written.append(save(fig, directory / f"efficiency{tag}.png"))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot a tools/sweep.py CSV (no measuring).")
    p.add_argument("csv", type=Path)
    p.add_argument("png_dir", type=Path)
    args = p.parse_args(argv)
    if not args.csv.is_file():
        p.error(f"{args.csv}: no such file; give the CSV tools/sweep.py --csv wrote")
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    for path in write_plots(rows, args.png_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
