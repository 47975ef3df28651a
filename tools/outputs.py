"""Output files of the tools: checked before the work starts, written whole or not at all.

    check_output(args.json, "--json", inputs=[args.trace])   # ValueError before any compute
    write_text_atomic(args.json, text)                        # temp file beside it + rename
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Union

__all__ = ["check_output", "write_text_atomic"]

PathLike = Union[str, Path]


def check_output(path: Optional[PathLike], flag: str, *, inputs: Iterable[PathLike] = ()) -> None:
    """ValueError unless `path` (given as `flag`) can be written: its directory exists, it is not
    a directory, and it is none of `inputs` (writing would replace what is being read)."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {path.parent} does not exist; create it "
                         "first (checked before the work starts)")
    for given in inputs:
        given = Path(given)
        if given.exists() and path.exists() and os.path.samefile(given, path) or \
                given.resolve() == path.resolve():
            raise ValueError(f"{flag} {path} is also an input; write the output to another file")


def write_text_atomic(path: PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it to `path`: a reader sees the
    old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
