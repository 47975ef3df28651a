"""Progress of a long run (sweep points, replay steps, bench steps, capacity frontier).

On a terminal: a tqdm bar with the rate and ETA, each item's note printed above it. Elsewhere
(a pipe, a log file, CI): one plain line per item, `name i/n [elapsed<eta]: note`, flushed at
once so a `tail -f` or a hung run shows how far it got.

    with Progress(len(points), name="sweep", unit="point") as progress:
        for point in points:
            ...
            progress.step(f"G={g}: speedup {s:.2f}x")
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """`42s`, `3m05s`, `2h01m`."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class Progress:
    """`total` items of a run named `name`; `step()` after each. `tty=None` asks the stream."""

    def __init__(self, total: int, *, name: str, unit: str = "step", stream: Optional[TextIO] = None,
                 tty: Optional[bool] = None, start: int = 0) -> None:
        if total < 0 or not 0 <= start <= total:
            raise ValueError(f"progress of {name}: need 0 <= start ({start}) <= total ({total})")
        self.total, self.name, self.unit, self.done = total, name, unit, start
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._started, self._first = time.perf_counter(), start
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc=name, unit=unit, file=self.stream,
                             dynamic_ncols=True)

    def step(self, note: str = "") -> None:
        """One item done; `note` (the item's result) is printed with it."""
        self.done += 1
        if self._bar is not None:
            if note:
                self._bar.write(note, file=self.stream)
            self._bar.update(1)
            return
        print(self.line(note), file=self.stream, flush=True)

    def line(self, note: str = "") -> str:
        """The plain line for the items done so far."""
        elapsed = time.perf_counter() - self._started
        ran = self.done - self._first
        eta = elapsed / ran * (self.total - self.done) if ran else None
        when = f"{format_seconds(elapsed)}<{'?' if eta is None else format_seconds(eta)}"
        text = f"{self.name} {self.done}/{self.total} {self.unit}s [{when}]"
        return f"{text}: {note}" if note else text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
