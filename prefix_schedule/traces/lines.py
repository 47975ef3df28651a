"""Reading JSON-lines files safely: every way a file can be broken is a ValueError naming it.

Traces and the generic import layout are read a line at a time through `iter_lines`, which
* bounds a line's length ([Note: line-length limit]), so one enormous line cannot exhaust memory;
* names the file and line of bytes that are not UTF-8 and of a corrupt or truncated `.gz`;
and `parse_line`, which turns JSON the parser cannot take (too deeply nested, a number with
thousands of digits) into the same kind of error.

[Note: line-length limit] A trace line is one group: a 32k-token prompt with 64 responses of 8k
tokens and both log-prob arrays is about 30 MB of JSON. Lines longer than `max_line_bytes()`
(256 MiB unless $PREFIX_REUSE_MAX_LINE_BYTES says otherwise) are refused before they are read
whole; the parsed Python lists take ~10x the text, so a longer line would not fit a host anyway.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

__all__ = ["LINE_LIMIT_ENV", "iter_lines", "max_line_bytes", "parse_line"]

PathLike = Union[str, Path]
LINE_LIMIT_ENV = "PREFIX_REUSE_MAX_LINE_BYTES"
_DEFAULT_LINE_LIMIT = 1 << 28


def max_line_bytes() -> int:
    """The longest line read ([Note: line-length limit])."""
    text = os.environ.get(LINE_LIMIT_ENV)
    if text is None:
        return _DEFAULT_LINE_LIMIT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${LINE_LIMIT_ENV}={text!r}; give the longest line to read in bytes, "
                         "an int >= 1 (or unset it for 256 MiB)")
    return value


def iter_lines(path: PathLike) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of every line; gzip when the name ends in .gz."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file; give the path of a trace (.jsonl or .jsonl.gz)")
    limit = max_line_bytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        number = 0
        while True:
            number += 1
            raw = _read_line(f, path, number, limit)
            if not raw:
                return
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise ValueError(f"{path}:{number}: line longer than {limit:,} bytes; split the "
                                 f"group it holds, or raise ${LINE_LIMIT_ENV} if the host has "
                                 "the memory ([Note: line-length limit] in traces/lines.py)")
            yield number, _decode(raw, path, number)


def _read_line(f, path: Path, number: int, limit: int) -> bytes:
    try:
        return f.readline(limit + 1)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        what = "gzip data" if path.suffix == ".gz" else "file"
        raise ValueError(f"{path}:{number}: the {what} is corrupt or truncated ({exc}); copy or "
                         "compress it again (gzip -t checks a .gz)") from None


def _decode(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}:{number}: byte {exc.start} of the line ({raw[exc.start:exc.start + 4]!r}) "
                         "is not UTF-8; traces are UTF-8 JSON text (was the file written with "
                         "another encoding, or is it binary?)") from None


def _not_finite(text: str) -> float:
    # Python's json accepts NaN / Infinity; keep them so the field checks can name them.
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[text]


def parse_line(line: str, *, where: str) -> Any:
    """One JSON value, or a ValueError starting with `where`."""
    try:
        return json.loads(line, parse_constant=_not_finite)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); every line "
                         "of a trace is one JSON object") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to parse; a trace line is an object of "
                         "flat lists (token ids, one list per response)") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise ValueError(f"{where}: a value cannot be read ({exc}); token ids must fit in int64 "
                         "and numbers in float64") from None
