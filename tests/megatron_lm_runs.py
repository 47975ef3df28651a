"""Helpers for tests that run the Megatron-LM entry point (examples/megatron_lm/train_grpo.py)
under torchrun on an offline Megatron-LM checkout (tests/megatron_trees.py finds it).

`entry_tree(version, factory)` is a patched checkout with Megatron's dataset helpers compiled
(initialize_megatron compiles them on rank 0; pybind11 comes from `make setup`); `torchrun(...)`
runs the entry point like a user, with the checkout and this repository on PYTHONPATH, and ends
every process it started (tests/reaped.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

from megatron_trees import REPO, patched_tree
from reaped import run_reaped

__all__ = ["entry_tree", "model_args", "small_args", "torchrun", "iterations", "rank_params",
           "child_env"]

ENTRY = REPO / "examples" / "megatron_lm" / "train_grpo.py"
_TREES: Dict[str, Path] = {}


def child_env(tree: Path) -> Dict[str, str]:
    """The environment a user of `tree` has: checkout + this repo on the path, the venv's
    executables first, one thread per rank, CUDA_DEVICE_MAX_CONNECTIONS=1 (TP needs it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), OMP_NUM_THREADS="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    return env


def entry_tree(version: str, factory) -> Path:
    """A patched checkout of `version` with megatron/core/datasets' C++ helpers built."""
    if version not in _TREES:
        tree = patched_tree(version, factory)
        subprocess.run(["make", "-C", str(tree / "megatron" / "core" / "datasets")], check=True,
                       env=child_env(tree), capture_output=True, timeout=300)
        _TREES[version] = tree
    return _TREES[version]


def model_args(name: str) -> List[str]:
    from megatron_patches.model_configs import get_model_spec

    return get_model_spec(name).megatron_args()


def small_args(iters: int) -> List[str]:
    """A tiny GRPO workload: 2 prompts x 3 responses, rows <= 64 tokens, constant LR."""
    return ["--seq-length", "64", "--train-iters", str(iters), "--lr", "1e-4", "--min-lr", "1e-4",
            "--grpo-prompts-per-step", "2", "--grpo-group-size", "3", "--global-batch-size", "6",
            "--calculate-per-token-loss", "--prefix-reuse-token-budget", "32",
            "--log-interval", "1", "--clip-grad", "0", "--seed", "5"]


def torchrun(tree: Path, nproc: int, args: Sequence[str], *, timeout: float = 600,
             launcher: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N ENTRY args` (or `launcher` + args)."""
    command = list(launcher) or [sys.executable, "-m", "torch.distributed.run",
                                 "--nproc-per-node", str(nproc), str(ENTRY)]
    return run_reaped(command + list(args), env=child_env(tree), cwd=REPO, timeout=timeout)


_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?policy loss: (\S+) \|.*?grad norm: (\S+) \|")


def iterations(output: str) -> Dict[int, tuple]:
    """iteration -> (policy loss, grad norm) from Megatron's training_log lines."""
    return {int(i): (float(loss), float(norm)) for i, loss, norm in _LINE.findall(output)}


def rank_params(directory: Path, iteration: int) -> Dict[str, Dict]:
    """rank file name -> {parameter: tensor} dumped by --prefix-reuse-dump-params."""
    from safetensors.torch import load_file

    return {p.name: load_file(p) for p in sorted((directory / f"iter_{iteration}").glob("*.safetensors"))}
