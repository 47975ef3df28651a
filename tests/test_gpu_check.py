"""tools/gpu_check.py: the `--dry-run` runs the whole script on CPU (CPU backends for the GPU ones,
Megatron's local spec for the TE spec) and must write the GPU run's JSON schema with every claim
proved, so the script cannot rot; and a wrong backend is reported, not hidden."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fake_attention_libs as fakes
from prefix_schedule.attention.backends import _reset, get_backend

ROOT = Path(__file__).resolve().parents[1]
CPU, F64 = torch.device("cpu"), torch.float64
TOP = {"schema", "mode", "device", "capability", "libraries", "sizes", "availability", "correctness",
       "cp_correctness", "te_cp_filter", "timing", "e2e", "moe_e2e", "predict_device", "gdn_e2e",
       "mamba_e2e", "env", "claims", "failures", "elapsed_s", "not_run"}
E2E = {"claim", "ok", "settings", "model", "workload", "grad_rel_err_vs_fp32",
       "grad_rel_diff_reuse_vs_dense", "losses", "phases"}
PHASES = ["reference_fp32_dense", "dense_bf16", "reuse_bf16", "reuse_bf16_offload_prefix_activations"]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look it up
    spec.loader.exec_module(module)
    _reset()
    yield module
    _reset()


@pytest.mark.megatron
def test_dry_run_writes_the_gpu_schema_with_every_claim_proved(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run",
                           "--repeats", "2", "--warmup", "1", "--json", str(out),
                           "--allow-partial"],  # TE's CP filter check cannot run on CPU
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 requested phase(s) did not run" in proc.stdout and "--allow-partial" in proc.stdout
    report = json.loads(out.read_text())
    assert set(report) == TOP and report["mode"] == "dry-run" and report["failures"] == 0
    rows = report["correctness"]
    assert {(r["backend"], r["mode"], r["dtype"]) for r in rows} == {
        (b, m, d) for b in ("torch", "math") for m in ("two_part", "copy") for d in ("float32", "bfloat16")}
    assert all(r["ok"] and all(r[g] <= r["tol"] for g in ("out", "dq", "dk", "dv", "dprefix_k",
                                                         "dprefix_v")) for r in rows)
    assert {(t["backend"], t["mode"]) for t in report["timing"]} == {
        (b, m) for b in ("torch", "math") for m in ("two_part", "copy")}
    assert all(t["ms"] > 0 and t["peak_extra_mib"] is None for t in report["timing"])  # CPU: no allocator
    predict = report["predict_device"]  # tools/predict_bench.py, quick grid on CPU
    assert predict["ok"] and predict["device"]["gemm_peak"] > 0 and predict["device"]["dtype_bytes"] == 4
    moe = report["moe_e2e"]  # grouped experts on a GPU; SequentialMLP stands in here
    assert moe["ok"] and moe["settings"]["expert_mlp"] == ["SequentialMLP"], moe
    assert moe["grad_rel_err_vs_fp32"]["reuse_bf16"] <= 1.5 * moe["grad_rel_err_vs_fp32"]["dense_bf16"]
    assert moe["aux_loss"]["dense_bf16"] > 0
    gdn = report["gdn_e2e"]  # fla on a GPU; the CPU layer's stand-ins here
    assert gdn["ok"] and gdn["kernel"]["ok"], gdn
    assert gdn["grad_rel_err_vs_fp32"]["reuse_bf16"] <= 1.5 * gdn["grad_rel_err_vs_fp32"]["dense_bf16"]
    mamba = report["mamba_e2e"]  # mamba-ssm / causal-conv1d on a GPU; the CPU stand-ins here
    assert mamba["ok"] and mamba["kernel"]["ok"], mamba
    assert max(mamba["kernel"]["errors"]["chained_vs_whole"].values()) <= 1e-5
    assert mamba["grad_rel_err_vs_fp32"]["reuse_bf16"] <= 1.5 * mamba["grad_rel_err_vs_fp32"]["dense_bf16"]
    e2e = report["e2e"]
    assert set(e2e) == E2E and e2e["ok"] and [p["phase"] for p in e2e["phases"]] == PHASES
    model_peaks = {p["phase"]: p.get("model_peak_mib") for p in e2e["phases"]}
    assert model_peaks["reference_fp32_dense"] is None and all(
        model_peaks[name] > 0 for name in PHASES[1:]), model_peaks  # beside the allocator's
    errors = e2e["grad_rel_err_vs_fp32"]
    assert 0 < errors["dense_bf16"] < 0.2 and errors["reuse_bf16"] <= 1.5 * errors["dense_bf16"]
    cp_rows = report["cp_correctness"]
    assert {(r["backend"], r["cp"], r["layout"], r["owners"]) for r in cp_rows} == {
        (b, 2, lay, o) for b in ("torch", "math") for lay in ("3groups", "empty_slot")
        for o in ("zigzag", "whole", "mixed")}
    assert all(r["ok"] and r["dprefix_k"] <= r["tol"] for r in cp_rows)
    statuses = [c["status"] for c in report["claims"]]
    assert statuses == ["proved"] * 3 + ["not run: no CUDA device (dry run)"] + ["proved"] * 6  # e2e, MoE, predictor, GDN, Mamba
    assert report["not_run"] == [report["claims"][3]["claim"]]
    assert "[proved]" in proc.stdout and "0 failure(s)" in proc.stdout


def test_a_phase_that_did_not_run_fails_the_run_unless_allow_partial(tmp_path):
    """Dry run, attention only, time budget 0: timings and TE's CP filter check (and what else
    the budget cuts) do not run, so the run exits 4 (not 0); --skip-e2e phases were not
    requested and do not count."""
    out = tmp_path / "partial.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run",
                           "--skip-e2e", "--budget-s", "0", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    unrun = report["not_run"]
    assert report["failures"] == 0 and len(unrun) >= 2, unrun  # and what else the budget cut
    assert any("time" in claim for claim in unrun) and report["claims"][3]["claim"] in unrun
    assert f"{len(unrun)} requested phase(s) did not run" in proc.stderr
    assert "--allow-partial" in proc.stderr


def test_exit_status_counts_failures_then_unrun_phases(gpu_check):
    assert gpu_check.exit_status({"failures": 0, "not_run": []}, allow_partial=False) == 0
    assert gpu_check.exit_status({"failures": 0, "not_run": ["x"]}, allow_partial=False) == 4
    assert gpu_check.exit_status({"failures": 0, "not_run": ["x"]}, allow_partial=True) == 0
    assert gpu_check.exit_status({"failures": 2, "not_run": ["x"]}, allow_partial=True) == 1
    report = {"claims": [{"claim": "a", "status": "proved"},
                         {"claim": "b", "status": "not run: --skip-e2e"},
                         {"claim": "c", "status": "not run: time budget of 1 s used up"}]}
    assert gpu_check.not_run(report) == ["c"]


def test_without_cuda_and_without_dry_run_it_refuses(gpu_check, capsys):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert gpu_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_a_wrong_backend_is_reported(gpu_check, monkeypatch):
    fakes.install_flash_attn(monkeypatch)
    monkeypatch.setattr(get_backend("flash_attn"), "device_reason", lambda device, dtype, head_dim: "")
    sizes = gpu_check.Sizes(heads=(4, 2), head_dim=8, timing=(8, 2, 4), dtypes=("float64",),
                            backends=("flash_attn", "math"), layouts={"tiny": ([3, 1, 2], [0, 1, 1], [4, 0])})
    rows = gpu_check.check_correctness(CPU, sizes, ["flash_attn", "math"])
    assert all(r["ok"] for r in rows), rows
    math_backend = get_backend("math")
    original = math_backend.varlen_bwd
    monkeypatch.setattr(math_backend, "varlen_bwd", lambda *a: [2 * g for g in original(*a)])
    rows = gpu_check.check_correctness(CPU, sizes, ["math"])
    assert [r["ok"] for r in rows] == [False, True] and rows[0]["out"] < 1e-12 < rows[0]["dq"]


def _fake_te_filter(enable_bottom_right: bool):
    """AttentionParams / get_attention_backend with TE's CP rule (utils.py, "Filter: Context
    parallelism"): under CP, bottom-right masks and causal s_q != s_kv disable flash and fused;
    unfused never runs CP. `enable_bottom_right`: a hypothetical TE that lifts the first rule."""
    import dataclasses

    @dataclasses.dataclass
    class Params:
        attn_mask_type: str = "no_mask"
        max_seqlen_q: int = 1
        max_seqlen_kv: int = 1
        context_parallel: bool = False
        cp_comm_type: str = "p2p"
        qkv_layout: str = "sbh3d"

    def select(p):
        refused = p.context_parallel and (
            ("bottom_right" in p.attn_mask_type and not enable_bottom_right)
            or ("causal" in p.attn_mask_type and "bottom_right" not in p.attn_mask_type
                and p.max_seqlen_q != p.max_seqlen_kv))
        return (None, None, None, None, None, [False, not refused, False])

    return Params, select


@pytest.mark.parametrize("lifted", [False, True])
def test_te_cp_filter_check_reads_te_backend_filter(monkeypatch, lifted):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check_te_cp

    monkeypatch.setattr(gpu_check_te_cp, "_load", lambda: _fake_te_filter(lifted))
    result = gpu_check_te_cp.te_cp_filter(torch.device("cuda"))
    assert len(result["rows"]) == 3 * len(gpu_check_te_cp.CP_COMM_TYPES)
    assert result["ok"] is (not lifted)  # a TE that serves reuse rows fails the premise
    assert gpu_check_te_cp.te_cp_filter(CPU) == {"skipped": "no CUDA device (dry run)"}
