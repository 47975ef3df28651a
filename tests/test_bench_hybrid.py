"""tools/bench.py on hybrid models (benchlib/hybrid.py): `--linear-attention-freq` (GPTModel with
Gated DeltaNet) and `--hybrid-pattern` (HybridModel with GDN and Mamba-2 layers) run end to end
on tiny shapes; their gradient check passes and `ideal_speedup` is the FLOP model's for the
hybrid shape. Behaviour only (fields, the check, refusals), never timings."""

import json
import math
import subprocess
import sys

import pytest

from test_bench_demo import ENV, ROOT, TIMEOUT

pytestmark = pytest.mark.megatron

TINY = ["--prefix-len", "48", "--suffix-len", "6", "--group-size", "2", "--num-groups", "2",
        "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--vocab-size", "256", "--steps", "1", "--warmup", "0",
        "--skip-stock"]
RUNS = {"gdn": ["--linear-attention-freq", "2", "--num-layers", "4"],
        "pattern": ["--hybrid-pattern=G*M-", "--num-layers", "4"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_hybrid")
    procs = {name: subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "bench.py"), *TINY, *flags,
         "--json", str(out / f"{name}.json")], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for name, flags in RUNS.items()}
    results = {}
    for name, proc in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        results[name] = (proc.returncode, stdout, out / f"{name}.json")
    return results


def _expected_ideal(flags):
    sys.path.insert(0, str(ROOT / "tools"))
    from benchlib.config import build_parser, config_from_args
    from benchlib.measure import config_batch, config_plan
    from prefix_schedule.planning.flops import ideal_speedup

    config, _ = config_from_args(build_parser(""), [*TINY, *flags])
    batch = config_batch(config)
    return config, ideal_speedup(config.model_dims(), batch, config_plan(config, batch))


@pytest.mark.parametrize("name", list(RUNS))
def test_hybrid_bench_runs_and_matches_stock_dense(runs, name):
    rc, stdout, path = runs[name]
    assert rc == 0, stdout[-3000:]
    result = json.loads(path.read_text())
    assert result["max_grad_rel_diff"] <= 1e-5
    assert math.isclose(result["loss_dense"], result["loss_reuse"], rel_tol=1e-5, abs_tol=1e-7)
    config, ideal = _expected_ideal(RUNS[name])
    assert result["ideal_speedup"] == pytest.approx(ideal, rel=1e-12)
    assert math.isclose(result["efficiency"], result["speedup"] / result["ideal_speedup"])
    model = result["model"]
    assert (model["linear_attention_freq"], model["hybrid_pattern"]) == (
        config.linear_attention_freq, config.hybrid_pattern)
    if name == "gdn":  # Qwen3.5's gated attention; GDN shape from benchlib/hybrid.py
        assert model["attention_output_gate"] is True
        assert (model["linear_num_key_heads"], model["linear_num_value_heads"]) == (2, 4)
    else:
        assert model["mamba_num_heads"] * model["mamba_head_dim"] == 2 * 64
    memory = result["memory"]  # the state cache is counted; capacity is not modelled yet
    assert 0 < memory["reuse_cache_bytes"] < memory["reuse_peak_saved_bytes"]
    assert memory["capacity_ratio"] is None


REFUSALS = [
    (["--hybrid-pattern=G*E-"], "not ['E']"),
    (["--hybrid-pattern=G*M"], "give --num-layers 3"),
    (["--hybrid-pattern=-", "--num-layers", "1"], "nothing of a prefix would be cached"),
    (["--linear-attention-freq", "4", "--hybrid-pattern=G*M-"], "not both"),
    (["--linear-attention-freq", "0"], "give an int >= 1"),
    (["--linear-attention-freq", "4", "--cp", "2"], "--pp/--tp/--dp/--cp > 1"),
    (["--linear-attention-freq", "4", "--tree", "2x2"], "--tree"),
    (["--linear-attention-freq", "4", "--recompute", "full"], "--recompute full"),
]


def test_hybrid_bench_refuses_bad_combinations_before_compute():
    procs = [(flags, message, subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "bench.py"), *flags], cwd=ROOT, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for flags, message in REFUSALS]
    for flags, message, proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (flags, stderr[-2000:])
        assert message in stderr, (flags, stderr[-2000:])
