"""Every Python snippet in README.md and docs/ is a file of examples/snippets/ that runs as
written (issue 36: the README's and FRAMEWORKS.md's snippets failed verbatim on CPU).

* Each ```python block of README.md and docs/*.md follows a `<!-- snippet: PATH -->` line and
  its text is PATH's text exactly; every file of examples/snippets/ is shown somewhere.
* Each file runs in a fresh interpreter (`python examples/snippets/NAME.py`, nothing imported
  before it: the CPU support and install order are the file's own) and exits 0; the trace
  lines the verl snippet writes are read by `tools/trace.py import-generic`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNIPPETS = REPO / "examples" / "snippets"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.S | re.M)
MARKER = re.compile(r"<!-- snippet: (\S+) -->\n$")


def _blocks():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            before = text[:match.start()]
            marker = MARKER.search(before[-200:])
            yield doc.relative_to(REPO), marker.group(1) if marker else None, match.group(2)


def test_every_python_block_is_a_snippet_file_verbatim():
    shown = set()
    for doc, path, code in _blocks():
        assert path is not None, f"{doc}: a ```python block without a <!-- snippet: PATH --> line"
        assert (REPO / path).is_file(), f"{doc}: {path} does not exist"
        assert code == (REPO / path).read_text(encoding="utf-8"), (
            f"{doc}: the block shown for {path} differs from the file; paste the file's text")
        shown.add(Path(path).name)
    assert shown == {p.name for p in SNIPPETS.glob("*.py")}, "a snippet file no doc shows"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("PREFIX_REUSE_CPU", None)
    return env


@pytest.mark.megatron
def test_every_snippet_runs_as_written(tmp_path):
    """All files at once, each its own interpreter (two at a time keeps two cores busy)."""
    files = sorted(SNIPPETS.glob("*.py"))
    results = {}
    for start in range(0, len(files), 2):
        running = [(f, subprocess.Popen([sys.executable, str(f)], cwd=tmp_path, env=_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True))
                   for f in files[start:start + 2]]
        for f, proc in running:
            out, _ = proc.communicate(timeout=300)
            results[f.name] = (proc.returncode, out)
    failed = {name: out[-3000:] for name, (rc, out) in results.items() if rc != 0}
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())
    from tools_import import tool
    assert tool("trace").main(["import-generic", str(tmp_path / "rollouts.jsonl"),
                               "--out", str(tmp_path / "trace.jsonl"), "--vocab-size", "100"]) == 0
