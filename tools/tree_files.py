"""Regenerate megatron_patches/patching/tree_files.py from the offline Megatron-LM tarballs.

    .venv/bin/python tools/tree_files.py [--tarballs DIR]   # default: ../shared/megatron-lm

Lists the `megatron/core/**/*.py` files that exist in one supported release family and not in
the other (0.19.x = the core_r0.19.0 tarball, whose file list equals the megatron-core 0.19.2
wheel's; 0.20.0 = the Megatron-LM main tarball). `python -m megatron_patches report` uses them to
flag a mixed tree: one release unpacked over another leaves the other's files behind.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import write_text_atomic  # noqa: E402

TARBALLS = {"0.19": "Megatron-LM-core_r0.19.0.tar.gz", "0.20": "Megatron-LM-main-2026-08-22.tar.gz"}
OUT = _REPO / "megatron_patches" / "patching" / "tree_files.py"

_HEADER = '''"""Files of one supported megatron-core release family that the other lacks (generated).

Regenerate: .venv/bin/python tools/tree_files.py. Used by `registry.stray_files`: a tree whose
version is one family's but that holds the other family's own files is a mixed tree (one release
unpacked over another).
"""

__all__ = ["ONLY_IN"]

'''


def core_files(tarball: Path) -> set[str]:
    """`megatron/core/...py` paths in a tarball, without its top directory."""
    with tarfile.open(tarball) as archive:
        names = (name.split("/", 1)[-1] for name in archive.getnames())
        return {n for n in names if n.startswith("megatron/core/") and n.endswith(".py")}


def render(files: dict[str, set[str]]) -> str:
    lines = [_HEADER, "ONLY_IN = {"]
    for family, others in ((a, [b for b in files if b != a]) for a in files):
        only = sorted(files[family].difference(*(files[o] for o in others)))
        lines.append(f"    {family!r}: (")
        lines += [f"        {path!r}," for path in only]
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tarballs", type=Path, default=_REPO.parent / "shared" / "megatron-lm")
    args = parser.parse_args(argv)
    paths = {family: args.tarballs / name for family, name in TARBALLS.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        print(f"tree_files.py: error: missing {', '.join(missing)}; pass --tarballs DIR", file=sys.stderr)
        return 2
    write_text_atomic(OUT, render({family: core_files(p) for family, p in paths.items()}))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
