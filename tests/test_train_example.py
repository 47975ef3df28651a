"""examples/train_grpo_megatron.py under torchrun (2 gloo processes, PP=2): dense and prefix
reuse report the same loss and the same gradient norm from Megatron's optimizer."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "2", "--num-groups", "2", "--group-size", "3", "--prefix-len", "40",
         "--max-response-len", "12", "--token-budget", "24", "--num-layers", "2",
         "--hidden-size", "64"]


def _run(*extra):
    # strict NCCL p2p semantics on gloo (megatron_patches/p2p.py), as the whole pipeline matrix
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFIX_REUSE_P2P_STRICT": "1",
           # this checkout's packages, not an installed copy
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "train_grpo_megatron.py"), "--pp", "2",
                          "--cpu", *SMALL, *extra], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = re.findall(r"step (\d+): loss (\S+)  grad norm (\S+)", out.stdout)
    assert len(lines) == 2, out.stdout
    return [(float(loss), float(norm)) for _, loss, norm in lines]


def test_torchrun_example_reuse_matches_dense():
    dense, reuse = _run("--dense"), _run("--prefix-chunk-tokens", "16")
    for (dl, dn), (rl, rn) in zip(dense, reuse):
        assert abs(dl - rl) <= 1e-5 * max(abs(dl), 1e-3)
        assert abs(dn - rn) <= 1e-4 * dn and dn > 0
