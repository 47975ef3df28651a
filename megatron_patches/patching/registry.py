"""Declared source patches to megatron-core, and the operations that apply them.

Each patch adds one module-level hook (None by default) to a Megatron file and a check of it at the
start of the function Megatron already uses for that job, so with no hook set every patched
function behaves exactly as stock (see docs/DESIGN.md, "Hook points in Megatron"). A patch is data:
exact-text hunks whose `old` text occurs exactly once in each release it declares. `apply` and
`revert` are idempotent and all-or-nothing; the patch set is chosen by the version found under the
root (`declarations.patches_for`), and a version outside the supported range is refused.

This module imports neither torch nor megatron at import time.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional

from megatron_patches.patching.declarations import (  # the patches themselves; re-exported
    ATTENTION_CORE_HOOK, DECLARED_PATCHES, GPT_ROPE_POSITIONS_HOOK, HYBRID_ROPE_POSITIONS_HOOK,
    PATCH_SETS, SCHEDULE_SELECTION_HOOK, SUPPORTED_RELEASES, SUPPORTED_VERSIONS, Hunk, SourcePatch,
    patch_set_name, patches_for, supported_range,
)

__all__ = [
    "APPLIED", "CONFLICT", "DECLARED_PATCHES", "NOT_APPLIED", "PATCH_SETS", "SUPPORTED_RELEASES",
    "SUPPORTED_VERSIONS", "Hunk", "PatchConflictError", "PatchStatus", "SourcePatch", "apply",
    "check", "default_root", "imported_version", "is_applied_in_process", "megatron_version",
    "patch_set_name", "patches_at", "patches_for", "require_patched", "revert", "status",
    "stray_files", "supported_range", "unified_diff",
]

APPLIED = "applied"
NOT_APPLIED = "not applied"
CONFLICT = "conflict"

_INSTALL_HINT = (
    "Install a supported release (`pip install --no-deps --ignore-requires-python "
    "megatron-core==0.19.2`), or pass the root of a supported Megatron-LM checkout with --root"
)


class PatchStatus(NamedTuple):
    """State of one patch in one tree."""

    patch_id: str
    state: str
    detail: str


class PatchConflictError(ValueError):
    """A target file matches neither the stock nor the patched text; nothing was written."""


def default_root() -> Path:
    """The directory holding the installed `megatron/` package (site-packages or a checkout).

    Found with `find_spec` so that megatron.core itself is not imported (it needs triton).
    """
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or spec.origin is None:
        raise ValueError(
            "megatron-core is not importable from this Python. " + _INSTALL_HINT
            + " (--root PATH: the directory that contains megatron/)"
        )
    return Path(spec.origin).resolve().parents[2]


def megatron_version(root: Path | str) -> str:
    """`MAJOR.MINOR.PATCH` from `megatron/core/package_info.py` under root, parsed, not imported."""
    info = Path(root) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise ValueError(
            f"{info} does not exist: --root must be the directory that contains megatron/ "
            "(a Megatron-LM checkout root, or the site-packages directory of megatron-core)"
        )
    values = {}
    for node in ast.parse(info.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("MAJOR", "MINOR", "PATCH"):
                    values[target.id] = node.value.value
    return _version_of(values, info)


def _version_of(info: dict, where) -> str:
    if not all(isinstance(info.get(k), int) for k in ("MAJOR", "MINOR", "PATCH")):
        raise ValueError(f"{where} does not define MAJOR, MINOR and PATCH as int literals")
    return f"{info['MAJOR']}.{info['MINOR']}.{info['PATCH']}"


def patches_at(root: Path | str) -> tuple[SourcePatch, ...]:
    """The patch set for the megatron-core under root; ValueError naming the supported range."""
    version = megatron_version(root)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"megatron-core {version} found under {root}; supported: {supported_range()}. "
            + _INSTALL_HINT
        )
    return patches_for(version)


def stray_files(root: Path | str) -> list[str]:
    """Files under root that belong to another supported release family than root's version
    (patching/tree_files.py): a mixed tree, one Megatron-LM unpacked over another. Empty if none."""
    from megatron_patches.patching.tree_files import ONLY_IN

    family = ".".join(megatron_version(root).split(".")[:2])
    return [path for other, paths in sorted(ONLY_IN.items()) if other != family
            for path in paths if (Path(root) / path).is_file()]


def _require_supported(root: Path, patches: tuple[SourcePatch, ...]) -> None:
    version = megatron_version(root)
    for patch in patches:
        if version not in patch.supported_versions:
            raise ValueError(
                f"megatron-core {version} found under {root}, but this declaration of patch "
                f"{patch.id!r} is for {', '.join(patch.supported_versions)}; supported: "
                f"{supported_range()}"
            )


def _resolve(root: Path | str | None) -> Path:
    return default_root() if root is None else Path(root)


def _hunk_state(text: str, hunk: Hunk) -> str:
    num_old, num_new = text.count(hunk.old), text.count(hunk.new)
    if num_old == 0 and num_new == 1:
        return APPLIED
    if num_old == 1 and num_new == 0:
        return NOT_APPLIED
    return CONFLICT


def _patch_status(root: Path, patch: SourcePatch) -> PatchStatus:
    path = root / patch.target
    if not path.is_file():
        return PatchStatus(patch.id, CONFLICT, f"{path} does not exist")
    text = path.read_text(encoding="utf-8")
    states = [_hunk_state(text, hunk) for hunk in patch.hunks]
    if all(state == APPLIED for state in states):
        return PatchStatus(patch.id, APPLIED, "")
    if all(state == NOT_APPLIED for state in states):
        return PatchStatus(patch.id, NOT_APPLIED, "")
    labels = {APPLIED: "patched", NOT_APPLIED: "stock"}
    summary = ", ".join(
        f"hunk {i + 1}: "
        + labels.get(s, f"stock text found {text.count(h.old)}x, patched {text.count(h.new)}x")
        for i, (h, s) in enumerate(zip(patch.hunks, states))
    )
    return PatchStatus(
        patch.id, CONFLICT,
        f"{path} matches neither the stock nor the patched text ({summary}): restore the stock "
        f"file (in a checkout: `git checkout -- {patch.target}`; the wheel: `pip install "
        "--force-reinstall --no-deps --ignore-requires-python megatron-core==0.19.2`)",
    )


def status(root: Path | str | None = None, patches: Optional[tuple[SourcePatch, ...]] = None,
           ) -> list[PatchStatus]:
    """(patch_id, "applied" | "not applied" | "conflict", detail) for each patch, in order.

    `patches` defaults to the set for the version found under root (`patches_at`).
    """
    root = _resolve(root)
    if patches is None:
        patches = patches_at(root)
    _require_supported(root, patches)
    return [_patch_status(root, patch) for patch in patches]


def _rewrite(text: str, patch: SourcePatch, *, forward: bool) -> str:
    for hunk in patch.hunks:
        src, dst = (hunk.old, hunk.new) if forward else (hunk.new, hunk.old)
        assert text.count(src) == 1, f"{patch.id}: hunk anchor not unique after status check"
        text = text.replace(src, dst)
    return text


def _write_atomic(path: Path, text: str) -> None:
    # Same directory so os.replace is a rename; a reader never sees a half-written module.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _transition(root, patches, *, forward: bool) -> list[PatchStatus]:
    root = _resolve(root)
    if patches is None:
        patches = patches_at(root)
    states = status(root, patches)
    conflicts = [s for s in states if s.state == CONFLICT]
    if conflicts:
        lines = "\n".join(f"  {s.patch_id}: {s.detail}" for s in conflicts)
        raise PatchConflictError(f"nothing was written; conflicting patches:\n{lines}")
    todo_state = NOT_APPLIED if forward else APPLIED
    new_texts: dict[Path, str] = {}
    results = []
    for patch, state in zip(patches, states):
        if state.state != todo_state:
            results.append(PatchStatus(patch.id, state.state, "unchanged"))
            continue
        path = root / patch.target
        text = new_texts.get(path, path.read_text(encoding="utf-8"))
        new_texts[path] = _rewrite(text, patch, forward=forward)
        done, verb = (APPLIED, "patched") if forward else (NOT_APPLIED, "restored")
        results.append(PatchStatus(patch.id, done, f"{verb} {path}"))
    _write_all(new_texts)
    return results


def _check_writable(paths) -> None:
    """ValueError naming every target that cannot be replaced, before any is written: open
    for append (refused on a read-only or immutable file) and a temp file in its directory."""
    bad = []
    for path in paths:
        try:
            with open(path, "ab"):
                pass
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            bad.append(f"  {path}: {exc.strerror or exc}")
    if bad:
        raise ValueError("nothing was written; these targets cannot be written:\n" + "\n".join(bad)
                         + "\nmake them writable (chmod u+w, chattr -i) or run as their owner, "
                         "or give --root a writable copy")


def _write_all(new_texts: dict) -> None:
    """Replace every file or none: checked first; a failure midway restores those written."""
    _check_writable(new_texts)
    old_texts = {path: path.read_text(encoding="utf-8") for path in new_texts}
    written = []
    try:
        for path, text in new_texts.items():
            _write_atomic(path, text)
            written.append(path)
    except BaseException:
        for path in written:
            _write_atomic(path, old_texts[path])
        raise


def apply(root: Path | str | None = None, patches=None) -> list[PatchStatus]:
    """Apply every patch not yet applied; writes nothing if any patch conflicts."""
    return _transition(root, patches, forward=True)


def revert(root: Path | str | None = None, patches=None) -> list[PatchStatus]:
    """Exact inverse of `apply`: restores the stock text; writes nothing if any patch conflicts."""
    return _transition(root, patches, forward=False)


def check(root: Path | str | None = None, patches=None) -> bool:
    """True when every patch is applied under root."""
    return all(s.state == APPLIED for s in status(root, patches))


def unified_diff(patch: SourcePatch, root: Path | str | None = None) -> str:
    """The patch as a `git apply`-able diff against the stock file found under root.

    The stock text is recovered from root in either state (revert is exact), so the rendering does
    not depend on whether root is patched.
    """
    root = _resolve(root)
    (state,) = status(root, (patch,))
    if state.state == CONFLICT:
        raise PatchConflictError(f"{patch.id}: {state.detail}")
    text = (root / patch.target).read_text(encoding="utf-8")
    stock = _rewrite(text, patch, forward=False) if state.state == APPLIED else text
    patched = _rewrite(stock, patch, forward=True)
    lines = difflib.unified_diff(
        stock.splitlines(keepends=True), patched.splitlines(keepends=True),
        fromfile=f"a/{patch.target}", tofile=f"b/{patch.target}", n=3,
    )
    body = "".join(lines)
    assert body.endswith("\n"), "targets end with a newline, so every diff line does"
    header = (
        f"{patch.id}: {patch.description}\n"
        f"megatron-core versions of this declaration: {', '.join(patch.supported_versions)}\n"
        "generated by `python -m megatron_patches diff --write`; do not edit\n\n"
    )
    return header + f"diff --git a/{patch.target} b/{patch.target}\n" + body


def _module_name(target: str) -> str:
    return target.removesuffix(".py").replace("/", ".")


def imported_version() -> str:
    """`MAJOR.MINOR.PATCH` of the megatron.core this process imports (imports package_info)."""
    info = importlib.import_module("megatron.core.package_info")
    return _version_of(vars(info), info.__file__)


def _missing_in_process(patches=None) -> list[str]:
    if patches is None:
        version = imported_version()
        if version not in SUPPORTED_VERSIONS:
            return [f"megatron-core {version} is not supported (supported: {supported_range()})"]
        patches = patches_for(version)
    missing = []
    for patch in patches:
        module = _import_target(patch)
        if module is None:
            continue
        if not hasattr(module, patch.hook):
            missing.append(f"{module.__name__}.{patch.hook} ({patch.id})")
        for qualname, name in patch.references:
            func = module
            for part in qualname.split("."):
                func = getattr(func, part)
            # A hook attribute set on an unpatched module would do nothing: the code must use it.
            if name not in func.__code__.co_names:
                missing.append(f"{module.__name__}.{qualname} does not use {name} ({patch.id})")
    return missing


def _import_target(patch):
    """The patch's target module, or None where it cannot be imported without triton (Megatron-LM
    main's mamba_mixer imports Triton kernels at import time): no code of this process can run
    it, so its hook cannot be missing here (`check()` still reads the file on disk)."""
    try:
        return importlib.import_module(_module_name(patch.target))
    except ModuleNotFoundError as error:
        if error.name == "triton" and importlib.util.find_spec("triton") is None:
            return None
        raise


def is_applied_in_process(patches=None) -> bool:
    """True when the imported Megatron modules carry every hook of the imported version's patch
    set (imports them; the caller has made megatron.core importable, e.g. with
    megatron_patches.support.cpu_support on CPU)."""
    return not _missing_in_process(patches)


def require_patched(patches=None) -> None:
    """Raise RuntimeError, saying how to fix it, unless the imported Megatron is patched."""
    missing = _missing_in_process(patches)
    if missing:
        raise RuntimeError(
            "the imported megatron-core lacks the megatron_patches hooks: " + "; ".join(missing)
            + ". Run `python -m megatron_patches apply` (or `make setup`) with this Python, "
            "then restart the process."
        )
