"""Megatron-LM RL (train_rl.py, megatron/rl on the offline Megatron-LM main checkout): its GRPO
training step and its old/ref log-prob passes, stock vs prefix reuse, 3 iterations on CPU.

tests/train_rl_replay.py runs both in one process on the patched checkout (what is Megatron's
own code there and what is stubbed is listed in its docstring); this test compares, fp32:
per iteration the loss (train_rl.loss_func's reports), the grad norm, every gradient, the old and reference
log-probs at the loss positions, and every weight after the (SGD) optimizer step, within 1e-5
relative, failing on NaN/inf on either side; and that the reuse step really shared prefixes.
"""
import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from megatron_lm_runs import REPO, child_env
from megatron_trees import patched_tree

pytestmark = pytest.mark.megatron
TOL = 1e-5
RL_MODULES = ("httpx", "fastapi", "uvicorn", "openai")
"""Imported at the top of megatron/rl (its inference client and server): pinned in the Makefile."""


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    missing = [m for m in RL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's megatron/rl imports {', '.join(missing)}: run make setup "
                    "(or make test-frameworks)")
    tree = patched_tree("0.20.0", tmp_path_factory)  # skips naming the places when absent
    out = tmp_path_factory.mktemp("train_rl") / "replay.pt"
    run = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / "train_rl_replay.py"),
                          str(out)], env=child_env(tree), cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return torch.load(out)


def _close(a, b, what):
    assert math.isfinite(a) and math.isfinite(b), (what, a, b)
    assert abs(a - b) <= TOL * abs(a), (what, a, b)


def _tensors_close(a, b, what):
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: NaN or inf"
    scale = a.abs().max().item()
    assert scale > 0, f"{what}: all zero"
    diff = (a - b).abs().max().item() / scale
    assert diff <= TOL, f"{what}: max relative difference {diff:.3e}"


def test_train_rl_grpo_step_reuse_equals_stock_over_3_iterations(replay):
    stock, reuse = replay["stock"], replay["reuse"]
    assert len(stock["loss"]) == len(reuse["loss"]) == 3
    for it in range(3):
        _close(stock["loss"][it], reuse["loss"][it], f"loss {it + 1}")
        _close(stock["grad_norm"][it], reuse["grad_norm"][it], f"grad norm {it + 1}")
        _tensors_close(stock["old"][it], reuse["old"][it], f"old log-probs {it + 1}")
        _tensors_close(stock["ref"][it], reuse["ref"][it], f"ref log-probs {it + 1}")
        assert stock["grads"][it].keys() == reuse["grads"][it].keys()
        for name, g in stock["grads"][it].items():
            _tensors_close(g, reuse["grads"][it][name], f"gradient of {name}, iteration {it + 1}")
        assert stock["weights"][it].keys() == reuse["weights"][it].keys()
        for name, w in stock["weights"][it].items():
            _tensors_close(w, reuse["weights"][it][name], f"{name} after iteration {it + 1}")
    assert stock["loss"][0] != stock["loss"][2]  # the weights moved: 3 distinct iterations
    assert all(r == "dense" for r in stock["report"])
    for report in reuse["report"]:
        assert report.count("reuse (FLOP gain") == 2, report  # both GRPO groups shared
