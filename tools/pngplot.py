"""Line charts as PNG without matplotlib: axes, ticks, log scale, legend, a 3x5 pixel font.

Used by tools/replay.py and tools/sweep.py (tools/plan.py's PNG writer writes the file). Small
flat-colour images: they compress to a few kB, so they can be committed under docs/.

    fig = Figure(2, 1)                              # 2 columns x 1 row of panels
    fig.chart(0, title="loss", series={"dense": (xs, ys), "reuse": (xs, ys2)}, xlabel="step")
    fig.chart(1, title="diff", series=..., log_y=True)
    fig.save("out.png")
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from plan import write_png

__all__ = ["Figure", "COLOURS"]

COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (23, 190, 207)]
PANEL_W, PANEL_H, SCALE = 520, 340, 2  # pixels; SCALE = font pixel size
_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111",
    "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011",
    "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "+": "000010111010000",
    ":": "000010000010000", "/": "001001010100100", "(": "010100100100010",
    ")": "010001001001010", "%": "101001010100101", "=": "000111000111000",
    ",": "000000000010100", "_": "000000000000111", " ": "000000000000000",
    "x": "000101010101000", "<": "001010100010001", ">": "100010001010100",
    "[": "110100100100110", "]": "011001001001011", "'": "010010000000000",
}


class Figure:
    """A grid of chart panels on a white RGB canvas."""

    def __init__(self, columns: int, rows: int = 1) -> None:
        self.columns, self.rows = columns, rows
        self.width, self.height = columns * PANEL_W, rows * PANEL_H
        self.pixels = bytearray(b"\xff" * (self.width * self.height * 3))

    def save(self, path: Path) -> None:
        write_png(Path(path), self.width, self.height, self.pixels)

    # ---- drawing primitives
    def _rect(self, x0: int, y0: int, x1: int, y1: int, colour) -> None:
        x0, x1 = max(0, x0), min(self.width, x1)
        if x1 <= x0:
            return
        row = bytes(colour) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            start = (y * self.width + x0) * 3
            self.pixels[start:start + len(row)] = row

    def _line(self, x0: float, y0: float, x1: float, y1: float, colour, width: int = 2,
              dash: int = 0) -> None:
        """A line; with `dash` > 0, `dash` pixels on, `dash` off along its length."""
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(steps + 1):
            if dash and (i // dash) % 2:
                continue
            t = i / steps
            x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
            self._rect(x, y, x + width, y + width, colour)

    def text(self, x: int, y: int, text: str, colour=(20, 20, 20), scale: int = SCALE) -> int:
        """Draw `text` with its top-left corner at (x, y); returns its width in pixels."""
        for i, char in enumerate(text):
            glyph = _FONT.get(char, _FONT.get(char.upper(), _FONT[" "]))
            for bit, on in enumerate(glyph):
                if on == "1":
                    px, py = x + i * 4 * scale + (bit % 3) * scale, y + (bit // 3) * scale
                    self._rect(px, py, px + scale, py + scale, colour)
        return len(text) * 4 * scale

    # ---- charts
    def chart(self, index: int, *, title: str, series: dict, xlabel: str = "", ylabel: str = "",
              log_y: bool = False, y_range: Optional[tuple] = None, styles: Optional[dict] = None,
              markers: bool = False, colours: Optional[dict] = None) -> None:
        """Panel `index` (row-major): one line per series name -> (xs, ys); values that are
        None, not finite, or <= 0 on a log axis are skipped. `styles`: name -> "dashed";
        `colours`: name -> index into COLOURS (default: the series' position)."""
        left = (index % self.columns) * PANEL_W
        top = (index // self.columns) * PANEL_H
        box = (left + 78, top + 30, left + PANEL_W - 16, top + PANEL_H - 92)  # plot area
        points = {name: [(x, y) for x, y in zip(*xy) if _usable(y, log_y)]
                  for name, xy in series.items()}
        xs = [x for pts in points.values() for x, _ in pts] or [0, 1]
        ys = [y for pts in points.values() for _, y in pts] or [1.0]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y_lo, y_hi = y_range or _y_limits(ys, log_y)
        fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)  # noqa: E731
        sx = lambda x: box[0] + (x - x_lo) / (x_hi - x_lo) * (box[2] - box[0])  # noqa: E731
        sy = lambda y: box[3] - (fy(y) - fy(y_lo)) / (fy(y_hi) - fy(y_lo)) * (box[3] - box[1])  # noqa: E731
        self._axes(box, (x_lo, x_hi), (y_lo, y_hi), log_y, sx, sy)
        self.text(left + 78, top + 8, title)
        self.text((box[0] + box[2]) // 2 - len(xlabel) * 4, box[3] + 26, xlabel)
        self.text(left + 4, top + 16, ylabel, scale=1) if ylabel else None
        for k, (name, pts) in enumerate(points.items()):
            colour = COLOURS[(colours or {}).get(name, k) % len(COLOURS)]
            dashed = (styles or {}).get(name) == "dashed"
            for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
                self._line(sx(xa), sy(ya), sx(xb), sy(yb), colour, dash=6 if dashed else 0)
            for x, y in pts if markers or len(pts) == 1 else ():
                self._rect(int(sx(x)) - 3, int(sy(y)) - 3, int(sx(x)) + 4, int(sy(y)) + 4, colour)
            lx, ly = left + 8 + (k % 3) * 170, box[3] + 44 + (k // 3) * 14
            self._line(lx, ly + 4, lx + 18, ly + 4, colour, dash=4 if dashed else 0)
            self.text(lx + 24, ly, name)

    def _axes(self, box, xr, yr, log_y, sx, sy) -> None:
        grey, dark = (225, 225, 225), (60, 60, 60)
        for y in _ticks(*yr, log_y):
            py = int(sy(y))
            self._rect(box[0], py, box[2], py + 1, grey)
            label = _fmt(y)
            self.text(box[0] - 6 - len(label) * 4 * SCALE, py - 5, label)
        for x in _ticks(*xr, False):
            px = int(sx(x))
            self._rect(px, box[1], px + 1, box[3], grey)
            label = _fmt(x)
            self.text(px - len(label) * 4, box[3] + 6, label)
        self._rect(box[0], box[1], box[0] + 1, box[3] + 1, dark)
        self._rect(box[0], box[3], box[2], box[3] + 1, dark)


def _usable(y, log_y: bool) -> bool:
    return y is not None and math.isfinite(y) and (y > 0 or not log_y)


def _y_limits(ys: list, log_y: bool) -> tuple:
    lo, hi = min(ys), max(ys)
    if log_y:
        return 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi) + 1e-9)
    if hi == lo:
        return lo - 1, hi + 1
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _ticks(lo: float, hi: float, log: bool) -> list:
    if log:
        first, last = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
        step = max(1, (last - first) // 6 + 1)
        return [10.0 ** e for e in range(first, last + 1, step)]
    raw = (hi - lo) / 5
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-2:
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}E{int(exponent)}"
    return f"{value:.3g}"
