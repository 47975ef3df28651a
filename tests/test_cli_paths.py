"""Issue 36's command-line rough edges: a moved CLI still runs, --help lists what is accepted
and shows defaults, the Megatron-LM entry point's console says what happens (in process: no
Megatron-LM run here)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from tools_import import tool

REPO = Path(__file__).resolve().parents[1]


def _run_module(name, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_old_model_configs_path_runs_the_moved_cli(monkeypatch, capsys):
    """`python -m megatron_patches.model_configs megatron-args NAME` printed nothing, exit 0."""
    new = _run_module("megatron_patches.models.model_configs", ["megatron-args", "llama3-8b-tiny"],
                      monkeypatch, capsys)
    old = _run_module("megatron_patches.model_configs", ["megatron-args", "llama3-8b-tiny"],
                      monkeypatch, capsys)
    assert new[0] in (0, None) and "--num-layers" in new[1]
    assert old[:2] == new[:2] and "moved to megatron_patches.models.model_configs" in old[2]


def test_predict_help_and_predict_md_list_every_model(capsys):
    capacity, predict = tool("capacity"), tool("predict")
    with pytest.raises(SystemExit):
        predict.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    doc = (REPO / "docs" / "PREDICT.md").read_text(encoding="utf-8")
    for name in capacity.CHOICES:
        assert name in help_text, name
        assert f"`{name}`" in doc, name


def test_bench_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        tool("bench").main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Timed steps per path (the median is reported). (default: 3)" in text
    assert "Tensor-parallel ranks. (default: 1)" in text


def test_one_logger_warning_is_left_out(monkeypatch):
    from megatron_patches.megatron_lm import quiet
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "one_logger" else object())
    assert quiet.without_one_logger(["--tp", "2"]) == ["--tp", "2", "--no-one-logger"]
    asked = ["--one-logger-project", "x"]
    assert quiet.without_one_logger(asked) == asked


def test_missing_checkpoint_line_names_the_hf_checkpoint(monkeypatch):
    from megatron_patches.megatron_lm import compat
    compat.enable_python311_support()  # as the entry point does before importing megatron.training
    from megatron.training import checkpointing

    from megatron_patches.megatron_lm import quiet
    printed = []
    monkeypatch.setattr(checkpointing, "print_rank_0", printed.append)
    quiet.checkpoint_lines("hf-qwen35-tiny")
    checkpointing.print_rank_0("    will not load any checkpoints and will start from random")
    checkpointing.print_rank_0("other")
    assert printed == ["    no checkpoint to resume from: the weights are loaded from the Hugging "
                       "Face checkpoint hf-qwen35-tiny", "other"]


def test_refusal_under_torchrun_says_the_error_is_its_line(monkeypatch, capsys):
    """torchrun follows a refused run with ~90 lines of ChildFailedError (its own report, which a
    worker cannot suppress): the refusal says which line is the error."""
    from megatron_patches.megatron_lm import main as entry
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_PORT", raising=False)  # no store to join here
    assert entry._refuse(ValueError("--clip-grad 1.0: give 0")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "train_grpo.py: error: --clip-grad 1.0: give 0"
    assert "ChildFailedError" in err[1] and "the error is the line above" in err[1]
