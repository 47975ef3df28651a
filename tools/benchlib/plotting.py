"""Line charts for the tools' PNGs (sweep, replay, capacity frontier), with matplotlib.

    fig, axes = panels(2)                                   # 2 panels side by side
    line_chart(axes[0], title="loss", series={"dense": (xs, ys), "reuse": (xs, ys2)},
               xlabel="step", styles={"reuse": "dashed"})
    save(fig, "out.png")

Headless (the Agg backend): no display needed. The PNGs carry no version string, so the same
data gives the same file on the same matplotlib (pinned in the Makefile's setup).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["COLOURS", "panels", "line_chart", "save"]

COLOURS = plt.get_cmap("tab10").colors
PANEL_SIZE = (5.6, 3.8)  # inches per panel, at 100 dpi


def panels(columns: int, rows: int = 1):
    """(figure, flat list of axes), `columns` x `rows` panels."""
    fig, axes = plt.subplots(rows, columns, squeeze=False,
                             figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows))
    return fig, [ax for row in axes for ax in row]


def line_chart(ax, *, title: str, series: dict, xlabel: str = "", ylabel: str = "",
               log_y: bool = False, styles: Optional[dict] = None, markers: bool = False,
               colours: Optional[dict] = None) -> None:
    """One line per series name -> (xs, ys); points whose y is None, not finite, or <= 0 on a
    log axis are left out. `styles`: name -> a matplotlib linestyle ("dashed");
    `colours`: name -> index into COLOURS (default: the series' position)."""
    for k, (name, (xs, ys)) in enumerate(series.items()):
        points = [(x, y) for x, y in zip(xs, ys) if _usable(y, log_y)]
        if not points:
            continue
        colour = COLOURS[(colours or {}).get(name, k) % len(COLOURS)]
        ax.plot([x for x, _ in points], [y for _, y in points], label=str(name), color=colour,
                linestyle=(styles or {}).get(name, "solid"),
                marker="o" if markers or len(points) == 1 else None, markersize=4)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, color="0.9")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, ncol=2 if len(series) > 4 else 1)


def save(fig, path) -> Path:
    """Write `fig` as a PNG at `path` (its folder created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path


def _usable(y, log_y: bool) -> bool:
    return y is not None and math.isfinite(y) and (y > 0 or not log_y)
