"""The supported version range on real trees: megatron-core 0.19.2 (installed), and the offline
Megatron-LM checkouts core_r0.19.0 (0.19.1) and main of 2026-08-22 (0.20.0) (tests/megatron_trees.py
says where they are found; those cases skip without them).

* The patch CLI round trip on whole trees: apply, apply again, check, report, revert, revert
  again leaves every file under megatron/ byte-identical.
* Each release matches its signature snapshot, and its patched tree imports with live hooks.
* Prefix reuse == stock dense (the single-process equivalence cases, a PP=2 step, the HybridModel
  tests) with the 0.20 tree's patched megatron.core on PYTHONPATH, as a user of a checkout runs it.

Select with `-m versions`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_patches.patching import registry
from megatron_trees import EXPECT_ENV, REPO, patched_tree, stock_tree, tree_digest

pytestmark = pytest.mark.versions

INSTALLED = "installed"
RELEASES = [pytest.param(INSTALLED, id="installed-0.19.2"),
            pytest.param("0.19.1", id="core_r0.19.0"), pytest.param("0.20.0", id="main-0.20.0")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_patches", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _whole_stock_tree(release: str, factory) -> Path:
    root = factory.mktemp(f"whole-{release}") / "tree"
    if release == INSTALLED:  # site-packages/megatron, brought back to stock
        shutil.copytree(registry.default_root() / "megatron", root / "megatron",
                        ignore=shutil.ignore_patterns("__pycache__"))
        registry.revert(root)
    else:
        shutil.copytree(stock_tree(release, factory), root)
    return root


@pytest.mark.parametrize("release", RELEASES)
def test_cli_round_trip_leaves_the_whole_tree_byte_identical(release, tmp_path_factory):
    root = _whole_stock_tree(release, tmp_path_factory)
    stock = tree_digest(root)
    version = registry.megatron_version(root)
    steps = [("apply", 0, "applied (patched"), ("apply", 0, "applied (unchanged)"),
             ("check", 0, f"all {len(registry.patches_for(version))} megatron patches are applied"),
             ("report", 0, f"megatron-core {version} under"),
             ("revert", 0, "not applied (restored"), ("revert", 0, "not applied (unchanged)"),
             ("check", 1, "not applied")]
    for command, status, text in steps:
        run = _cli(command, "--root", str(root))
        assert run.returncode == status and text in run.stdout, (command, run.stdout, run.stderr)
        if command == "apply":
            patched = tree_digest(root)
            assert patched != stock and set(patched) == set(stock)
    assert tree_digest(root) == stock


_LIVE_CHECK = textwrap.dedent("""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("snap", sys.argv[1])
    snap = importlib.util.module_from_spec(spec); spec.loader.exec_module(snap)
    live = snap.collect()
    stored = json.loads(snap.snapshot_path(live["megatron_core_version"]).read_text())
    from megatron_patches.patching import registry
    import megatron.core
    print(json.dumps({"problems": snap.compare(stored, live), "file": megatron.core.__file__,
                      "version": live["megatron_core_version"], "on_disk": registry.check(),
                      "in_process": registry.is_applied_in_process()}))
""")


@pytest.mark.parametrize("release", RELEASES)
def test_signatures_match_the_snapshot_and_hooks_are_live(release, tmp_path_factory):
    # A subprocess: megatron.core must be imported after megatron_patches.support.cpu_support, and from
    # the tree under test (PYTHONPATH) rather than the installed one.
    env = dict(os.environ)
    if release != INSTALLED:
        tree = patched_tree(release, tmp_path_factory)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tree)])
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _LIVE_CHECK,
         str(REPO / "tools" / "snapshot_signatures.py")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["problems"], (
        f"upstream Megatron {result['version']} signatures changed; review the patches and the "
        "executor, then regenerate with `.venv/bin/python tools/snapshot_signatures.py [--root "
        "TREE]`:\n" + "\n".join(result["problems"])
    )
    if release == INSTALLED:
        # The venv copy is patched by `make setup`; whichever state it is in, the import agrees.
        assert result["in_process"] == result["on_disk"]
    else:
        assert result["file"].startswith(str(tree)) and result["version"] == release
        assert result["on_disk"] and result["in_process"]


def test_every_supported_release_has_a_snapshot_and_a_patch_set():
    snapshots = REPO / "megatron_patches" / "snapshots"
    for version in registry.SUPPORTED_VERSIONS:
        stored = json.loads((snapshots / f"megatron_core_{version}.json").read_text())
        assert stored["megatron_core_version"] == version
        patch_dir = REPO / "megatron_patches" / "patches" / registry.patch_set_name(version)
        assert sorted(p.stem for p in patch_dir.glob("*.patch")) == sorted(
            p.id for p in registry.patches_for(version))


def test_snapshot_comparison_reports_a_changed_signature():
    import importlib.util

    spec = importlib.util.spec_from_file_location("snap", REPO / "tools" / "snapshot_signatures.py")
    snap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(snap)
    stored = {"signatures": {"m:f": "(a, b)", "m:gone": "()"}, "dataclass_fields": {},
              "constants": {"m:S": {"A": "a"}}}
    live = {"signatures": {"m:f": "(a)", "m:new": "()"}, "dataclass_fields": {},
            "constants": {"m:S": {"A": "b"}}}
    problems = snap.compare(stored, live)
    assert len(problems) == 4 and problems[0].startswith("m:f changed")


_ON_THE_TREE = [
    "tests/test_equivalence.py::test_reuse_equals_dense",
    "tests/test_pipeline.py::test_pp2_several_groups_variable_lengths",
    "tests/test_hybrid.py",
    # Gated DeltaNet on main: its config normalises 'gated_delta_net' to 'gdn' (config_support.GDN_VARIANTS)
    "tests/test_gdn.py::test_gdn_reuse_equals_dense",
    # HybridStack's full recompute (checkpointed_forward), patterns without Mamba (triton on main)
    "tests/test_hybrid_recompute.py::test_hybrid_full_recompute_equals_dense[attention-mlp]",
    "tests/test_hybrid_recompute.py::test_hybrid_full_recompute_equals_dense["
    "gdn-attention-chunks-12]",
]


def test_reuse_equals_dense_on_megatron_lm_main(tmp_path_factory):
    """The tests `_ON_THE_TREE` lists, run by pytest with the patched 0.20.0 tree first on
    PYTHONPATH (forkserver ranks inherit it); every one must pass, none skip. The plugin
    `megatron_trees` stops the run unless megatron.core is imported from that tree."""
    tree = patched_tree("0.20.0", tmp_path_factory)
    # not this process's rendezvous: its MASTER_PORT may be in use by its own process group
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({EXPECT_ENV: str(tree),
                "PYTHONPATH": os.pathsep.join([str(tree), str(REPO / "tests")])})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "-p", "megatron_trees", *_ON_THE_TREE], cwd=REPO, capture_output=True,
                         text=True, timeout=900, env=env)
    output = run.stdout.strip().splitlines()
    assert f"megatron.core 0.20.0 from {tree}" in run.stdout, run.stdout[-3000:] + run.stderr
    summary = re.fullmatch(r"(\d+) passed(, \d+ warnings?)? in [\d.]+s( \([\d:]+\))?",
                           output[-1] if output else "")
    assert run.returncode == 0 and summary, run.stdout[-6000:] + run.stderr[-3000:]
    # 15 equivalence, PP=2 and GDN cases, 10 HybridModel tests, 2 HybridModel full recompute
    assert int(summary.group(1)) >= 27
