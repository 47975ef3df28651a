"""How the version tests get their Megatron-LM checkouts (tests/megatron_trees.py): the offline
tarball, else the pinned commit fetched from the repository, else a skip that names why, summed
up in one line at the end of the session. The fetch runs against a local git repository standing
in for GitHub (CI reaches no network)."""
import shutil
import subprocess
from types import SimpleNamespace

import pytest

import megatron_trees
from megatron_patches.patching import registry

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _fake_remote(path, branch):
    """A repository with two commits on `branch` (the pinned one is not the tip); returns the
    first commit's short id."""
    path.mkdir()
    _git(path, "init", "-q", "-b", branch)
    info = path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "release")
    pinned = _git(path, "rev-parse", "--short=12", "HEAD")
    info.write_text("MAJOR = 0\nMINOR = 19\nPATCH = 2\n")
    _git(path, "commit", "-q", "-am", "later")
    return pinned


def test_the_pinned_commit_is_fetched_when_no_tarball_is_there(tmp_path):
    remote = tmp_path / "Megatron-LM"
    pinned = _fake_remote(remote, "core_r0.19.0")
    (tmp_path / "out").mkdir()
    tarball = megatron_trees.fetch_tarball("0.19.1", tmp_path / "out", remote=str(remote),
                                           pin=("core_r0.19.0", pinned))
    assert tarball.name == megatron_trees.TARBALLS["0.19.1"]
    root = megatron_trees.extract_tree(tarball, tmp_path / "tree")
    assert registry.megatron_version(root) == "0.19.1"  # the pinned commit, not the branch tip
    assert not (tmp_path / "out" / "clone").exists()
    (tmp_path / "again").mkdir()
    missing = megatron_trees.fetch_tarball("0.19.1", tmp_path / "again", remote=str(remote),
                                           pin=("core_r0.19.0", "0123456789ab"))
    assert isinstance(missing, str) and "commit 0123456789ab of core_r0.19.0" in missing


def test_pinned_commits_are_the_documented_releases():
    assert megatron_trees.PINNED == {"0.19.1": ("core_r0.19.0", "f8837c04ef6c"),
                                     "0.20.0": ("main", "d98e8a64ddf3")}
    assert set(megatron_trees.PINNED) == set(megatron_trees.TARBALLS)


def test_without_tarball_or_repository_the_test_skips_saying_why(tmp_path, monkeypatch,
                                                                  tmp_path_factory):
    monkeypatch.setattr(megatron_trees, "tarball_dirs", lambda: [tmp_path / "empty"])
    monkeypatch.setenv(megatron_trees.REMOTE_ENV, str(tmp_path / "unreachable.git"))
    with pytest.raises(pytest.skip.Exception) as skipped:
        megatron_trees.find_tarball("0.20.0", tmp_path_factory)
    reason = str(skipped.value)
    assert reason.startswith(f"{megatron_trees.SKIP_PREFIX} 0.20.0: no tarball "
                             "Megatron-LM-main-2026-08-22.tar.gz in ")
    assert f"{tmp_path / 'unreachable.git'} is not reachable" in reason


def _report(nodeid, reason, skipped=True):
    return SimpleNamespace(nodeid=nodeid, skipped=skipped,
                           longrepr=("f.py", 1, f"Skipped: {reason}") if skipped else None)


def test_the_skips_are_summed_up_in_one_line():
    prefix = megatron_trees.SKIP_PREFIX
    reports = [_report("tests/test_versions.py::a[0.19.1]", f"{prefix} 0.19.1: no tarball X"),
               _report("tests/test_versions.py::b[0.20.0]", f"{prefix} 0.20.0: no tarball Y"),
               _report("tests/test_patches.py::c", f"{prefix} 0.19.1: no tarball X"),
               _report("tests/test_gpu_check.py::d", "needs CUDA"),
               _report("tests/test_x.py::e", "", skipped=False)]
    line = megatron_trees.skip_summary(reports)
    assert line == ("3 tests skipped without the Megatron-LM checkouts (test_patches.py x1, "
                    "test_versions.py x2): 0.19.1: no tarball X; 0.20.0: no tarball Y")
    assert "\n" not in line
    assert megatron_trees.skip_summary(reports[3:]) is None
