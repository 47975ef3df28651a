"""The planned move of megatron_patches/ into subpackages that show the architecture (issue 26).

    python tools/layout_move.py            # print the plan for this tree; changes nothing
    python tools/layout_move.py --apply    # do it (git mv, import rewrite, shims); once

Not applied yet: the lead runs it after the other branches are merged, then the suite. The plan
is data (MOVES): each module of megatron_patches/ goes to one subpackage; the public entry
points stay at the top (`megatron_patches.install()`, `rl`, `training`, `python -m
megatron_patches`, the `megatron_lm/` entry point). The data folders `patches/` and
`snapshots/` stay where they are (setup.py's package_data, __main__.py and
tools/snapshot_signatures.py name them).

--apply, on a clean work tree:
1. `git mv` every module of MOVES (models.py becomes models/tiny.py: the package takes its name)
   and writes each new subpackage's __init__.py (a docstring, nothing imported);
2. rewrites every reference in *.py, *.md, Makefile, setup.py, pytest.ini and .ci/:
   dotted names (`megatron_patches.moe` -> `megatron_patches.runtime.moe`), file paths
   (`megatron_patches/moe.py`), and `from megatron_patches import a, b` lines;
3. keeps the import paths the README and examples/ show working: a shim module at each old
   path that puts the moved module in its place in sys.modules, so every name, private ones
   and monkeypatching included, is the moved module's; for `megatron_patches.models` (now the
   package) its __init__ hands out models/tiny.py's names on first use (a module __getattr__:
   importing megatron_patches.models.model_configs still imports no Megatron). The shims are
   computed from the README and examples/ as they are then.
It refuses when the tree has modules MOVES does not place (a merged branch added one: add it
to MOVES first), a subpackage folder exists already, or the work tree is not clean. Afterwards:
`make test-fast`, then `make test` (tests/test_import_graph.py checks for import circles).
Files over ~400 lines are listed with a split plan (SPLITS) to do by hand (the last three,
runtime/cp.py, cache.py and step.py, are split).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_patches"

SUBPACKAGES = {
    "patching": "The declared source patches to megatron-core, their registry and operations.",
    "runtime": "What runs inside a prefix-reuse step: executor, stage runner, p2p, hooks, "
               "layer and MoE handling, the agreed refusal.",
    "models": "Model builders (tiny Llama, HybridModel), the paper's configs, checkpoints.",
    "config": "Every TransformerConfig field classified for prefix reuse.",
    "support": "Running on CPU (gloo), launching ranks, reporting the first failure.",
}
MOVES = {  # old module -> new module, both under megatron_patches
    "declarations": "patching.declarations",
    "registry": "patching.registry",
    "executor": "runtime.executor",
    "stage_runner": "runtime.stage_runner",
    "p2p": "runtime.p2p",
    "schedule_parts": "runtime.schedule_parts",
    "hooks": "runtime.hooks",
    "layers": "runtime.layers",
    "moe": "runtime.moe",
    "agreement": "runtime.agreement",
    "finite_grads": "runtime.finite_grads",
    "gdn_hooks": "runtime.gdn_hooks",
    "mamba_hooks": "runtime.mamba_hooks",
    "models": "models.tiny",
    "hybrid": "models.hybrid",
    "model_configs": "models.model_configs",
    "checkpoints": "models.checkpoints",
    "hf_checkpoints": "models.hf_checkpoints",
    "gdn": "models.gdn",
    "config_support": "config.config_support",
    "config_support_moe": "config.config_support_moe",
    "config_rules": "config.config_rules",
    "cpu_support": "support.cpu_support",
    "launch": "support.launch",
    "failures": "support.failures",
    "gdn_cpu": "support.gdn_cpu",
    "mamba_cpu": "support.mamba_cpu",
}
STAYS = {"__init__", "__main__", "rl", "training"}  # the public entry points
SPLITS: dict = {}  # files over MAX_LINES today -> how to split them by hand (none left)
MAX_LINES = 400
TEXT_GLOBS = ("**/*.py", "**/*.md", "Makefile", "setup.py", "pytest.ini", ".ci/*")
SKIP_DIRS = {".venv", ".git", "build", "__pycache__"}
KEEP_AS_IS = {"layout_move.py", "test_layout_move.py"}  # they spell out the old names

__all__ = ["MOVES", "SUBPACKAGES", "STAYS", "SPLITS", "unplaced", "shown_paths", "oversize", "rewrite",
           "apply", "main"]


def unplaced(repo: Path = REPO) -> list[str]:
    """Top-level modules of megatron_patches/ that the plan does not place."""
    names = {p.stem for p in (repo / PACKAGE).glob("*.py")}
    return sorted(names - set(MOVES) - STAYS)


def shown_paths(repo: Path = REPO) -> list[str]:
    """Moved modules whose old import path the README or examples/ show (they get a shim)."""
    texts = [(repo / "README.md").read_text()]
    texts += [p.read_text() for p in sorted((repo / "examples").rglob("*.py"))]
    pattern = re.compile(rf"(?:from|import)\s+{PACKAGE}\.(\w+)|from\s+{PACKAGE}\s+import\s+(\w+)")
    found = {a or b for text in texts for a, b in pattern.findall(text)}
    return sorted(found & set(MOVES))


def oversize(repo: Path = REPO, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(path, lines) of the project's Python files over `limit` lines (tests excepted)."""
    rows = []
    for top in ("prefix_schedule", PACKAGE, "tools"):
        for path in sorted((repo / top).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > limit:
                rows.append((str(path.relative_to(repo)), n))
    return rows


def _new_path(module: str) -> str:
    return f"{PACKAGE}/{MOVES[module].replace('.', '/')}.py"


def rewrite(text: str) -> str:
    """`text` with every reference to a moved module pointing at its new place."""
    names = "|".join(sorted(MOVES, key=len, reverse=True))

    def from_import(match: re.Match) -> str:
        indent, items = match.group(1), [s.strip() for s in match.group(2).split(",")]
        comment = f"  {match.group(3)}" if match.group(3) else ""
        moved = [i for i in items if i.split(" as ")[0] in MOVES]
        if not moved:
            return match.group(0)
        lines = []
        stay = [i for i in items if i not in moved]
        if stay:
            lines.append(f"{indent}from {PACKAGE} import {', '.join(stay)}")
        for item in moved:
            name, _, alias = item.partition(" as ")
            package, _, leaf = MOVES[name].rpartition(".")
            bound = alias or name
            lines.append(f"{indent}from {PACKAGE}.{package} import {leaf}"
                         + (f" as {bound}" if bound != leaf else ""))
        return "\n".join(lines) + comment

    text = re.sub(rf"\b{PACKAGE}/({names})\.py\b", lambda m: _new_path(m.group(1)), text)
    text = re.sub(rf"(?<![\w.]){PACKAGE}\.({names})\b(?!\.py)",
                  lambda m: f"{PACKAGE}.{MOVES[m.group(1)]}", text)
    return re.sub(rf"^([ \t]*)from {PACKAGE} import ([\w ,]+?)[ \t]*(#.*)?$", from_import,
                  text, flags=re.M)  # last: its output names new places already


def _text_files(repo: Path):
    seen = set()
    for glob in TEXT_GLOBS:
        for path in repo.glob(glob):
            if path.is_file() and not SKIP_DIRS & set(path.relative_to(repo).parts) \
                    and path not in seen and path.name not in KEEP_AS_IS:
                seen.add(path)
                yield path


def _models_init() -> str:
    return (f'"""{SUBPACKAGES["models"]}\n\n`from megatron_patches.models import build_model` (the '
            'README\'s path) hands out models/tiny.py\'s names, imported on first use."""\n'
            "import importlib\n\n\n"
            "def __getattr__(name: str):\n"
            "    if name.startswith('__') or name == 'tiny':  # the import machinery's questions\n"
            "        raise AttributeError(name)\n"
            "    return getattr(importlib.import_module(__name__ + '.tiny'), name)\n")


def _shim(old: str) -> str:
    new = f"{PACKAGE}.{MOVES[old]}"
    return (f'"""Moved to {new}; this path stays importable (the README or examples show it)."""\n'
            f"import sys\n\nimport {new}\n\nsys.modules[__name__] = {new}\n")


def apply(repo: Path = REPO) -> list[str]:
    """Do the move in `repo` (see the module docstring); returns what was done, line by line."""
    missing = unplaced(repo)
    if missing:
        raise ValueError(f"modules not in MOVES: {missing}; add each to MOVES (or STAYS) first")
    clash = [name for name in SUBPACKAGES if (repo / PACKAGE / name).exists()]
    if clash:
        raise ValueError(f"{PACKAGE}/{clash[0]} exists already: the move was applied, or a "
                         "merge added it; nothing done")
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True,
                            text=True, check=True).stdout
    if status.strip():
        raise ValueError("the work tree has changes; commit or stash them first")
    shims, done = shown_paths(repo), []
    for name, doc in SUBPACKAGES.items():
        (repo / PACKAGE / name).mkdir()
        (repo / PACKAGE / name / "__init__.py").write_text(f'"""{doc}"""\n')
    for old in MOVES:
        subprocess.run(["git", "mv", f"{PACKAGE}/{old}.py", _new_path(old)], cwd=repo, check=True)
        done.append(f"moved {PACKAGE}/{old}.py -> {_new_path(old)}")
    for path in _text_files(repo):
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            path.write_text(new)
            done.append(f"rewrote {path.relative_to(repo)}")
    for old in shims:
        target = repo / PACKAGE / ("models/__init__.py" if old == "models" else f"{old}.py")
        target.write_text(_models_init() if old == "models" else _shim(old))
        done.append(f"shim {target.relative_to(repo)} -> {PACKAGE}.{MOVES[old]}")
    subprocess.run(["git", "add", "-A", PACKAGE], cwd=repo, check=True)
    return done


def describe(repo: Path = REPO) -> str:
    lines = [f"{PACKAGE}/ subpackages:"]
    for name, doc in SUBPACKAGES.items():
        members = [old for old, new in MOVES.items() if new.startswith(name + ".")]
        lines.append(f"  {name}/  {doc}")
        lines += [f"      {old}.py -> {_new_path(old)}" for old in members]
    lines.append(f"  stay at the top: {', '.join(sorted(STAYS))}; megatron_lm/, patches/, "
                 "snapshots/ unchanged")
    lines.append(f"shims (old paths the README / examples show): {shown_paths(repo)}")
    missing = unplaced(repo)
    lines.append(f"modules not placed yet: {missing or 'none'}")
    big = oversize(repo)
    lines.append(f"files over {MAX_LINES} lines: " + (", ".join(f"{p} ({n})" for p, n in big)
                                                      or "none"))
    lines += [f"  split {path}: {how}" for path, how in SPLITS.items()
              if path in dict(big)]
    lines += [f"  split {path}: no plan yet, write one" for path, _ in big if path not in SPLITS]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apply", action="store_true", help="do the move (once, clean tree)")
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args(argv)
    print(describe(args.repo))
    if args.apply:
        try:
            done = apply(args.repo)
        except ValueError as exc:
            print(f"layout_move.py: error: {exc}", file=sys.stderr)
            return 1
        print("\n".join(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
