"""The Megatron-LM RL CPU command of docs/FRAMEWORKS.md and docs/MEGATRON_LM.md, run as written
(issue 36: the documented command was a template that failed four ways on CPU).

The ```sh block after `<!-- train-rl-cpu-command -->` is the same text in both docs; it runs
verbatim in `bash -e` from the repository root, its `RUN=` line pointed at a temporary directory
(the only substitution), with this Python's bin directory first on PATH (the venv a user
activates: `python`, `torchrun`). It must exit 0, run in CPU mode naming its stand-ins, log
every training iteration and a prefix-reuse report per step, and save the checkpoint. The GPU
block beside it names the same launcher with `--prefix-reuse --calculate-per-token-loss` and no
trace (it is not run: no GPU).
"""
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from megatron_lm_runs import REPO
from reaped import run_reaped

pytestmark = [pytest.mark.megatron]
DOCS = [REPO / "docs" / "FRAMEWORKS.md", REPO / "docs" / "MEGATRON_LM.md"]
RUN_LINE = re.compile(r"^RUN=(\S+)$", re.M)
ITERS = 3


def _block(doc: Path, name: str) -> str:
    text = doc.read_text(encoding="utf-8")
    match = re.search(rf"<!-- {name} -->\n```sh\n(.*?)^```", text, re.S | re.M)
    assert match, f"{doc.name}: no ```sh block after <!-- {name} -->"
    return match.group(1)


def test_the_docs_show_one_cpu_command_and_the_gpu_command_beside_it():
    cpu = {doc.name: _block(doc, "train-rl-cpu-command") for doc in DOCS}
    assert len(set(cpu.values())) == 1, "the CPU command differs between the docs"
    gpu = {doc.name: _block(doc, "train-rl-gpu-command") for doc in DOCS}
    assert len(set(gpu.values())) == 1, "the GPU command differs between the docs"
    command, gpu_command = cpu["FRAMEWORKS.md"], gpu["FRAMEWORKS.md"]
    assert len(RUN_LINE.findall(command)) == 1
    for flag in ("examples/megatron_lm/train_rl_prefix_reuse.py", "--prefix-reuse",
                 "--calculate-per-token-loss", "--train-rl"):
        assert flag in command and flag in gpu_command, flag
    assert "--replay-trace" in command and "--replay-trace" not in gpu_command


def _available():
    import importlib.util

    import megatron_trees
    from megatron_patches.patching.trees import find_offline_tarball

    missing = [m for m in ("httpx", "fastapi", "uvicorn", "openai", "yaml", "pybind11")
               if importlib.util.find_spec(m) is None]
    if missing:
        megatron_trees.missing(f"the documented train_rl command needs {', '.join(missing)}: "
                               "make .venv-frameworks/.setup-stamp (make test-frameworks)")
    if find_offline_tarball("0.20.0") is None or shutil.which("make") is None:
        megatron_trees.missing(f"{megatron_trees.SKIP_PREFIX} 0.20.0: the documented command "
                               "prepares it from the offline tarball (set MEGATRON_LM_TARBALLS)")


def test_the_documented_cpu_command_trains_as_written(tmp_path):
    _available()
    command = _block(DOCS[0], "train-rl-cpu-command")
    run_dir = tmp_path / "run"
    script = RUN_LINE.sub(f"RUN={run_dir}", command)
    assert script.replace(str(run_dir), "X") == RUN_LINE.sub("RUN=X", command)  # only RUN
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    run = run_reaped(["bash", "-e", "-c", script], env=env, cwd=REPO, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "> CPU mode (no CUDA)" in out and "NullTokenizer.bos_id" in out, out[-3000:]
    assert "inference interface -> an engine-less one" in out
    for name in ("apply_rope_fusion", "transformer_impl", "distributed_backend"):
        assert f"> CPU mode: {name} " in out, (name, out[-3000:])  # turned off, announced
    logged = [int(i) for i in re.findall(r" iteration\s+(\d+)/\s*%d \|" % ITERS, out)]
    assert logged == list(range(1, ITERS + 1)), out[-4000:]
    assert out.count("> prefix reuse step:") == ITERS, out[-4000:]
    assert re.search(r"lm loss: \S+", out), out[-3000:]
    assert (run_dir / "ckpt" / f"iter_{ITERS:07d}").is_dir()


def test_the_commands_tools_refuse_bad_input_naming_the_fix(tmp_path, monkeypatch, capsys):
    """tools/megatron_tree.py and tools/train_rl_trace.py (the CPU command's first two lines):
    one line naming what to fix, a non-zero exit, nothing written."""
    import json

    from tools_import import tool

    trees, traces = tool("megatron_tree"), tool("train_rl_trace")
    monkeypatch.setenv("MEGATRON_LM_TARBALLS", str(tmp_path / "none"))
    assert trees.main(["--release", "main", "--out", str(tmp_path / "run"),
                       "--tarball", str(tmp_path / "missing.tar.gz")]) == 2
    err = capsys.readouterr().err
    assert "no tarball Megatron-LM-main-2026-08-22.tar.gz" in err and "git clone" in err, err
    assert not (tmp_path / "run").exists()
    (tmp_path / "run" / "Megatron-LM").mkdir(parents=True)
    tarball = tmp_path / "t.tar.gz"
    tarball.write_bytes(b"")
    assert trees.main(["--release", "main", "--out", str(tmp_path / "run"),
                       "--tarball", str(tarball)]) == 2
    assert "exists: give another --out" in capsys.readouterr().err
    for text, message in (("not json", "not a readable JSON trace"),
                          (json.dumps([[{"prompt": [1], "members": []}]]), "no groups"),
                          (json.dumps({"prompt": []}), "no groups")):
        (tmp_path / "bad.json").write_text(text)
        assert traces.main(["check", str(tmp_path / "bad.json")]) == 1
        assert message in capsys.readouterr().err, text
    assert traces.main(["synth", "--out", str(tmp_path / "t.json"), "--collections", "1",
                        "--groups", "2", "--group-size", "3", "--vocab-size", "256",
                        "--eod", "256"]) == 1
    assert "--eod < --vocab-size" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
    assert traces.main(["synth", "--out", str(tmp_path / "t.json"), "--collections", "2",
                        "--groups", "2", "--group-size", "3", "--vocab-size", "256",
                        "--eod", "255"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert [len(c) for c in data] == [2, 2] and all(len(g["members"]) == 3 for g in data[0])
    member = data[0][0]["members"][0]
    assert member["response"][-1] == 255 and len(member["logprobs"]) == len(member["response"])
    assert traces.main(["check", str(tmp_path / "t.json")]) == 0
    assert "4 groups" in capsys.readouterr().out
