"""`make test-frameworks` (CI) sets PREFIX_REUSE_REQUIRE_FRAMEWORKS=1: a Megatron-LM RL test
whose offline tarball (or megatron/rl's modules) is missing must FAIL there, not skip, as the
verl tests do (issue 36: a CI without the tarball passed without running them). Outside CI the
same absence is a skip naming where it looked."""
from __future__ import annotations

import pytest

import megatron_trees


def _absent(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_LM_TARBALLS", str(tmp_path))
    monkeypatch.setattr(megatron_trees, "tarball_dirs", lambda: [tmp_path])


def test_missing_tarball_fails_under_require(monkeypatch, tmp_path):
    _absent(monkeypatch, tmp_path)
    monkeypatch.setenv(megatron_trees.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="must run here, not skip") as info:
        megatron_trees.find_tarball("0.20.0")  # no factory: no fetch
    assert str(tmp_path) in str(info.value)


def test_missing_tarball_skips_outside_ci(monkeypatch, tmp_path):
    _absent(monkeypatch, tmp_path)
    monkeypatch.delenv(megatron_trees.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=megatron_trees.SKIP_PREFIX):
        megatron_trees.find_tarball("0.20.0")


def test_every_megatron_rl_test_goes_through_missing():
    """No direct pytest.skip / importorskip left in the Megatron-LM RL test files."""
    from pathlib import Path
    for path in sorted(Path(__file__).parent.glob("test_*train_rl*.py")):
        text = path.read_text(encoding="utf-8")
        assert "pytest.skip(f\"Megatron-LM" not in text and "importorskip" not in text, path
