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
from typing import Callable, Dict, List, Sequence

from megatron_trees import REPO, patched_tree
from reaped import run_reaped

__all__ = ["entry_tree", "model_args", "small_args", "torchrun", "iterations", "rank_params",
           "child_env", "COMPARE_ARGS", "assert_dumps_equal"]

COMPARE_ARGS = ["--adam-eps", "1", "--lr", "0.1", "--min-lr", "0.1"]
"""After small_args, for runs whose weights are compared: Adam with eps=1, far above |g|, so each
update is near-linear in the gradient (a gradient entry at float-noise level cannot get an O(lr)
update of noise sign: tests/megatron_lm_args.py)."""

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
    from megatron_patches.models.model_configs import get_model_spec

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


def assert_dumps_equal(dense_dir: Path, reuse_dir: Path, iters: int, tol: float = 1e-5,
                       may_be_zero: Callable[[str], bool] = lambda name: False,
                       loose: Callable[[str], float] = lambda name: 0.0) -> None:
    """The --prefix-reuse-dump-params dumps of a dense and a reuse run: at every iteration 1..iters
    and on every rank, every gradient (DDP's reduced main_grad, `grad.*`) and every weight within
    `tol` per tensor (`max_relative_diff`: max|d - r| / max|d|, inf on a NaN or inf either side),
    every parameter with a gradient, none all-zero or non-finite on either side (except the names
    `may_be_zero` allows, e.g. an expert that got no token). `loose(name)` > 0 is a wider
    tolerance for that one tensor; a caller that sets it says why."""
    from megatron_patches.training import max_relative_diff, missing_grads

    for i in range(1, iters + 1):
        dense, reuse = rank_params(dense_dir, i), rank_params(reuse_dir, i)
        assert dense.keys() == reuse.keys() and dense, (i, sorted(dense), sorted(reuse))
        for rank, tensors in dense.items():
            grads = {n: t for n, t in tensors.items() if n.startswith("grad.")}
            assert grads and len(grads) == len(tensors) // 2, (i, rank)  # every parameter
            missing = [m for m in missing_grads(dense=grads, reuse={
                n: reuse[rank][n] for n in grads}) if not may_be_zero(m.split(": ", 1)[1])]
            assert not missing, (i, rank, missing[:5])
            per = {n: max_relative_diff({n: t}, {n: reuse[rank][n]}) for n, t in tensors.items()}
            worst = sorted(per, key=per.get, reverse=True)[:3]
            bad = [(n, d) for n, d in per.items() if not d <= max(tol, loose(n))]
            assert not bad, (i, rank, [(n, per[n]) for n in worst], bad[:5])
