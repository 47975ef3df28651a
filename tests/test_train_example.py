"""examples/train_grpo_megatron.py under torchrun (2 gloo processes): at PP=2 dense and prefix
reuse report the same loss and the same gradient norm from Megatron's optimizer; a rank that
stalls -- mid-run or at start-up -- ends the job at the collective timeout, and the error names it
(not its waiting peer). Every process a run starts is ended when it returns (tests/reaped.py)."""

import os
import re
import sys
from pathlib import Path

import pytest
from reaped import run_reaped

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "2", "--num-groups", "2", "--group-size", "3", "--prefix-len", "40",
         "--max-response-len", "12", "--token-budget", "24", "--num-layers", "2",
         "--hidden-size", "64"]


def _torchrun(*args, timeout=300):
    # the checkout under test first on the path (the script's own directory is examples/)
    # strict NCCL p2p semantics on gloo (megatron_patches/runtime/p2p.py), as the whole pipeline matrix
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PREFIX_REUSE_P2P_STRICT": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return run_reaped([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       str(ROOT / "examples" / "train_grpo_megatron.py"), "--cpu", *SMALL, *args],
                      timeout=timeout, env=env, cwd=ROOT)


def _run(*extra):
    out = _torchrun("--pp", "2", *extra)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = re.findall(r"step (\d+): loss (\S+)  grad norm (\S+)", out.stdout)
    assert len(lines) == 2, out.stdout
    return [(float(loss), float(norm)) for _, loss, norm in lines]


def test_torchrun_example_reuse_matches_dense():
    dense, reuse = _run("--dense"), _run("--prefix-chunk-tokens", "16")
    for (dl, dn), (rl, rn) in zip(dense, reuse):
        assert abs(dl - rl) <= 1e-5 * max(abs(dl), 1e-3)
        assert abs(dn - rn) <= 1e-4 * dn and dn > 0


def test_torchrun_example_a_stalled_rank_ends_the_job_and_is_named():
    """Rank 1 sleeps forever before its first step; rank 0's gradient all-reduce fails after the
    8 s collective timeout (instead of torch's 30-minute default), its error names rank 1, and
    torchrun stops the job (the subprocess timeout only guards start-up on a busy machine)."""
    out = _torchrun("--collective-timeout", "8", "--stall-rank", "1", timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    assert "[rank 0] rank 1 stalled" in text, text[-4000:]
    assert len(out.descendants) >= 2 and not any(p.is_running() for p in out.descendants)


def test_torchrun_example_a_rank_stalled_at_start_up_obeys_the_collective_timeout():
    """Rank 1 sleeps before the default process group exists: rank 0's rendezvous fails after
    the 8 s collective timeout (it used to wait a fixed 600 s, outside the failure report), and
    its error names rank 1. The 240 s limit is far below the old 600 s: a run that ignored the
    timeout fails here with TimeoutExpired."""
    out = _torchrun("--collective-timeout", "8", "--stall-rank", "1", "--stall-at", "startup",
                    timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    assert "[rank 0] rank 1 stalled" in text, text[-4000:]
    assert not any(p.is_running() for p in out.descendants)
