"""Declared Megatron source patches: apply/revert/status on copies of the real target files.

Nothing here writes to the installed megatron-core: every test works on a tmp tree holding copies
of the target files and package_info.py of one supported release -- the installed megatron-core
0.19.2, brought back to the released bytes (checked against the wheel's RECORD hashes) whether or
not the venv is patched, and the offline Megatron-LM checkouts 0.19.1 (core_r0.19.0) and 0.20.0
(main; tests/megatron_trees.py says where they are found, and these cases skip without them).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patches.patching import registry
from megatron_patches.patching.registry import APPLIED, CONFLICT, DECLARED_PATCHES, NOT_APPLIED
from megatron_trees import stock_tree

REPO = Path(__file__).resolve().parents[1]
INFO = "megatron/core/package_info.py"
TARGETS = sorted({patch.target for patch in DECLARED_PATCHES})
IDS = list(dict.fromkeys(patch.id for patch in DECLARED_PATCHES))
RELEASES = [pytest.param("installed", id="installed-0.19.2"),
            pytest.param("0.19.1", id="core_r0.19.0", marks=pytest.mark.versions),
            pytest.param("0.20.0", id="main-0.20.0", marks=pytest.mark.versions)]

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


def _stock_copy(release: str, dest: Path, factory) -> Path:
    """Stock copies of the targets of `release` ("installed" or a tarball's version) under dest."""
    source = registry.default_root() if release == "installed" else stock_tree(release, factory)
    for rel in TARGETS + [INFO]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, dest / rel)
    if release == "installed":
        registry.revert(dest)
        for rel, expected in _release_hashes().items():
            assert _record_hash((dest / rel).read_bytes()) == expected, f"{rel} is not stock"
    return dest


@pytest.fixture
def root(tmp_path, tmp_path_factory) -> Path:
    """The installed release's targets, stock (for the failure-mode tests)."""
    return _stock_copy("installed", tmp_path, tmp_path_factory)


@pytest.fixture(params=RELEASES)
def release_root(request, tmp_path, tmp_path_factory) -> Path:
    """Stock targets of each supported release in turn."""
    return _stock_copy(request.param, tmp_path, tmp_path_factory)


def _patches(root: Path):
    return registry.patches_at(root)


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {rel: ((root / rel).read_bytes(), (root / rel).stat().st_mtime_ns) for rel in TARGETS}


def _states(root: Path) -> dict[str, str]:
    return {s.patch_id: s.state for s in registry.status(root)}


def _by_id(root: Path):
    return {patch.id: patch for patch in _patches(root)}


def test_stock_tree_is_not_applied(release_root):
    assert _states(release_root) == {patch_id: NOT_APPLIED for patch_id in IDS}
    assert not registry.check(release_root)
    assert registry.megatron_version(release_root) in registry.SUPPORTED_VERSIONS


def test_apply_patches_every_target_and_keeps_it_valid_python(release_root):
    root, patches = release_root, _patches(release_root)
    results = registry.apply(root)
    assert [r.state for r in results] == [APPLIED] * len(patches)
    assert _states(root) == {patch_id: APPLIED for patch_id in IDS} and registry.check(root)
    for patch in patches:
        text = (root / patch.target).read_text(encoding="utf-8")
        compile(text, patch.target, "exec")
        module_level = [
            node.targets[0].id for node in ast.parse(text).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and node.value.value is None and isinstance(node.targets[0], ast.Name)
        ]
        assert patch.hook in module_level, f"{patch.id}: no module-level `{patch.hook} = None`"


def test_apply_twice_changes_nothing(release_root):
    registry.apply(release_root)
    before = _snapshot(release_root)
    results = registry.apply(release_root)
    assert all("unchanged" in r.detail for r in results)
    assert _snapshot(release_root) == before  # same bytes, and not even rewritten (same mtime)


def test_revert_restores_the_released_bytes(release_root):
    root = release_root
    stock = {rel: (root / rel).read_bytes() for rel in TARGETS}
    registry.apply(root)
    assert all((root / rel).read_bytes() != stock[rel] for rel in TARGETS)
    assert [r.state for r in registry.revert(root)] == [NOT_APPLIED] * len(IDS)
    assert {rel: (root / rel).read_bytes() for rel in TARGETS} == stock
    before = _snapshot(root)
    registry.revert(root)
    assert _snapshot(root) == before


def test_edited_anchor_is_a_conflict_and_apply_writes_nothing(root):
    path = root / _by_id(root)["attention-core-hook"].target
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"""Run the configured core attention module."""', "pass"))
    before = _snapshot(root)
    assert _states(root) == {patch_id: CONFLICT if patch_id == "attention-core-hook"
                             else NOT_APPLIED for patch_id in IDS}
    (state,) = [s for s in registry.status(root) if s.patch_id == "attention-core-hook"]
    assert "hunk 2: stock text found 0x, patched 0x" in state.detail
    assert "git checkout -- megatron/core/transformer/attention.py" in state.detail
    with pytest.raises(registry.PatchConflictError, match="(?s)nothing was written.*attention"):
        registry.apply(root)
    assert _snapshot(root) == before


def test_partially_applied_file_is_a_conflict_for_revert_too(root):
    registry.apply(root)
    path = root / _by_id(root)["schedule-selection-hook"].target
    hunk = _by_id(root)["schedule-selection-hook"].hunks[1]
    path.write_text(path.read_text(encoding="utf-8").replace(hunk.new, hunk.old))
    before = _snapshot(root)
    (state,) = [s for s in registry.status(root) if s.patch_id == "schedule-selection-hook"]
    assert state.state == CONFLICT and "hunk 1: patched, hunk 2: stock" in state.detail
    with pytest.raises(registry.PatchConflictError):
        registry.revert(root)
    assert _snapshot(root) == before


@pytest.mark.parametrize("minor, patch", [(21, 0), (19, 0), (18, 2)])
def test_unsupported_version_is_refused_naming_the_range(root, minor, patch):
    info = root / INFO
    text = info.read_text(encoding="utf-8").replace("MINOR = 19", f"MINOR = {minor}")
    info.write_text(text.replace("PATCH = 2", f"PATCH = {patch}"))
    before = _snapshot(root)
    for operation in (registry.status, registry.apply, registry.revert, registry.check):
        with pytest.raises(ValueError, match=rf"megatron-core 0\.{minor}\.{patch} found") as error:
            operation(root)
        message = str(error.value)
        assert all(v in message for v in ("0.19.1 (Megatron-LM branch core_r0.19.0",
                                          "0.19.2 (the megatron-core 0.19.2 wheel",
                                          "0.20.0 (Megatron-LM main as of 2026-08-22"))
        assert "pip install --no-deps --ignore-requires-python megatron-core==0.19.2" in message
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


def test_a_release_whose_source_differs_gets_its_own_declaration():
    def patch(versions, new):
        return registry.SourcePatch(
            id="p", target="m.py", description="d", supported_versions=versions, hook="_hook",
            hunks=(registry.Hunk(old="a = 1\n", new=f"_hook = None\n{new}"),))

    old, newer = patch(("0.19.1", "0.19.2"), "a = 2\n"), patch(("0.20.0",), "a = 3\n")
    assert registry.patches_for("0.19.2", (old, newer)) == (old,)
    assert registry.patches_for("0.20.0", (old, newer)) == (newer,)
    with pytest.raises(ValueError, match=r"0\.21\.0 is not supported.*supported: 0\.19\.1"):
        registry.patches_for("0.21.0", (old, newer))
    with pytest.raises(AssertionError, match="declared twice"):
        registry.patches_for("0.20.0", (old, newer, newer))
    # the real declarations: one per id for every supported release, same ids everywhere
    for version in registry.SUPPORTED_VERSIONS:
        assert [p.id for p in registry.patches_for(version)] == IDS
        assert version in sum(registry.PATCH_SETS.values(), ())


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


def _rope_branch_tail(function: ast.FunctionDef) -> list:
    """The last two statements of the branch that builds the plain RoPE table."""
    branch = next(n for n in ast.walk(function) if isinstance(n, ast.If)
                  and "'rope'" in ast.unparse(n.test)).body
    while isinstance(branch[-1], ast.If) and branch[-1].orelse:  # GPTModel: under "not inference"
        branch = branch[-1].orelse
    return [ast.unparse(statement) for statement in branch[-2:]]


def test_hook_checks_come_first_and_the_stock_body_follows(release_root):
    root = release_root
    registry.apply(root)
    trees = {p.id: ast.parse((root / p.target).read_text(encoding="utf-8"))
             for p in _patches(root)}
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
    hook_call = ("if _rotary_pos_emb_hook is not None:\n"
                 "    rotary_pos_emb = _rotary_pos_emb_hook(self, rotary_pos_emb)")
    for patch_id, qualname in (("gpt-rope-positions-hook", "GPTModel._preprocess"),
                               ("hybrid-rope-positions-hook", "HybridModel.forward")):
        built, hooked = _rope_branch_tail(_function(trees[patch_id], qualname))
        assert built.startswith("rotary_pos_emb = self.rotary_pos_emb("), qualname
        assert hooked == hook_call, qualname


def _patch_dir(root: Path) -> Path:
    name = registry.patch_set_name(registry.megatron_version(root))
    return REPO / "megatron_patches" / "patches" / name


def test_generated_patch_files_are_in_sync(release_root):
    root, patch_dir = release_root, _patch_dir(release_root)
    fix = "regenerate with `python -m megatron_patches diff --write --root <stock tree>`"
    assert sorted(p.stem for p in patch_dir.glob("*.patch")) == sorted(IDS), fix
    for patch in _patches(root):
        stored = (patch_dir / f"{patch.id}.patch").read_text(encoding="utf-8")
        assert stored == registry.unified_diff(patch, root), f"{patch.id}.patch is stale: {fix}"
    sets = sorted(p.name for p in (REPO / "megatron_patches" / "patches").iterdir())
    assert sets == sorted(registry.PATCH_SETS), "a patches/ directory per declared patch set"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_patch_files_apply_with_git_to_the_same_bytes(release_root, tmp_path_factory):
    root = release_root
    other = tmp_path_factory.mktemp("git_apply")
    shutil.copytree(root, other, dirs_exist_ok=True)
    files = sorted(str(p) for p in _patch_dir(root).glob("*.patch"))
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


def test_cli_exit_codes_and_messages(release_root):
    root = release_root
    version = registry.megatron_version(root)
    report = _cli("report", "--root", str(root))
    assert report.returncode == 0 and f"megatron-core {version} under" in report.stdout
    assert registry.patch_set_name(version) in report.stdout
    assert all(pid in report.stdout for pid in IDS) and "not applied" in report.stdout
    check = _cli("check", "--root", str(root))
    assert check.returncode == 1 and "python -m megatron_patches apply" in check.stderr
    assert _cli("apply", "--root", str(root)).returncode == 0
    assert _cli("check", "--root", str(root)).returncode == 0
    target = root / _by_id(root)["gpt-rope-positions-hook"].target
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


def test_mixed_tree_is_flagged(release_root):
    """One release unpacked over another leaves the other's own files: report and check say so."""
    root = release_root
    assert registry.stray_files(root) == []
    family = ".".join(registry.megatron_version(root).split(".")[:2])
    from megatron_patches.patching.tree_files import ONLY_IN

    other = next(f for f in ONLY_IN if f != family)
    stray = root / ONLY_IN[other][0]
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_text("# left behind\n")
    assert registry.stray_files(root) == [ONLY_IN[other][0]]
    for command in ("report", "check"):
        result = _cli(command, "--root", str(root))
        assert result.returncode == 1 and "mixed tree" in result.stderr, result.stderr
        assert ONLY_IN[other][0] in result.stderr


def test_tree_files_match_the_offline_tarballs(tmp_path):
    """The generated list (tools/tree_files.py) is what the tarballs hold today."""
    sys.path.insert(0, str(REPO / "tools"))
    import tree_files

    from megatron_trees import TARBALLS, find_tarball  # skips naming the places looked at

    assert tree_files.TARBALLS == {"0.19": TARBALLS["0.19.1"], "0.20": TARBALLS["0.20.0"]}
    paths = {"0.19": find_tarball("0.19.1"), "0.20": find_tarball("0.20.0")}
    rendered = tree_files.render({f: tree_files.core_files(p) for f, p in paths.items()})
    assert rendered == tree_files.OUT.read_text(encoding="utf-8"), "run tools/tree_files.py"
