"""`tools/bench.py --adapter megatron-rl`: Megatron-LM RL's training step, stock vs prefix reuse.

Runs benchlib/train_rl_worker.py in one process on a patched copy of the offline Megatron-LM
main tree (tests/megatron_trees.py finds the tarball: `$MEGATRON_LM_TARBALLS` or
`shared/megatron-lm/` beside or above the checkout), with that tree first on PYTHONPATH; the
worker drives Megatron-LM's own code as tests/train_rl_replay.py does (its stubs, named there)
and writes the result. Where the tree or Megatron-LM RL's imports are missing: ValueError with
the reason (bench.py exits 2); a failed worker: RuntimeError with its output's tail.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from benchlib.config import BenchConfig

__all__ = ["run_train_rl_bench", "RL_MODULES", "MAIN_VERSION"]

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "train_rl_worker.py"
MAIN_VERSION = "0.20.0"
"""Megatron-LM main (the 2026-08-22 snapshot), the tree train_rl.py and megatron/rl come from."""
RL_MODULES = ("httpx", "fastapi", "uvicorn", "openai")
"""Imported at the top of Megatron-LM's megatron/rl (pinned in the Makefile)."""


class _TmpFactory:
    """tmp_path_factory's `mktemp` for tests/megatron_trees.py, under one directory."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.base))


def _patched_main_tree(base: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    import pytest
    import megatron_trees
    try:
        megatron_trees.find_tarball(MAIN_VERSION)  # no factory: never fetches
    except (pytest.skip.Exception, pytest.fail.Exception) as missing:
        raise ValueError(f"--adapter megatron-rl needs the offline Megatron-LM main tree: "
                         f"{missing.msg}") from None
    return megatron_trees.patched_tree(MAIN_VERSION, _TmpFactory(base))


def run_train_rl_bench(config: BenchConfig, raw_times: Dict[str, List[float]]) -> dict:
    """The --adapter megatron-rl result (benchlib/adapter_bench.py's fields)."""
    missing = [m for m in RL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--adapter megatron-rl: Megatron-LM's megatron/rl imports "
                         f"{', '.join(missing)}, not installed here: run make setup (or use "
                         ".venv-frameworks)")
    with tempfile.TemporaryDirectory(prefix="bench-train-rl-") as tmp:
        tree = _patched_main_tree(Path(tmp))
        spec, out = Path(tmp) / "config.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(dataclasses.asdict(config)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
        run = subprocess.run([sys.executable, "-W", "ignore", str(WORKER), str(tree), str(spec),
                              str(out)], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=config.timeout)
        if run.returncode != 0:
            raise RuntimeError(f"the megatron-rl worker failed (exit {run.returncode}):\n"
                               + (run.stdout + run.stderr)[-6000:])
        result = json.loads(out.read_text())
    raw_times.update(result.pop("raw_times"))
    return result
