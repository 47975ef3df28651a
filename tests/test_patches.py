"""Declared Megatron source patches: apply/revert/status on copies of the real target files.

Nothing here writes to the installed megatron-core: every test works on a tmp tree holding copies
of the three target files and package_info.py, brought back to the released bytes (checked against
the wheel's RECORD hashes) whether or not the venv is patched.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_patches import registry
from megatron_patches.registry import APPLIED, CONFLICT, NOT_APPLIED, PATCHES

REPO = Path(__file__).resolve().parents[1]
INFO = "megatron/core/package_info.py"
TARGETS = [patch.target for patch in PATCHES]
BY_ID = {patch.id: patch for patch in PATCHES}

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)


def _release_hashes() -> dict[str, str]:
    """sha256 (RECORD encoding) of each copied file as shipped in the megatron-core wheel."""
    try:
        files = importlib.metadata.distribution("megatron-core").files or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {str(f): f.hash.value for f in files if f.hash and str(f) in TARGETS + [INFO]}


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def root(tmp_path) -> Path:
    """A tmp tree with stock copies of the targets (reverted if the venv is patched)."""
    installed = registry.default_root()
    for rel in TARGETS + [INFO]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / rel, tmp_path / rel)
    registry.revert(tmp_path)
    for rel, expected in _release_hashes().items():
        assert _record_hash((tmp_path / rel).read_bytes()) == expected, f"{rel} is not stock"
    return tmp_path


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {rel: ((root / rel).read_bytes(), (root / rel).stat().st_mtime_ns) for rel in TARGETS}


def _states(root: Path) -> dict[str, str]:
    return {s.patch_id: s.state for s in registry.status(root)}


def test_stock_tree_is_not_applied(root):
    assert _states(root) == {patch.id: NOT_APPLIED for patch in PATCHES}
    assert not registry.check(root)
    assert registry.megatron_version(root) in registry.SUPPORTED_VERSIONS


def test_apply_patches_every_target_and_keeps_it_valid_python(root):
    results = registry.apply(root)
    assert [r.state for r in results] == [APPLIED] * len(PATCHES)
    assert _states(root) == {patch.id: APPLIED for patch in PATCHES} and registry.check(root)
    for patch in PATCHES:
        text = (root / patch.target).read_text(encoding="utf-8")
        compile(text, patch.target, "exec")
        module_level = [
            node.targets[0].id for node in ast.parse(text).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and node.value.value is None and isinstance(node.targets[0], ast.Name)
        ]
        assert patch.hook in module_level, f"{patch.id}: no module-level `{patch.hook} = None`"


def test_apply_twice_changes_nothing(root):
    registry.apply(root)
    before = _snapshot(root)
    results = registry.apply(root)
    assert all("unchanged" in r.detail for r in results)
    assert _snapshot(root) == before  # same bytes, and not even rewritten (same mtime)


def test_revert_restores_the_released_bytes(root):
    stock = {rel: (root / rel).read_bytes() for rel in TARGETS}
    registry.apply(root)
    assert all((root / rel).read_bytes() != stock[rel] for rel in TARGETS)
    assert [r.state for r in registry.revert(root)] == [NOT_APPLIED] * len(PATCHES)
    assert {rel: (root / rel).read_bytes() for rel in TARGETS} == stock
    before = _snapshot(root)
    registry.revert(root)
    assert _snapshot(root) == before


def test_edited_anchor_is_a_conflict_and_apply_writes_nothing(root):
    path = root / BY_ID["attention-core-hook"].target
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"""Run the configured core attention module."""', "pass"))
    before = _snapshot(root)
    assert _states(root) == {
        "attention-core-hook": CONFLICT,
        "gpt-rope-positions-hook": NOT_APPLIED,
        "schedule-selection-hook": NOT_APPLIED,
    }
    (state,) = [s for s in registry.status(root) if s.patch_id == "attention-core-hook"]
    assert "hunk 2: stock text found 0x, patched 0x" in state.detail
    with pytest.raises(registry.PatchConflictError, match="(?s)nothing was written.*attention"):
        registry.apply(root)
    assert _snapshot(root) == before


def test_partially_applied_file_is_a_conflict_for_revert_too(root):
    registry.apply(root)
    path = root / BY_ID["schedule-selection-hook"].target
    hunk = BY_ID["schedule-selection-hook"].hunks[1]
    path.write_text(path.read_text(encoding="utf-8").replace(hunk.new, hunk.old))
    before = _snapshot(root)
    (state,) = [s for s in registry.status(root) if s.patch_id == "schedule-selection-hook"]
    assert state.state == CONFLICT and "hunk 1: patched, hunk 2: stock" in state.detail
    with pytest.raises(registry.PatchConflictError):
        registry.revert(root)
    assert _snapshot(root) == before


def test_unsupported_version_is_refused_with_the_fix(root):
    info = root / INFO
    info.write_text(info.read_text(encoding="utf-8").replace("MINOR = 19", "MINOR = 20"))
    before = _snapshot(root)
    for operation in (registry.status, registry.apply, registry.revert):
        with pytest.raises(ValueError, match=r"0\.20\.2.*supports only 0\.19\.2") as error:
            operation(root)
        assert "pip install --no-deps --ignore-requires-python megatron-core==0.19.2" in str(
            error.value
        )
    assert _snapshot(root) == before


def test_root_without_megatron_is_refused(tmp_path):
    with pytest.raises(ValueError, match="directory that contains megatron/"):
        registry.status(tmp_path)


def test_declarations_are_validated():
    with pytest.raises(ValueError, match="must not contain"):
        registry.Hunk(old="x = 1\n", new="x = 1\ny = 2\n")
    hunk = registry.Hunk(old="a = 1\n", new="_hook = None\na = 2\n")
    fields = dict(description="d", supported_versions=("0.19.2",), hunks=(hunk,), hook="_hook")
    with pytest.raises(ValueError, match="relative path"):
        registry.SourcePatch(id="p", target="/abs/file.py", **fields)
    with pytest.raises(ValueError, match="must be added by a hunk"):
        registry.SourcePatch(id="p", target="m.py", **{**fields, "hook": "_other"})
    with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
        registry.SourcePatch(id="p", target="m.py", **{**fields, "supported_versions": ("0.19",)})


def _function(tree: ast.AST, qualname: str) -> ast.FunctionDef:
    node = tree
    for name in qualname.split("."):
        node = next(
            child for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.ClassDef, ast.FunctionDef)) and child.name == name
        )
    return node


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_hook_checks_come_first_and_the_stock_body_follows(root):
    registry.apply(root)
    trees = {p.id: ast.parse((root / p.target).read_text(encoding="utf-8")) for p in PATCHES}
    for patch_id, qualname, hook in (
        ("attention-core-hook", "Attention._run_core_attention", "_core_attention_hook"),
        ("schedule-selection-hook", "get_forward_backward_func", "_forward_backward_func_hook"),
    ):
        body = _function(trees[patch_id], qualname).body
        assert isinstance(body[0].value, ast.Constant), f"{qualname}: docstring first"
        assert isinstance(body[1], ast.If) and hook in _names(body[1].test), qualname
        assert len(body) > 2 and hook not in _names(ast.Module(body[2:], [])), "stock body follows"
    forward = _function(trees["attention-core-hook"], "Attention.forward")
    calls = [ast.unparse(n.func) for n in ast.walk(forward) if isinstance(n, ast.Call)]
    assert "self._run_core_attention" in calls
    assert "apply_module(self.core_attention)" not in calls, "inline call must use the hook path"
    preprocess = _function(trees["gpt-rope-positions-hook"], "GPTModel._preprocess")
    rope_branch = next(n for n in ast.walk(preprocess) if isinstance(n, ast.If)
                       and "'rope'" in ast.unparse(n.test)).body[-1].orelse
    assert ast.unparse(rope_branch[-2]).startswith("rotary_pos_emb = self.rotary_pos_emb(")
    assert ast.unparse(rope_branch[-1]) == (
        "if _rotary_pos_emb_hook is not None:\n"
        "    rotary_pos_emb = _rotary_pos_emb_hook(self, rotary_pos_emb)"
    )


def test_generated_patch_files_are_in_sync(root):
    patch_dir = REPO / "megatron_patches" / "patches"
    fix = "regenerate with `python -m megatron_patches diff --write`"
    assert sorted(p.stem for p in patch_dir.glob("*.patch")) == sorted(BY_ID), fix
    for patch in PATCHES:
        stored = (patch_dir / f"{patch.id}.patch").read_text(encoding="utf-8")
        assert stored == registry.unified_diff(patch, root), f"{patch.id}.patch is stale: {fix}"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_patch_files_apply_with_git_to_the_same_bytes(root, tmp_path_factory):
    other = tmp_path_factory.mktemp("git_apply")
    shutil.copytree(root, other, dirs_exist_ok=True)
    files = sorted(str(p) for p in (REPO / "megatron_patches" / "patches").glob("*.patch"))
    subprocess.run(["git", "apply", *files], cwd=other, check=True, capture_output=True)
    registry.apply(root)
    assert {rel: (other / rel).read_bytes() for rel in TARGETS} == {
        rel: (root / rel).read_bytes() for rel in TARGETS
    }


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_patches", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_cli_exit_codes_and_messages(root):
    report = _cli("report", "--root", str(root))
    assert report.returncode == 0 and "megatron-core 0.19.2" in report.stdout
    assert all(pid in report.stdout for pid in BY_ID) and "not applied" in report.stdout
    check = _cli("check", "--root", str(root))
    assert check.returncode == 1 and "python -m megatron_patches apply" in check.stderr
    assert _cli("apply", "--root", str(root)).returncode == 0
    assert _cli("check", "--root", str(root)).returncode == 0
    target = root / BY_ID["gpt-rope-positions-hook"].target
    target.write_text(target.read_text(encoding="utf-8").replace("_rotary_pos_emb_hook", "_x"))
    conflict = _cli("revert", "--root", str(root))
    assert conflict.returncode == 1 and "gpt-rope-positions-hook" in conflict.stderr
    assert _cli("report", "--root", str(root)).returncode == 1
    missing = _cli("check", "--root", str(root / "nowhere"))
    assert missing.returncode == 2 and "contains megatron/" in missing.stderr
    assert _cli("apply", "--write").returncode == 2


def test_in_process_check_requires_the_patched_code(tmp_path, monkeypatch):
    package = "fake_megatron_for_patch_test"
    (tmp_path / package).mkdir()
    (tmp_path / package / "mod.py").write_text("def run():\n    return 1\n")
    (tmp_path / INFO).parent.mkdir(parents=True)
    (tmp_path / INFO).write_text("MAJOR = 0\nMINOR = 19\nPATCH = 2\n")
    patch = registry.SourcePatch(
        id="fake-hook", target=f"{package}/mod.py", description="d",
        supported_versions=("0.19.2",), hook="_hook",
        hunks=(registry.Hunk(old="def run():\n    return 1\n", new=(
            "_hook = None\n\n\ndef run():\n    return 1 if _hook is None else _hook()\n"
        )),),
        references=(("run", "_hook"),),
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    try:
        assert not registry.is_applied_in_process((patch,))
        with pytest.raises(RuntimeError, match="python -m megatron_patches apply"):
            registry.require_patched((patch,))
        module = sys.modules[f"{package}.mod"]
        module._hook = None  # an attribute alone, without the code that uses it, is not enough
        assert not registry.is_applied_in_process((patch,))
        registry.apply(tmp_path, (patch,))
        importlib.reload(module)
        assert registry.is_applied_in_process((patch,))
        registry.require_patched((patch,))
    finally:
        for name in [package, f"{package}.mod"]:
            sys.modules.pop(name, None)


_LIVE_CHECK = textwrap.dedent("""
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("snap", sys.argv[1])
    snap = importlib.util.module_from_spec(spec); spec.loader.exec_module(snap)
    live = snap.collect()
    stored = json.loads(snap.snapshot_path(live["megatron_core_version"]).read_text())
    from megatron_patches import registry
    print(json.dumps({"problems": snap.compare(stored, live),
                      "on_disk": registry.check(), "in_process": registry.is_applied_in_process()}))
""")


def test_upstream_signatures_match_the_snapshot_and_hooks_are_live():
    # A subprocess: importing megatron.core here would do it before megatron_patches.cpu_support.
    tool = REPO / "tools" / "snapshot_signatures.py"
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _LIVE_CHECK, str(tool)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["problems"], (
        "upstream Megatron signatures changed; review the patches and the executor, then "
        "regenerate with `.venv/bin/python tools/snapshot_signatures.py`:\n"
        + "\n".join(result["problems"])
    )
    # The venv copy is patched by `make setup`; whichever state it is in, the import must agree.
    assert result["in_process"] == result["on_disk"]


def test_snapshot_comparison_reports_a_changed_signature():
    spec = importlib.util.spec_from_file_location("snap", REPO / "tools" / "snapshot_signatures.py")
    snap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(snap)
    stored = {"signatures": {"m:f": "(a, b)", "m:gone": "()"}, "dataclass_fields": {}}
    live = {"signatures": {"m:f": "(a)", "m:new": "()"}, "dataclass_fields": {}}
    problems = snap.compare(stored, live)
    assert len(problems) == 3 and problems[0].startswith("m:f changed")
