"""tools/bench.py and examples/grpo_demo.py run end to end on a tiny configuration.

The bench (one process and a `--pp 2` layout) and the demo run as subprocesses (each initialises
its own Megatron), started together so their import times overlap. Only behaviour is asserted:
the JSON fields and the relations between them, the gradient agreement, the layout and attention
backend recorded, the demo's exit status and its agreement line -- never timings. The launcher
behind `--pp/--tp/--dp` (megatron_patches/support/launch.py) is checked on its own for a failing and a
hung rank.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_patches.support.launch import LaunchError, launch
from prefix_schedule.attention import backends as attention_backends
from tools_import import tool

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
# The subprocesses import this checkout, not whatever checkout an editable install points at.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
TINY_BENCH = ["--prefix-len", "64", "--suffix-len", "8", "--group-size", "3", "--num-groups", "2",
              "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256",
              "--steps", "1", "--warmup", "0"]
TIMEOUT = 240
FIELDS = {"dense_seconds", "stock_dense_seconds", "reuse_seconds", "speedup", "ideal_speedup",
          "ideal_speedup_basis", "efficiency", "attention_backend", "max_grad_rel_diff",
          "loss_dense", "loss_reuse", "layout", "model", "workload", "token_budget",
          "prefix_chunk_tokens", "threads", "threads_per_rank", "steps", "memory", "dense_batched",
          "timing", "production_settings", "ep", "aux_loss_dense", "aux_loss_reuse",
          "offload_prefix_activations", "recompute"}
MEMORY_FIELDS = {"dense_peak_saved_bytes", "reuse_peak_saved_bytes",
                 "reuse_suffix_phase_peak_bytes", "reuse_cache_bytes", "reuse_peak_host_bytes",
                 "reuse_phase_peak_bytes", "suffix_phase_reduction", "step_peak_reduction",
                 "offload_prefix_activations", "recompute", "basis", "capacity_ratio",
                 "capacity_basis"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the bench (one process; PP=2 with the math backend and prefix chunks) and the quick
    demo at once."""
    out = tmp_path_factory.mktemp("bench")
    bench = [sys.executable, str(ROOT / "tools" / "bench.py"), *TINY_BENCH]
    commands = {
        "bench": [*bench, "--dense-micro-batch-size", "2", "--offload-prefix-activations",
                  "--json", str(out / "bench.json")],
        "bench_pp2": [*bench, "--pp", "2", "--attention-backend", "math", "--timeout", "200",
                      "--prefix-chunk-tokens", "32", "--json", str(out / "bench_pp2.json")],
        "demo": [sys.executable, str(ROOT / "examples" / "grpo_demo.py"), "--quick"],
        "bench_vpp": [*bench, "--num-layers", "4", "--pp", "2", "--vpp", "2", "--production",
                      "--skip-stock", "--timeout", "200", "--json", str(out / "bench_vpp.json")],
        "bench_tree": [*bench, "--tree", "3x2", "--node-len", "12", "--skip-stock",
                       "--json", str(out / "bench_tree.json")],
        "bench_budget": [*bench, "--skip-stock", "--memory-budget-mib", "2",
                         "--json", str(out / "bench_budget.json")],
        "bench_moe_ep2": [*bench, "--num-experts", "4", "--ep", "2", "--dp", "2",
                          "--skip-stock", "--timeout", "200", "--json",
                          str(out / "bench_moe_ep2.json")],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT,
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


def _check_result(result: dict) -> None:
    for name in ("dense_seconds", "stock_dense_seconds", "reuse_seconds"):
        assert result[name] > 0, name
    assert math.isclose(result["speedup"], result["dense_seconds"] / result["reuse_seconds"])
    assert math.isclose(result["efficiency"], result["speedup"] / result["ideal_speedup"])
    assert result["ideal_speedup"] > 1
    assert result["max_grad_rel_diff"] <= 1e-5
    assert math.isclose(result["loss_dense"], result["loss_reuse"], rel_tol=1e-5, abs_tol=1e-7)
    assert result["model"] == {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                               "num_attention_heads": 4, "num_query_groups": 2,
                               "vocab_size": 256, "gated_linear_unit": True,
                               "num_experts": None, "moe_router_topk": 0}
    assert result["workload"] == {"prefix_len": 64, "suffix_len": 8, "group_size": 3,
                                  "num_groups": 2, "tree": None, "node_len": None}
    assert (result["token_budget"], result["threads"], result["steps"]) == (3 * 8, 2, 1)
    timing = result["timing"]  # every path warmed up alike (0 here), interleaved
    assert (timing["warmup_steps_per_path"], timing["interleaved"]) == (0, True)
    assert "perf_counter" in timing["basis"]  # CPU; CUDA events on a GPU
    timed = {"dense", "stock_dense", "reuse"} | ({"dense_batched"} if result["dense_batched"] else set())
    assert set(timing["cpu_seconds"]) == timed and min(timing["cpu_seconds"].values()) > 0
    assert timing["tokens_per_microbatch"]["dense"] == 64 + 8 - 1
    assert timing["tokens_per_microbatch"]["reuse_max"] <= result["token_budget"]


def test_bench_memory_budget_picks_each_paths_packing(runs):
    """--memory-budget-mib: dense takes the most rows per microbatch that fit, reuse the budget
    planner's plan; both within the budget (predicted), the speedup at equal memory reported,
    reuse still equal to stock dense; memory.capacity_ratio from the accounting model."""
    (rc, stdout), out = runs[0]["bench_budget"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads((out / "bench_budget.json").read_text())
    budget, mib = result["memory_budget"], 2 ** 20
    assert budget["budget_mib"] == 2.0 and budget["dense"]["micro_batch_size"] == 2
    assert budget["dense"]["path"] == "dense_batched" and result["dense_batched"]
    assert budget["dense"]["predicted_peak_bytes"] <= 2 * mib
    assert budget["reuse"]["predicted_peak_bytes"]["step"] <= 2 * mib
    assert math.isclose(budget["speedup_at_equal_memory"],
                        result["dense_batched"]["seconds"] / result["reuse_seconds"])
    assert result["max_grad_rel_diff"] <= 1e-5
    assert result["memory"]["reuse_peak_saved_bytes"] <= 1.1 * 2 * mib  # measured
    assert result["memory"]["capacity_ratio"] > 1
    assert "speedup at equal memory" in stdout and "memory: budget 2.00 MiB" in stdout


def test_bench_json_fields_are_consistent(runs):
    (rc, stdout), out = runs[0]["bench"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert set(result) == FIELDS
    _check_result(result)
    assert result["layout"] == {"pp": 1, "tp": 1, "dp": 1, "vpp": 1, "ep": 1}
    assert result["threads_per_rank"] == 2
    assert result["aux_loss_dense"] is result["aux_loss_reuse"] is None  # no MoE
    assert result["prefix_chunk_tokens"] is None
    # "auto" records what selection picks for the model's fp32 CPU tensors (head_dim 64 / 4)
    auto = attention_backends.select_backend("auto", device="cpu", dtype=torch.float32, head_dim=16)
    assert result["attention_backend"] == auto.name
    assert "speedup" in stdout and "efficiency" in stdout
    memory = result["memory"]
    assert set(memory) == MEMORY_FIELDS
    assert (memory["offload_prefix_activations"], memory["recompute"]) == (True, "none")
    assert result["offload_prefix_activations"] and result["recompute"] == "none"
    for name in MEMORY_FIELDS - {"basis", "suffix_phase_reduction", "step_peak_reduction",
                                 "reuse_phase_peak_bytes", "offload_prefix_activations",
                                 "recompute", "capacity_ratio", "capacity_basis"}:
        assert isinstance(memory[name], int) and memory[name] > 0, name  # host: offloaded
    assert set(memory["reuse_phase_peak_bytes"]) == {"PF", "SF", "SB", "PB", "RG", "suffix"}
    # the suffix phase is part of the step; the cache is part of what the phase holds
    assert memory["reuse_cache_bytes"] < memory["reuse_suffix_phase_peak_bytes"]
    assert memory["reuse_suffix_phase_peak_bytes"] <= memory["reuse_peak_saved_bytes"]
    assert memory["reuse_peak_saved_bytes"] < memory["dense_peak_saved_bytes"]
    assert math.isclose(memory["suffix_phase_reduction"], 1 - memory[
        "reuse_suffix_phase_peak_bytes"] / memory["dense_peak_saved_bytes"])
    assert math.isclose(memory["step_peak_reduction"], 1 - memory[
        "reuse_peak_saved_bytes"] / memory["dense_peak_saved_bytes"])
    assert ("device MiB (saved-tensor accounting, not an allocator; recompute none, offload "
            "True): dense peak") in stdout
    batched = result["dense_batched"]  # --dense-micro-batch-size 2: two 71-token rows per microbatch
    assert (batched["micro_batch_size"], batched["tokens_per_microbatch"]) == (2, 2 * 71)
    assert batched["seconds"] > 0 and batched["max_grad_rel_diff_vs_stock_dense"] <= 1e-5
    assert math.isclose(batched["speedup"], batched["seconds"] / result["reuse_seconds"])
    assert "dense batched (2 rows/mb)" in stdout


def test_bench_tree_reports_the_trees_flop_ratio(runs):
    """--tree 3x2: a root, 2 children, 4 grandchildren of 12 tokens, 3 trajectories per leaf;
    the ideal is that tree's FLOP ratio and the gradients match stock dense."""
    from prefix_schedule.planning.flops import ideal_speedup

    sys.path.insert(0, str(ROOT / "tools"))
    from benchlib.config import BenchConfig
    from benchlib.measure import config_batch, config_plan

    (rc, stdout), out = runs[0]["bench_tree"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads((out / "bench_tree.json").read_text())
    assert result["workload"]["tree"] == "3x2" and result["workload"]["node_len"] == 12
    assert result["max_grad_rel_diff"] <= 1e-5 and result["stock_dense_seconds"] is None
    config = BenchConfig(tree="3x2", node_len=12, suffix_len=8, group_size=3, num_groups=2,
                         num_layers=2, hidden_size=64, ffn_hidden_size=128,
                         num_attention_heads=4, num_query_groups=2, vocab_size=256)
    batch = config_batch(config)
    assert [g.num_nodes for g in batch.groups] == [7, 7]
    assert [len(g.trajectories) for g in batch.groups] == [12, 12]
    ideal = ideal_speedup(config.model_dims(), batch, config_plan(config, batch))
    assert math.isclose(result["ideal_speedup"], ideal) and ideal > 1.5
    assert result["timing"]["tokens_per_microbatch"]["dense"] == 3 * 12 + 8 - 1
    assert "prefix trees 3x2" in stdout


def test_bench_pp2_runs_two_stage_processes(runs):
    (rc, stdout), out = runs[0]["bench_pp2"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads((out / "bench_pp2.json").read_text())
    assert set(result) == FIELDS  # no "placement" without DP
    _check_result(result)
    assert result["layout"] == {"pp": 2, "tp": 1, "dp": 1, "vpp": 1, "ep": 1}  # the sizes Megatron ran with
    assert result["threads_per_rank"] == 1  # 2 threads over 2 processes
    assert result["attention_backend"] == "math"
    assert result["prefix_chunk_tokens"] == 32  # 63 cached tokens: 2 chunks per group
    assert result["memory"] is None  # measured in the single-process path only
    assert result["dense_batched"] is None  # a 71-token row exceeds the 24-token budget
    # the ideal is the whole batch's FLOP ratio, the same as without the pipeline
    single = json.loads((out / "bench.json").read_text())
    assert result["ideal_speedup"] == single["ideal_speedup"]
    assert "pp 2 x tp 1 x dp 1 = 2 process(es)" in stdout


def test_bench_virtual_stages_with_production_settings(runs):
    """--pp 2 --vpp 2 --production: two model chunks per rank, Megatron's interleaved dense
    schedule vs the reuse executor's interleaved plan, every chunk DDP-wrapped with
    overlap_grad_reduce and the distributed optimizer's layout, outputs pseudo-freed."""
    (rc, stdout), out = runs[0]["bench_vpp"], runs[1]
    assert rc == 0, stdout[-3000:]
    result = json.loads((out / "bench_vpp.json").read_text())
    assert result["layout"] == {"pp": 2, "tp": 1, "dp": 1, "vpp": 2, "ep": 1}
    assert result["production_settings"] is True
    assert result["max_grad_rel_diff"] <= 1e-5
    assert abs(result["loss_dense"] - result["loss_reuse"]) <= 1e-5 * abs(result["loss_dense"])
    assert result["stock_dense_seconds"] is None and result["reuse_seconds"] > 0
    assert "pp 2 (x 2 virtual) x tp 1 x dp 1 = 2 process(es), Megatron-LM production" in stdout


def test_demo_trains_both_runs_and_checks_agreement(runs):
    rc, stdout = runs[0]["demo"]
    assert rc == 0, stdout[-3000:]
    assert "agreement OK" in stdout
    assert "max relative weight difference" in stdout
    # --quick times one step per run: the figure must say it is noise (tests/test_noise.py)
    lines = stdout.splitlines()
    speedup = next(i for i, line in enumerate(lines) if line.startswith("speedup of reuse over"))
    assert lines[speedup + 1].strip().startswith("NOISE: ") and "fewer than 3" in lines[speedup + 1]


@pytest.fixture
def memory_probe(monkeypatch):
    path = ROOT / "tools" / "memory_probe.py"
    spec = importlib.util.spec_from_file_location("memory_probe", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "memory_probe", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_memory_probe_reports_the_suffix_phase_of_a_reuse_step(memory_probe):
    """The probe's reuse report: a suffix window, per-kind peaks and the cache (the counting
    itself: tests/test_memory_accounting.py)."""
    from prefix_schedule.pipeline import Action, ActionKind

    class Step:  # what watch_step reads of a ReuseStep
        num_microbatches = 1
        caches = ()
        observers: list = []

        @staticmethod
        def resident_tensors():
            return ()

    step = Step()

    def run(s):
        held = torch.zeros(32, requires_grad=True).square().sum()  # 128 bytes, prefix forward
        for on_action, _ in s.observers:
            on_action(Action(stage=0, kind=ActionKind.PREFIX_FORWARD, index=0))
        held.backward()
        for on_action, _ in s.observers:
            on_action(Action(stage=0, kind=ActionKind.SUFFIX_FORWARD, index=0))
        suffix = torch.zeros(4, requires_grad=True).square().sum()  # 16 bytes
        suffix.backward()
        for _, on_release in s.observers:
            on_release(0)
        for on_action, _ in s.observers:
            on_action(Action(stage=0, kind=ActionKind.PREFIX_BACKWARD, index=0))
        late = torch.zeros(64, requires_grad=True).square().sum()  # 256 bytes in Phase C
        for on_action, _ in s.observers:
            on_action(None)
        late.backward()

    report = memory_probe.measure_reuse(torch.nn.Linear(1, 1), step, run)
    assert report.suffix_phase_peak_bytes == 16 and report.peak_saved_bytes == 256
    assert report.phase_peaks == {"PF": 128, "SF": 16, "suffix": 16, "PB": 256}
    assert report.cache_peak_bytes == 0 and report.peak_host_bytes == 0


REFUSALS = [
    (["--group-size", "0"], "--group-size=0"),
    (["--pp", "3"], "--num-layers=4 does not split over --pp=3"),
    (["--tp", "3"], "--num-attention-heads=8 is not a multiple of --tp=3"),
    (["--dp", "32"], "fewer than dp_size=32"),
    (["--vpp", "2"], "--vpp=2 interleaves pipeline ranks; give --pp >= 2"),
    (["--pp", "2", "--vpp", "2", "--group-size", "3", "--num-groups", "1"],
     "needs a multiple of --pp=2 rows per data-parallel rank"),
    (["--pp", "2", "--vpp", "3"], "give a multiple of 6"),
    (["--attention-backend", "transformer_engine"], "attention backend 'transformer_engine'"),
    (["--tree", "3x0"], "give DEPTHxBRANCHING"),
    (["--node-len", "8"], "--node-len needs --tree"),
    (["--ep", "2"], "--ep=2 needs MoE layers"),
    (["--num-experts", "4", "--ep", "2"], "must divide --dp=1"),
    (["--num-experts", "2", "--moe-router-topk", "3"], "topk <= experts"),
]


def test_bench_moe_ep2_reports_equal_aux_losses(runs):
    """MoE in every layer, EP=2 over the two DP ranks: the aux loss Megatron logs is the same
    for dense (the plan's packing) and reuse, and so are the gradients."""
    results, out = runs
    code, stdout = results["bench_moe_ep2"]
    assert code == 0, stdout[-3000:]
    result = json.loads((out / "bench_moe_ep2.json").read_text())
    assert result["layout"] == {"pp": 1, "tp": 1, "dp": 2, "vpp": 1, "ep": 2}
    assert (result["model"]["num_experts"], result["model"]["moe_router_topk"]) == (4, 2)
    assert result["aux_loss_dense"] > 0
    assert math.isclose(result["aux_loss_dense"], result["aux_loss_reuse"], rel_tol=1e-5)
    assert result["max_grad_rel_diff"] <= 1e-5
    assert "aux loss dense" in stdout


def assert_bench_refuses(cases, capsys, monkeypatch):
    """Each (flags, message): tools/bench.py's main returns 2 with the message on stderr before
    any compute (running the bench fails the test). In-process: the cases cost no interpreter
    start; the first also runs as the command line, for its exit status."""
    bench = tool("bench")

    def computed(*_args, **_kwargs):
        raise AssertionError("the bench started computing instead of refusing")

    monkeypatch.setattr(bench, "run_bench", computed)
    import benchlib.adapter_bench
    monkeypatch.setattr(benchlib.adapter_bench, "run_adapter_bench", computed)
    default = attention_backends.get_default_backend()  # main sets the process default
    try:
        for flags, message in cases:
            assert bench.main(list(flags)) == 2, flags
            stderr = capsys.readouterr().err
            assert message in stderr, (flags, stderr[-2000:])
    finally:
        attention_backends.set_default_backend(default)
    flags, message = cases[0]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), *flags], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, (flags, proc.stderr[-2000:])


def test_bench_refuses_bad_flags_before_compute(capsys, monkeypatch):
    """Exit status 2 and the reason on stderr, from the parent, before any rank starts."""
    assert_bench_refuses(REFUSALS, capsys, monkeypatch)


def launched_rank(mode: str) -> int:
    """A rank function for the launcher test (module-level: ranks import it by name)."""
    rank = torch.distributed.get_rank()
    if mode == "raise" and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    if mode == "hang" and rank == 1:
        time.sleep(300)
    torch.distributed.barrier()
    return rank


def test_launch_surfaces_a_rank_traceback_and_kills_a_hang():
    assert launch(launched_rank, world_size=2, args=("ok",), timeout_s=120) == [0, 1]
    with pytest.raises(LaunchError, match="rank 1 fails on purpose") as failed:
        launch(launched_rank, world_size=2, args=("raise",), timeout_s=120)
    assert "rank 1 failed first" in str(failed.value)
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out after 10 s") as hung:
        launch(launched_rank, world_size=2, args=("hang",), timeout_s=10)
    assert time.monotonic() - start < 60
    assert "in launched_rank" in str(hung.value)  # the hung rank's stack, from faulthandler
