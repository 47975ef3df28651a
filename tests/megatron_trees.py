"""The Megatron-LM source trees the version tests run on, and how tests find them.

Supported releases (megatron_patches.declarations.SUPPORTED_RELEASES) come from two places:
* megatron-core 0.19.2: the wheel installed in this Python (`make setup`).
* 0.19.1 and 0.20.0: offline Megatron-LM tarballs (no repository is reachable from CI). They are
  looked for in `$MEGATRON_LM_TARBALLS`, else in `shared/megatron-lm/` beside the checkout or in
  any directory above it (`../shared/megatron-lm/` for a checkout next to the shared folder,
  `../../shared/...` for a worktree one level deeper). Tests that need one skip with the places
  looked at when it is absent.

Each tarball is extracted once per test session into pytest's tmp directory (a fraction of a
second; nothing is cached across sessions, nothing is written outside tmp).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path
from typing import Dict, List

import pytest

from megatron_patches import registry

REPO = Path(__file__).resolve().parents[1]
TARBALLS = {
    "0.19.1": "Megatron-LM-core_r0.19.0.tar.gz",
    "0.20.0": "Megatron-LM-main-2026-08-22.tar.gz",
}
"""megatron-core version -> offline tarball (paper-scale.md, "Megatron-LM sources")."""

EXPECT_ENV = "PREFIX_REUSE_EXPECT_MEGATRON"

__all__ = ["REPO", "TARBALLS", "EXPECT_ENV", "tarball_dirs", "find_tarball", "extract_tree",
           "tree_digest", "stock_tree", "patched_tree", "pytest_sessionstart"]


def tarball_dirs() -> List[Path]:
    """Where tarballs are looked for, in order."""
    env = os.environ.get("MEGATRON_LM_TARBALLS")
    dirs = [Path(env)] if env else []
    return dirs + [d / "shared" / "megatron-lm" for d in (REPO, *REPO.parents)]


def find_tarball(version: str) -> Path:
    """The tarball of `version`; pytest.skip naming the places looked at when there is none."""
    name = TARBALLS[version]
    for directory in tarball_dirs():
        if (directory / name).is_file():
            return directory / name
    looked = ", ".join(str(d) for d in tarball_dirs()[:4])
    pytest.skip(f"offline Megatron-LM tarball {name} (megatron-core {version}) not found in "
                f"{looked}, ...; set MEGATRON_LM_TARBALLS=DIR")


def extract_tree(tarball: Path, into: Path) -> Path:
    """Extract `tarball` under `into`; returns the checkout root (the directory with megatron/)."""
    with tarfile.open(tarball) as archive:
        archive.extractall(into, filter="data")
    (root,) = [p.parents[2] for p in into.glob("*/megatron/core/package_info.py")]
    return root


def tree_digest(root: Path) -> Dict[str, str]:
    """relative path -> sha256 of every file under root/megatron (the exact-inverse check)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "megatron").rglob("*")) if p.is_file()}


_STOCK: Dict[str, Path] = {}


def stock_tree(version: str, factory) -> Path:
    """The session's read-only stock extraction of `version` (tmp_path_factory as factory)."""
    if version not in _STOCK:
        tarball = find_tarball(version)
        root = extract_tree(tarball, factory.mktemp(f"stock-{version}"))
        assert registry.megatron_version(root) == version, f"{tarball}: not megatron-core {version}"
        _STOCK[version] = root
    return _STOCK[version]


def patched_tree(version: str, factory) -> Path:
    """A fresh copy of the stock tree of `version` with every patch of its set applied."""
    root = factory.mktemp(f"patched-{version}") / "Megatron-LM"
    shutil.copytree(stock_tree(version, factory), root)
    registry.apply(root)
    assert registry.check(root)
    return root


def pytest_sessionstart(session):
    """Loaded as a plugin (`pytest -p megatron_trees`) by runs on a tree: refuse to start unless
    this process imports megatron.core from `$PREFIX_REUSE_EXPECT_MEGATRON`."""
    expected = os.environ.get(EXPECT_ENV)
    if not expected:
        return
    from megatron_patches.cpu_support import enable_cpu_support

    enable_cpu_support()  # before the first import of megatron.core
    import megatron.core

    if not megatron.core.__file__.startswith(expected):
        raise pytest.UsageError(f"megatron.core is {megatron.core.__file__}, not under {expected}")
    print(f"megatron.core {registry.imported_version()} from {megatron.core.__file__}")
