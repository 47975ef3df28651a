"""No import circles in prefix_schedule/, megatron_patches/ and tools/.

A circle hidden behind a deferred import (an `import` inside a function, a module `__getattr__`)
is still a circle: the two modules cannot be read, tested or moved apart. So every import
statement counts, at module level or inside a function; only `if TYPE_CHECKING:` blocks are
left out (they never run). Edges go to the module an import names (`from pkg import sub` names
pkg/sub.py when that file exists, else pkg/__init__.py); the parent packages Python also
imports on the way are not edges, or every package __init__ that re-exports its modules would
be a circle. tools/ scripts import each other by their names under tools/ (`benchlib.config`,
`replay_runs`), as they run with tools/ on sys.path. Runs in milliseconds: no module is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("prefix_schedule", "megatron_patches")


def module_files(repo: Path, packages=PACKAGES, scripts: str = "tools") -> dict[str, Path]:
    """Dotted module name -> file, for the packages (named from the repo root) and the scripts
    folder (named from inside it)."""
    found = {}
    roots = [(repo, repo / name) for name in packages] + [(repo / scripts, repo / scripts)]
    for root, folder in roots:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The modules of `modules` that `name` (at `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(_known(alias.name, modules) for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            targets.add(full if full in modules else _known(base, modules))
    return {t for t in targets if t and t != name}


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {name: sorted(imports_of(name, path, modules)) for name, path in modules.items()}
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(circles)


def test_no_import_circles():
    modules = module_files(REPO)
    assert len(modules) > 100, f"found only {len(modules)} modules: is the layout changed?"
    circles = import_circles(modules)
    assert not circles, "import circles (break each one: move the shared piece to a module both " \
                        "can import, or drop a back-compat re-export):\n" + \
                        "\n".join(" <-> ".join(c) for c in circles)


def test_the_check_finds_a_deferred_circle_and_ignores_type_checking(tmp_path):
    package = tmp_path / "prefix_schedule"
    package.mkdir()
    (tmp_path / "megatron_patches").mkdir()
    (tmp_path / "tools" / "benchlib").mkdir(parents=True)
    (package / "__init__.py").write_text("from prefix_schedule.a import f\n")
    (package / "a.py").write_text("from prefix_schedule import b\n\ndef f():\n    return b\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from prefix_schedule.d import X\n")
    (package / "d.py").write_text("from prefix_schedule.c import TYPE_CHECKING\n")
    tools = tmp_path / "tools"
    (tools / "benchlib" / "__init__.py").write_text("")
    (tools / "benchlib" / "x.py").write_text("import replay\n")
    (tools / "replay.py").write_text("def main():\n    from benchlib.x import y\n")
    circles = import_circles(module_files(tmp_path))
    assert circles == [["benchlib.x", "replay"], ["prefix_schedule.a", "prefix_schedule.b"]]
