"""tools/bench.py and examples/grpo_demo.py run end to end on a tiny configuration.

Both run as subprocesses (each initialises its own one-process Megatron), started together so
their import times overlap. Only behaviour is asserted: the JSON fields and the relations between
them, the gradient agreement, the demo's exit status and its agreement line -- never timings.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
TINY_BENCH = ["--prefix-len", "64", "--suffix-len", "8", "--group-size", "3", "--num-groups", "2",
              "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256",
              "--steps", "1", "--warmup", "0"]
TIMEOUT = 240


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the bench and the quick demo at once; wait for both."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    commands = {
        "bench": [sys.executable, str(ROOT / "tools" / "bench.py"), *TINY_BENCH, "--json", str(out)],
        "demo": [sys.executable, str(ROOT / "examples" / "grpo_demo.py"), "--quick"],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        results[name] = (proc.returncode, stdout)
    return results, out


def test_bench_json_fields_are_consistent(runs):
    (rc, stdout), out = runs[0]["bench"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {
        "dense_seconds", "stock_dense_seconds", "reuse_seconds", "speedup", "ideal_speedup",
        "efficiency", "max_grad_rel_diff", "loss_dense", "loss_reuse", "model", "workload",
        "token_budget", "threads", "steps"}
    for name in ("dense_seconds", "stock_dense_seconds", "reuse_seconds"):
        assert result[name] > 0, name
    assert math.isclose(result["speedup"], result["dense_seconds"] / result["reuse_seconds"])
    assert math.isclose(result["efficiency"], result["speedup"] / result["ideal_speedup"])
    assert result["ideal_speedup"] > 1
    assert result["max_grad_rel_diff"] <= 1e-5
    assert math.isclose(result["loss_dense"], result["loss_reuse"], rel_tol=1e-5, abs_tol=1e-7)
    assert result["model"] == {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                               "num_attention_heads": 4, "num_query_groups": 2,
                               "vocab_size": 256, "gated_linear_unit": True}
    assert result["workload"] == {"prefix_len": 64, "suffix_len": 8, "group_size": 3,
                                  "num_groups": 2}
    assert (result["token_budget"], result["threads"], result["steps"]) == (3 * 8, 2, 1)
    assert "speedup" in stdout and "efficiency" in stdout


def test_demo_trains_both_runs_and_checks_agreement(runs):
    rc, stdout = runs[0]["demo"]
    assert rc == 0, stdout[-3000:]
    assert "agreement OK" in stdout
    assert "max relative weight difference" in stdout


def test_bench_refuses_bad_flags_before_compute():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--group-size", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--group-size=0" in proc.stderr
