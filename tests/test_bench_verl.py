"""`tools/bench.py --adapter verl` (tools/benchlib/adapter_verl.py): verl 0.9.1's own engine
step vs the registered prefix-reuse engine on a tiny model, in the frameworks venv (make
test-frameworks): the JSON fields and the gradient agreement, never timings. In a Python without
verl: exit 2 naming the environment to use."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[1]
HAS_VERL = importlib.util.find_spec("verl") is not None
TINY = ["--prefix-len", "48", "--suffix-len", "8", "--group-size", "3", "--num-groups", "2",
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "4", "--steps", "1", "--warmup", "0", "--threads", "1",
        "--overhead-groups", "4", "--overhead-group-size", "3"]


def bench(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def check_fields(result, adapter, dense_microbatches):
    assert result["adapter"] == adapter
    assert result["grads_finite"] and result["max_grad_rel_diff"] <= 1e-5
    assert result["num_microbatches"] == {"dense": dense_microbatches, "reuse": 1}
    assert result["ideal_speedup"] > 1 and result["adapter_overhead_seconds"] > 0
    assert result["efficiency"] == pytest.approx(result["speedup"] / result["ideal_speedup"])
    assert result["dense_seconds"] > 0 and result["reuse_seconds"] > 0
    assert result["workload"] == {"prefix_len": 48, "suffix_len": 8, "group_size": 3,
                                  "num_groups": 2}


@pytest.mark.skipif(HAS_VERL or os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1",
                    reason="verl is installed here: test_bench_adapter_verl runs instead")
def test_bench_adapter_verl_without_verl_names_the_environment():
    run = bench("--adapter", "verl", *TINY)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "make test-frameworks" in run.stderr and ".venv-frameworks" in run.stderr


@pytest.mark.skipif(not HAS_VERL and os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") != "1",
                    reason="verl is installed by `make test-frameworks`")
def test_bench_adapter_verl(tmp_path):
    out = tmp_path / "verl.json"
    run = bench("--adapter", "verl", *TINY, "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # verl's dynamic batch size, balanced to one sample's tokens: one sample per micro-batch
    check_fields(result, "verl", dense_microbatches=6)
    assert result["loss"]["dense"] == pytest.approx(result["loss"]["reuse"], rel=1e-5)
