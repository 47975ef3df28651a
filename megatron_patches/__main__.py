"""`python -m megatron_patches {apply,revert,check,report,diff} [--root PATH] [--write]`, and
`python -m megatron_patches compare RUN_A RUN_B` (a dense and a reuse run: compare.py).

Exit status: 0 done / all applied; 1 `check` found a patch not applied, or a patch conflicts
(nothing was written), or `check` / `report` found a mixed tree (files of another release left
behind by unpacking one Megatron-LM over another); 2 usage error (no megatron-core found, unsupported version, bad --root,
a target that cannot be written: nothing was written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_patches.patching import registry

__all__ = ["main"]

_PATCH_DIR = Path(__file__).resolve().parent / "patches"
_EXIT_OK, _EXIT_FAILED, _EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_patches",
        description="Apply, revert or inspect the declared source patches to megatron-core.",
    )
    parser.add_argument("command", choices=["apply", "revert", "check", "report", "diff"],
                        help="(or `compare RUN_A RUN_B`: python -m megatron_patches compare -h)")
    parser.add_argument(
        "--root", type=Path, default=None,
        help="directory that contains megatron/ (a Megatron-LM checkout or site-packages); "
        "default: where this Python imports megatron.core from",
    )
    parser.add_argument(
        "--write", action="store_true",
        help=f"with diff: write one .patch per patch into {_PATCH_DIR}/<patch set of the "
        "version under --root>/ instead of printing",
    )
    return parser


def _print_states(states) -> None:
    for state in states:
        print(f"{state.patch_id}: {state.state}" + (f" ({state.detail})" if state.detail else ""))


def _mixed_tree(root: Path) -> bool:
    """Print (stderr) whether root mixes two releases; True if it does."""
    stray = registry.stray_files(root)
    if stray:
        print(f"mixed tree: {len(stray)} file(s) under {root} belong to another Megatron release "
              f"than megatron-core {registry.megatron_version(root)} (e.g. {', '.join(stray[:3])}): "
              "one release was unpacked over another; unpack or install it into an empty "
              "directory and apply the patches there", file=sys.stderr)
    return bool(stray)


def _report(root: Path) -> int:
    patches = registry.patches_at(root)
    states = registry.status(root, patches)
    version = registry.megatron_version(root)
    print(f"megatron-core {version} under {root} ({registry.SUPPORTED_RELEASES[version]}); "
          f"patch files: {_PATCH_DIR / registry.patch_set_name(version)}")
    by_id = {patch.id: patch for patch in patches}
    rows = [("id", "target", "state", "description")] + [
        (s.patch_id, by_id[s.patch_id].target, s.state, by_id[s.patch_id].description)
        for s in states
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    for state in states:
        if state.state == registry.CONFLICT:
            print(f"{state.patch_id}: {state.detail}", file=sys.stderr)
    mixed = _mixed_tree(root)
    return _EXIT_FAILED if mixed or any(s.state == registry.CONFLICT for s in states) else _EXIT_OK


def _check(root: Path) -> int:
    states = registry.status(root)
    missing = [s for s in states if s.state != registry.APPLIED]
    if _mixed_tree(root):
        return _EXIT_FAILED
    if not missing:
        print(f"all {len(states)} megatron patches are applied under {root}")
        return _EXIT_OK
    _print_states(missing)
    print(f"fix: python -m megatron_patches apply --root {root} (or `make setup`)", file=sys.stderr)
    return _EXIT_FAILED


def _diff(root: Path, write: bool) -> int:
    rendered = {patch.id: registry.unified_diff(patch, root) for patch in registry.patches_at(root)}
    if not write:
        sys.stdout.write("".join(rendered.values()))
        return _EXIT_OK
    out = _PATCH_DIR / registry.patch_set_name(registry.megatron_version(root))
    out.mkdir(parents=True, exist_ok=True)
    for stale in sorted(set(p.stem for p in out.glob("*.patch")) - set(rendered)):
        (out / f"{stale}.patch").unlink()
        print(f"removed {out / stale}.patch (no longer declared)")
    for patch_id, text in rendered.items():
        (out / f"{patch_id}.patch").write_text(text, encoding="utf-8")
        print(f"wrote {out / patch_id}.patch")
    return _EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        from megatron_patches.compare import main as compare

        return compare(argv[1:])
    args = _parser().parse_args(argv)
    if args.write and args.command != "diff":
        print("--write applies only to `diff`", file=sys.stderr)
        return _EXIT_USAGE
    try:
        root = registry.default_root() if args.root is None else args.root
        if args.command in ("apply", "revert"):
            _print_states(getattr(registry, args.command)(root))
            return _EXIT_OK
        if args.command == "check":
            return _check(root)
        if args.command == "report":
            return _report(root)
        return _diff(root, args.write)
    except registry.PatchConflictError as error:
        print(f"error: {error}", file=sys.stderr)
        return _EXIT_FAILED
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return _EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
