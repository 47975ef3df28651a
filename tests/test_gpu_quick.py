"""`tools/gpu_check.py --quick` (tools/gpu_quick.py) and `make gpu-kit` (tools/gpu_kit.py): the
CPU dry run of the quick check writes every phase (a-d) proved, so the script cannot rot; a phase
that did not run exits 4 unless --allow-partial, a failed one 1; the kit builder checks its
wheels and size and writes the one command line (downloads stubbed here: no network in tests)."""
import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tools(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    return lambda name: importlib.import_module(name)


@pytest.mark.megatron
def test_quick_dry_run_proves_every_phase(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--quick",
                           "--dry-run", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "quick-dry-run" and not report["failed"] and not report["not_run"]
    phases = report["phases"]
    assert list(phases) == ["a_attention", "b_slice_e2e", "c_gdn", "d_predict"]
    assert all(p["ok"] for p in phases.values())
    attention = phases["a_attention"]  # the torch CPU kernel stands in for torch_cuda
    assert attention["backend"] == "torch" and len(attention["torch_flash_schemas"]) == 2
    assert {(r["mode"], r["dtype"]) for r in attention["correctness"]} == {
        (m, d) for m in ("two_part", "copy") for d in ("float32", "bfloat16")}
    shares = phases["b_slice_e2e"]["shares"]
    assert list(shares) == ["8k/1k", "10k/2k", "2k/10k"]
    for share in shares.values():
        assert share["ok"] and share["speedup_dense_over_reuse"] > 0
        assert [p["phase"] for p in share["phases"]] == ["reference_fp32_dense", "dense_bf16", "reuse_bf16"]
        errors = share["grad_rel_err_vs_fp32"]
        assert 0 < errors["reuse_bf16"] <= 1.5 * errors["dense_bf16"]
    assert phases["c_gdn"]["kernel"]["ok"] and phases["c_gdn"]["speedup_dense_over_reuse"] > 0
    assert phases["d_predict"]["device"]["gemm_peak"] > 0


def _args(tmp_path, allow_partial=False):
    return argparse.Namespace(budget_s=1e9, json=tmp_path / "q.json", allow_partial=allow_partial)


@pytest.mark.parametrize("phases, allow_partial, status", [
    ({"a": {"ok": True}, "b": {"skipped": "fla is not installed"}}, False, 4),
    ({"a": {"ok": True}, "b": {"skipped": "fla is not installed"}}, True, 0),
    ({"a": {"ok": False}, "b": {"skipped": "x"}}, True, 1),
    ({"a": {"ok": True}, "b": {"ok": True}}, False, 0),
])
def test_exit_status_lists_phases_that_did_not_run(tools, monkeypatch, tmp_path, capsys, phases,
                                                   allow_partial, status):
    import torch

    quick = tools("gpu_quick")
    monkeypatch.setattr(quick, "PHASES", tuple(
        (name, lambda d, dry, deadline, full, r=result: dict(r)) for name, result in phases.items()))
    assert quick.run(_args(tmp_path, allow_partial), torch.device("cpu"), dry_run=True) == status
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["not_run"] == [n for n, p in phases.items() if "skipped" in p]
    assert report["failed"] == [n for n, p in phases.items() if p.get("ok") is False]
    if status == 4:
        assert "pass --allow-partial" in capsys.readouterr().out


def test_a_crashing_phase_is_a_failure_and_the_rest_still_run(tools, monkeypatch, tmp_path):
    import torch

    quick = tools("gpu_quick")

    def boom(d, dry, deadline, full):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(quick, "PHASES", (("a", boom), ("b", lambda d, dry, deadline, full: {"ok": True})))
    assert quick.run(_args(tmp_path), torch.device("cpu"), dry_run=True) == 1
    report = json.loads((tmp_path / "q.json").read_text())
    assert "kernel exploded" in report["phases"]["a"]["error"] and report["phases"]["b"]["ok"]


def _stub_download(sizes, extra=""):
    """Writes a small zip named like the wheel (one package dir + .dist-info, plus `extra`)."""
    import zipfile

    def download(requirement, dest):
        name, version = requirement.split("==")
        name = name.replace("-", "_")
        with zipfile.ZipFile(dest / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{name}/__init__.py", "0" * sizes.get(name, 10))
            wheel.writestr(f"{name}-{version}.dist-info/METADATA", "")
            if extra:
                wheel.writestr(f"{name}-{version}.data/{extra}", "")
    return download


def test_kit_writes_wheels_and_the_one_command(tools, tmp_path):
    kit = tools("gpu_kit")
    result = kit.build(tmp_path / ".gpu-kit", download=_stub_download({}))
    assert sorted(result["wheels"]) == ["fla_core-0.5.2-py3-none-any.whl",
                                        "megatron_core-0.19.2-py3-none-any.whl"]
    command = (tmp_path / ".gpu-kit" / "COMMAND.txt").read_text().strip()
    assert command == kit.COMMAND and "extractall('/tmp/prefix-reuse-kit')" in command
    assert "python3 -m megatron_patches apply" in command and "--quick" in command


def test_kit_unpacks_like_an_install_and_refuses_data_trees(tools, tmp_path):
    import zipfile

    kit = tools("gpu_kit")
    result = kit.build(tmp_path / ".gpu-kit", download=_stub_download({}))
    site = tmp_path / "site"
    for name in result["wheels"]:
        zipfile.ZipFile(tmp_path / ".gpu-kit" / "wheels" / name).extractall(site)
    assert (site / "megatron_core" / "__init__.py").exists() and (site / "fla_core").is_dir()
    with pytest.raises(ValueError, match=".data tree"):
        kit.build(tmp_path / "data", download=_stub_download({}, extra="scripts/x"))


def test_kit_refuses_over_64_mib_and_missing_wheels(tools, tmp_path):
    kit = tools("gpu_kit")
    with pytest.raises(ValueError, match="over the 64 MiB"):
        kit.build(tmp_path / "big", download=_stub_download({"fla_core": 65 * 2**20}))
    assert not (tmp_path / "big" / "COMMAND.txt").exists()
    with pytest.raises(ValueError, match="missing wheels for \\['fla_core'\\]"):
        kit.build(tmp_path / "few", download=lambda requirement, dest: None if "fla" in requirement
                  else _stub_download({})(requirement, dest))


def test_docs_give_the_kit_command_verbatim(tools):
    assert tools("gpu_kit").COMMAND in (ROOT / "docs" / "GPU.md").read_text()
