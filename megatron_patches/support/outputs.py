"""Output paths checked before the work: a run must not compute for minutes and then fail to
write its result (a read-only or full disk, a directory where a file goes, a missing parent).

    check_output_file(args.json, "--json")        # ValueError before any compute
    check_output_dir(args.save, "--save")          # a directory the run creates or fills

The check is a write, not `os.access` (which says yes to root on a read-only mount, an immutable
directory or a full disk): a small temporary file is created, written, flushed to disk and
removed in the directory the output goes to (for a directory that does not exist yet: its
nearest existing ancestor, where it would be created). Used by the tools (tools/outputs.py) and
the Megatron-LM entry point (`--save`). Imports neither torch nor Megatron.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Union

__all__ = ["check_output_file", "check_output_dir", "PROBE_BYTES"]

PathLike = Union[str, Path]
PROBE_BYTES = 64 * 1024
"""What the probe writes: a first write of this size must fit (a full disk fails it)."""


def _probe(directory: Path, flag: str, path: Path) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".write-probe-")
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write in {directory} ({error.strerror}); give a "
                         "writable location (checked before the work starts)") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise ValueError(f"{flag} {path}: writing {PROBE_BYTES // 1024} KiB in {directory} "
                         f"failed ({error.strerror}); free space or give another location "
                         "(checked before the work starts)") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_output_file(path: Optional[PathLike], flag: str) -> None:
    """ValueError unless the file `path` (given as `flag`) can be written: not a directory, its
    directory exists, and a first write there succeeds."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        what = "is not a directory" if path.parent.exists() else "does not exist"
        raise ValueError(f"{flag} {path}: the directory {path.parent} {what}; create it first "
                         "(checked before the work starts)")
    _probe(path.parent, flag, path)


def check_output_dir(path: Optional[PathLike], flag: str) -> None:
    """ValueError unless the directory `path` (given as `flag`) can be filled: it is a directory
    or does not exist yet, the nearest existing ancestor is a directory, a first write succeeds
    there (in `path` itself when it exists)."""
    if path is None:
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so the directory cannot be "
                         "created; give another path (checked before the work starts)")
    _probe(existing, flag, path)
