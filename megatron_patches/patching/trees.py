"""Megatron-LM source trees from the offline tarballs: where they are looked for, and a patched,
ready-to-run checkout made from one (tools/megatron_tree.py; tests/megatron_trees.py).

Tarballs are looked for in `$MEGATRON_LM_TARBALLS`, else in `shared/megatron-lm/` beside this
repository's checkout or in any directory above it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import List, Optional

from megatron_patches.patching import registry

REPO = Path(__file__).resolve().parents[2]
TARBALLS = {
    "0.19.1": "Megatron-LM-core_r0.19.0.tar.gz",
    "0.20.0": "Megatron-LM-main-2026-08-22.tar.gz",
}
"""megatron-core version -> offline tarball (paper-scale.md, "Megatron-LM sources")."""

PINNED = {"0.19.1": ("core_r0.19.0", "f8837c04ef6c"), "0.20.0": ("main", "d98e8a64ddf3")}
"""megatron-core version -> (branch, commit) of the same sources (declarations.py's releases)."""

RELEASES = {"core_r0.19.0": "0.19.1", "main": "0.20.0"}
"""The names users give (the branch) -> megatron-core version."""

__all__ = ["REPO", "TARBALLS", "PINNED", "RELEASES", "tarball_dirs", "find_offline_tarball",
           "extract_tree", "prepare_tree"]


def tarball_dirs() -> List[Path]:
    """Where tarballs are looked for, in order."""
    env = os.environ.get("MEGATRON_LM_TARBALLS")
    dirs = [Path(env)] if env else []
    return dirs + [d / "shared" / "megatron-lm" for d in (REPO, *REPO.parents)]


def find_offline_tarball(version: str) -> Optional[Path]:
    """The offline tarball of `version`, or None."""
    for directory in tarball_dirs():
        if (directory / TARBALLS[version]).is_file():
            return directory / TARBALLS[version]
    return None


def extract_tree(tarball: Path, into: Path) -> Path:
    """Extract `tarball` under `into`; returns the checkout root (the directory with megatron/)."""
    with tarfile.open(tarball) as archive:
        archive.extractall(into, filter="data")
    (root,) = [p.parents[2] for p in into.glob("*/megatron/core/package_info.py")]
    return root


def prepare_tree(release: str, out: Path, tarball: Optional[Path] = None) -> Path:
    """A patched Megatron-LM checkout of `release` (a RELEASES key) at `out`/Megatron-LM with its
    C++ dataset helpers built; returns its root. ValueError (before writing anything) naming
    what to fix: an unknown release, no tarball, `out` already holding a checkout."""
    if release not in RELEASES:
        raise ValueError(f"release {release!r}: give one of {', '.join(RELEASES)}")
    version = RELEASES[release]
    tarball = tarball or find_offline_tarball(version)
    if tarball is None or not Path(tarball).is_file():
        branch, commit = PINNED[version]
        looked = ", ".join(str(d) for d in tarball_dirs()[:3])
        raise ValueError(
            f"no tarball {TARBALLS[version]} (looked in {looked}, ...): give --tarball PATH or "
            f"set MEGATRON_LM_TARBALLS=DIR; online: git clone --branch {branch} "
            f"https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout {commit} && "
            "python -m megatron_patches apply --root Megatron-LM")
    if importlib.util.find_spec("pybind11") is None:  # before anything is written
        raise ValueError(f"{sys.executable} lacks pybind11, which Megatron's C++ dataset helpers "
                         "need: pip install pybind11==3.1.0 (make setup installs it)")
    if (Path(out) / "Megatron-LM").exists():
        raise ValueError(f"{Path(out) / 'Megatron-LM'} exists: give another --out (or remove it)")
    Path(out).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".megatron-tree-", dir=out))
    root = extract_tree(Path(tarball), staging).rename(Path(out) / "Megatron-LM")
    shutil.rmtree(staging)
    if registry.megatron_version(root) != version:
        raise ValueError(f"{tarball}: not megatron-core {version}")
    registry.apply(root)
    if not registry.check(root):
        raise ValueError(f"the patches did not apply cleanly to {root}")
    _build_helpers(root)
    return root


def _build_helpers(root: Path) -> None:
    """megatron/core/datasets' C++ helpers (rank 0 of a run would build them with the first
    `python3` on PATH, which must have pybind11): built here with this Python first on PATH."""
    helpers = root / "megatron" / "core" / "datasets"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(["make", "-C", str(helpers)], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"make -C {helpers} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
