"""The Megatron-LM source trees the version tests run on, and how tests find them.

Supported releases (megatron_patches.patching.declarations.SUPPORTED_RELEASES) come from two places:
* megatron-core 0.19.2: the wheel installed in this Python (`make setup`).
* 0.19.1 and 0.20.0: offline Megatron-LM tarballs (no repository is reachable from CI). They are
  looked for in `$MEGATRON_LM_TARBALLS`, else in `shared/megatron-lm/` beside the checkout or in
  any directory above it (`../shared/megatron-lm/` for a checkout next to the shared folder,
  `../../shared/...` for a worktree one level deeper). Without one, the pinned commit (`PINNED`)
  is fetched from the Megatron-LM repository (`$MEGATRON_LM_REMOTE`, default GitHub) into
  pytest's tmp directory when that repository answers within `REACH_TIMEOUT_S`; otherwise the
  tests that need it skip, and the session ends with ONE line naming them and why (conftest.py's
  terminal summary, `skip_summary`).

Each tarball is extracted once per test session into pytest's tmp directory (a fraction of a
second; nothing is cached across sessions, nothing is written outside tmp; a fetch is made
once per session too).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from megatron_patches.patching import registry
from megatron_patches.patching.trees import PINNED, TARBALLS, extract_tree, tarball_dirs  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
# (TARBALLS, PINNED, tarball_dirs, extract_tree: megatron_patches/patching/trees.py, which
# tools/megatron_tree.py uses to prepare a checkout for users)

REMOTE_ENV = "MEGATRON_LM_REMOTE"
DEFAULT_REMOTE = "https://github.com/NVIDIA/Megatron-LM.git"
REACH_TIMEOUT_S = 20
FETCH_TIMEOUT_S = 900
SKIP_PREFIX = "Megatron-LM checkout"
"""Every skip for a missing checkout starts with this (the terminal summary counts them)."""

EXPECT_ENV = "PREFIX_REUSE_EXPECT_MEGATRON"

REQUIRE_ENV = "PREFIX_REUSE_REQUIRE_FRAMEWORKS"
"""Set to 1 by `make test-frameworks` (CI): what a framework test needs must be there, so a
missing tarball or module FAILS the test instead of skipping it (a CI that skips them passes
without running them)."""


def missing(message: str) -> None:
    """Skip with `message`, or fail with it under `$PREFIX_REUSE_REQUIRE_FRAMEWORKS=1`."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} [{REQUIRE_ENV}=1: this test must run here, not skip]",
                    pytrace=False)
    pytest.skip(message)

__all__ = ["REPO", "TARBALLS", "PINNED", "REMOTE_ENV", "SKIP_PREFIX", "EXPECT_ENV", "REQUIRE_ENV",
           "missing",
           "tarball_dirs", "find_tarball", "fetch_tarball", "extract_tree", "tree_digest",
           "stock_tree", "patched_tree", "skip_summary", "pytest_sessionstart"]


def find_tarball(version: str, factory=None) -> Path:
    """The tarball of `version`: the offline one, else (with tmp_path_factory `factory`) one
    made from the pinned commit fetched from the repository; a skip (a failure under
    `$PREFIX_REUSE_REQUIRE_FRAMEWORKS=1`) naming the places looked at and why the fetch did not
    happen when neither is there."""
    name = TARBALLS[version]
    for directory in tarball_dirs():
        if (directory / name).is_file():
            return directory / name
    fetched = "no fetch asked"
    if factory is not None:
        fetched = fetch_tarball(version, factory.mktemp(f"fetch-{version}"))
        if isinstance(fetched, Path):
            return fetched
    looked = ", ".join(str(d) for d in tarball_dirs()[:3])
    missing(f"{SKIP_PREFIX} {version}: no tarball {name} in {looked}, ... and {fetched}; "
            "set MEGATRON_LM_TARBALLS=DIR (or reach the repository)")


def _git(*args: str, timeout_s: float, cwd: Optional[Path] = None) -> Tuple[bool, str]:
    """(succeeded, stdout or the error's first line); never prompts for credentials."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
    return done.returncode == 0, done.stdout.strip() if done.returncode == 0 else lines[0]


def fetch_tarball(version: str, into: Path, *, remote: Optional[str] = None,
                  pin: Optional[Tuple[str, str]] = None) -> Path | str:
    """A tarball of the pinned commit of `version` (`PINNED`, or `pin` = (branch, commit)) made
    under `into` from `remote` ($MEGATRON_LM_REMOTE, default GitHub), or the reason there is
    none: no git, the repository not reachable within REACH_TIMEOUT_S, the commit not on its
    branch. The branch's history comes without file contents (a blobless clone); only the
    pinned commit's files are fetched."""
    remote = remote or os.environ.get(REMOTE_ENV, DEFAULT_REMOTE)
    branch, commit = pin or PINNED[version]
    if shutil.which("git") is None:
        return "git is not installed (needed to fetch the pinned commit)"
    ok, out = _git("ls-remote", "--exit-code", remote, f"refs/heads/{branch}",
                   timeout_s=REACH_TIMEOUT_S)
    if not ok:
        return f"{remote} is not reachable ({out})"
    clone = into / "clone"
    ok, out = _git("clone", "-q", "--filter=blob:none", "--no-checkout", "--single-branch",
                   "--branch", branch, remote, str(clone), timeout_s=FETCH_TIMEOUT_S)
    if ok:
        ok, out = _git("checkout", "-q", "--detach", commit, cwd=clone, timeout_s=FETCH_TIMEOUT_S)
    if not ok:
        return f"commit {commit} of {branch} could not be fetched from {remote} ({out})"
    tarball = into / TARBALLS[version]
    ok, out = _git("archive", "--format=tar.gz", "--prefix=Megatron-LM/", "-o", str(tarball),
                   "HEAD", cwd=clone, timeout_s=FETCH_TIMEOUT_S)
    shutil.rmtree(clone, ignore_errors=True)
    return tarball if ok else f"git archive of {commit} failed ({out})"


def tree_digest(root: Path) -> Dict[str, str]:
    """relative path -> sha256 of every file under root/megatron (the exact-inverse check)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "megatron").rglob("*")) if p.is_file()}


_STOCK: Dict[str, Path] = {}


def stock_tree(version: str, factory) -> Path:
    """The session's read-only stock extraction of `version` (tmp_path_factory as factory)."""
    if version not in _STOCK:
        tarball = find_tarball(version, factory)
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


def skip_summary(reports) -> Optional[str]:
    """One line for the test reports skipped for a missing Megatron-LM checkout, or None."""
    reasons, files = {}, {}
    for report in reports:
        if not report.skipped or not isinstance(report.longrepr, tuple):
            continue
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        if reason.startswith(SKIP_PREFIX):
            version = reason[len(SKIP_PREFIX):].split(":")[0].strip()
            reasons[version] = reason.split(": ", 1)[1]
            name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
            files[name] = files.get(name, 0) + 1
    if not files:
        return None
    tests = ", ".join(f"{name} x{count}" for name, count in sorted(files.items()))
    why = "; ".join(f"{version}: {reason}" for version, reason in sorted(reasons.items()))
    return (f"{sum(files.values())} tests skipped without the Megatron-LM checkouts ({tests}): "
            f"{why}")


def pytest_sessionstart(session):
    """Loaded as a plugin (`pytest -p megatron_trees`) by runs on a tree: refuse to start unless
    this process imports megatron.core from `$PREFIX_REUSE_EXPECT_MEGATRON`."""
    expected = os.environ.get(EXPECT_ENV)
    if not expected:
        return
    from megatron_patches.support.cpu_support import enable_cpu_support

    enable_cpu_support()  # before the first import of megatron.core
    import megatron.core

    if not megatron.core.__file__.startswith(expected):
        raise pytest.UsageError(f"megatron.core is {megatron.core.__file__}, not under {expected}")
    print(f"megatron.core {registry.imported_version()} from {megatron.core.__file__}")
