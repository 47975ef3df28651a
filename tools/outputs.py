"""Output files of the tools: checked before the work starts, written whole or not at all.

    check_output(args.json, "--json", inputs=[args.trace])   # ValueError before any compute
    check_output_dir(args.png_dir, "--png-dir")               # a directory filled later
    write_text_atomic(args.json, text)                        # temp file beside it + rename

The checks write a probe file where the output goes (megatron_patches/support/outputs.py): a
read-only or full disk is refused before the work, for root too.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
import sys
from typing import Iterable, Optional, Union

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_patches.support.outputs import check_output_dir, check_output_file  # noqa: E402

__all__ = ["check_output", "check_output_dir", "write_text_atomic"]

PathLike = Union[str, Path]


def check_output(path: Optional[PathLike], flag: str, *, inputs: Iterable[PathLike] = ()) -> None:
    """ValueError unless `path` (given as `flag`) can be written: its directory exists, it is not
    a directory, it is none of `inputs` (writing would replace what is being read), and a first
    write in its directory succeeds."""
    if path is None:
        return
    path = Path(path)
    for given in inputs:
        given = Path(given)
        if given.exists() and path.exists() and os.path.samefile(given, path) or \
                given.resolve() == path.resolve():
            raise ValueError(f"{flag} {path} is also an input; write the output to another file")
    check_output_file(path, flag)  # a write where it goes: read-only / full disk refused now


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
