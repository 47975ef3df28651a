"""A patched Megatron-LM checkout, ready for examples/megatron_lm/ (docs/FRAMEWORKS.md,
Megatron-LM RL; docs/MEGATRON_LM.md).

    python tools/megatron_tree.py --release main --out DIR [--tarball PATH]

Extracts the offline tarball of the release (`--tarball`, else `$MEGATRON_LM_TARBALLS`, else
`shared/megatron-lm/` beside this checkout or above it) to DIR/Megatron-LM, applies this
repository's patches (`python -m megatron_patches apply --root DIR/Megatron-LM`) and builds
Megatron's C++ dataset helpers; prints the checkout's path. Exits 2 naming what to fix (no
tarball: the `git clone` commands of the pinned commit instead; DIR/Megatron-LM exists).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first

from megatron_patches.patching.trees import RELEASES, prepare_tree  # noqa: E402

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/megatron_tree.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", choices=sorted(RELEASES), required=True,
                        help="main: Megatron-LM main of 2026-08-22 (train_rl.py, megatron/rl)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the checkout goes to OUT/Megatron-LM")
    parser.add_argument("--tarball", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        root = prepare_tree(args.release, args.out, args.tarball)
    except ValueError as error:
        print(f"megatron_tree.py: error: {error}", file=sys.stderr)
        return 2
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
