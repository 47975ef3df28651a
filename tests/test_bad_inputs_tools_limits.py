"""Issue 37's tool cases: sizes past what a tool can plan, outputs that cannot be written
(checked by a write before the work, for root too), CSV cells naming file/row/column, CP layouts
the engine refuses. In-process through the tools' main(); nothing here starts a process."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tools_import import tool


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def read_only(tmp_path):
    yield from read_only_dir(tmp_path)


def read_only_dir(tmp_path):
    """A directory nobody can create files in, root included (tests run as root): chattr +i,
    checked by a write; else sysfs (creating a file there is refused to root)."""
    path = tmp_path / "ro"
    path.mkdir()
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)],
                                                 capture_output=True).returncode == 0:
        try:
            (path / "probe").write_text("x")
        except OSError:
            yield path
            subprocess.run(["chattr", "-i", str(path)], check=True)
            return
        subprocess.run(["chattr", "-i", str(path)], check=True)
    yield __import__("pathlib").Path("/sys/kernel")


PLAN = ["--groups", "2", "--suffix-microbatches", "2"]
CASES = [  # (tool, argv, words in the usage error)
    ("plan", ["--pp", "1000000", *PLAN], ["--pp 1000000", "1,024"]),
    ("plan", ["--pp", "2", "--groups", "1000000", "--suffix-microbatches", "2"],
     ["6,000,000 plan cells", "up to 50,000"]),
    ("plan", ["--pp", "2", "--groups", "1", "--suffix-microbatches", "10000000"],
     ["plan cells", "up to 50,000"]),
    ("plan", ["--pp", "2", *PLAN, "--chrome-trace", "{tmp}"], ["--chrome-trace", "is a directory"]),
    ("plan", ["--pp", "2", *PLAN, "--chrome-trace", "{ro}/t.json"],
     ["--chrome-trace", "cannot write in"]),
    ("plan", ["--pp", "2", *PLAN, "--save", "{file}/p.csv"], ["--save", "is not a directory"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--gpu", "h100", "--prefix-len", "1", "--suffix-len",
                 "1", "--group-size", "10000000"], ["--group-size", "limit of 1,024"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--gpu", "h100", "--prefix-len", "1000000000",
                 "--suffix-len", "1", "--group-size", "2"], ["--prefix-len", "limit of 1,048,576"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--gpu", "h100", "--prefix-len", "1048576",
                 "--suffix-len", "1048576", "--group-size", "1024", "--groups", "4096"],
     ["tokens in the step", "up to 67,108,864"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--groups", "0"], ["--groups", ">= 1"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--token-budget", "0"], ["--token-budget", ">= 1"]),
    ("predict", ["--model", "tiny", "--gpus", "1", "--png-dir", "{tmp}"],
     ["--png-dir", "--validate and --paper"]),
    ("predict", ["--paper", "--json", "{ro}/p.json"], ["--json", "cannot write in"]),
    ("predict", ["--paper", "--png-dir", "{file}/png"], ["--png-dir", "is a file"]),
    ("predict", ["--model", "nemotron-h-8b", "--gpus", "2", "--gpu", "h100", "--cp", "2",
                 "--prefix-len", "64", "--suffix-len", "16", "--group-size", "2"],
     ["--cp 2", "recurrent layers", "--cp 1"]),
    ("predict", ["--model", "qwen3.5-27b", "--gpus", "4", "--gpu", "h100", "--cp", "4",
                 "--prefix-len", "64", "--suffix-len", "16", "--group-size", "2"],
     ["--cp 4", "recurrent layers"]),
    ("predict", ["--model", "qwen3-8b", "--gpus", "2", "--gpu", "h100", "--cp", "2",
                 "--trainer", "adapter", "--prefix-len", "64", "--suffix-len", "16",
                 "--group-size", "2"], ["--cp 2", "adapter", "context_parallel_size=1"]),
]


@pytest.mark.parametrize("name, argv, words", CASES, ids=[" ".join(c[1][-4:]) for c in CASES])
def test_refused_before_the_work(name, argv, words, tmp_path, read_only, capsys):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{ro}", str(read_only))
            .replace("{file}", str(tmp_path / "file")) for a in argv]
    err = _usage_error(tool(name).main, argv, capsys)
    assert all(w in err for w in words), err


def test_the_read_only_fixture_denies_root(read_only):
    with pytest.raises(OSError):
        (read_only / "x.json").write_text("{}")


def test_sweep_output_checked_before_the_first_point(tmp_path, read_only, capsys):
    sweep = tool("sweep")
    for argv, words in ((["--csv", str(tmp_path)], ["--csv", "is a directory"]),
                        (["--csv", str(read_only / "s.csv")], ["--csv", "cannot write in"]),
                        (["--png-dir", str(read_only / "png")], ["--png-dir", "cannot write"])):
        assert sweep.main(["--points", "8:8:2", "--reps", "1", *argv]) == 1
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
        assert "speedup" not in err


def test_predict_search_picks_no_cp_the_engine_refuses():
    """Hybrids (recurrent layers) and the adapter: every candidate has CP=1; attention models
    under the Megatron-LM entry point keep CP 2 and 4."""
    predict = tool("predict")
    from megatron_patches.models.model_configs import MODELS

    assert predict.allowed_cps(MODELS["nemotron-h-8b"], "megatron-lm")[0] == (1,)
    assert predict.allowed_cps(MODELS["qwen3.5-27b"], "megatron-lm")[0] == (1,)
    assert predict.allowed_cps(MODELS["qwen3-8b"], "adapter")[0] == (1,)
    assert predict.allowed_cps(MODELS["qwen3-8b"], "megatron-lm")[0] == (1, 2, 4)
    from predictlib.report import candidate_layouts
    import capacity
    dims = capacity.dims_of(MODELS["nemotron-h-8b"])
    assert {lay.cp for lay in candidate_layouts(dims, 8, (1,))} == {1}


SWEEP_HEADER = "prefix,suffix,group_size,num_groups,policy_on,model,cpu_speedup,microbatches\n"
GOOD = "64,16,2,1,True,2x64x172x4x2x256,{speedup},1\n"
CSV_CASES = [  # (rows, words)
    (GOOD.format(speedup="nan"), ["row 2", "'cpu_speedup'", "'nan'", "finite number > 0"]),
    (GOOD.format(speedup="0"), ["row 2", "'cpu_speedup'", "'0'"]),
    (GOOD.format(speedup="1.2") + GOOD.replace("True", "yes").format(speedup="1.1"),
     ["row 3", "'policy_on'", "'yes'", "True or False"]),
    (GOOD.replace("64,16", "64,abc").format(speedup="1.2"), ["row 2", "'suffix'", "'abc'"]),
    (GOOD.replace("2x64x172x4x2x256", "tiny").format(speedup="1.2"), ["row 2", "'model'"]),
]


@pytest.mark.parametrize("rows, words", CSV_CASES, ids=[c[1][1] for c in CSV_CASES])
def test_validate_names_file_row_and_column(rows, words, tmp_path, capsys):
    path = tmp_path / "s.csv"
    path.write_text(SWEEP_HEADER + rows)
    device = tmp_path / "dev.json"
    shutil.copy(tool("predict").DEFAULT_CPU_DEVICE, device)
    err = _usage_error(tool("predict").main, ["--validate", str(path), "--device-file",
                                              str(device), "--bench-points", "none"], capsys)
    assert str(path) in err and all(w in err for w in words), err


ID_CASES = [  # (step ids, group ids of four lines) -> (steps, groups in step 0)
    ((0, "0", 1, "1"), (7, 7, 7, 7), (2, 1)),
    (("0", 0, 0, "0"), (7, "7", 8, "8"), (1, 2)),
    ((5, 5, "6", 6), ("a", "a", "a", "a"), (2, 1)),
]


@pytest.mark.parametrize("steps, groups, expected", ID_CASES)
def test_import_generic_compares_ids_as_text(steps, groups, expected, tmp_path):
    """step 0 and step "0" on adjacent lines are one step (they were two)."""
    import json

    from prefix_schedule.traces import read_steps
    from prefix_schedule.traces.generic import import_generic

    src = tmp_path / "g.jsonl"
    src.write_text("".join(json.dumps({"step": s, "group": g, "prompt": [1, 2], "response": [3],
                                       "advantage": 1.0}) + "\n" for s, g in zip(steps, groups)))
    assert import_generic(src, tmp_path / "t.jsonl") == expected[0]
    first = next(iter(read_steps(tmp_path / "t.jsonl")))
    assert len(first.groups) == expected[1]


def _trace(tmp_path, prompt_len=2):
    import json
    header = {"format": "prefix-reuse-trace", "version": 1, "vocab_size": None, "source": "",
              "metadata": {}}
    group = {"step": 0, "prompt": [1] * prompt_len, "responses": [[3, 4]], "advantages": [1.0]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(group) + "\n")
    return path


REPLAY_FLAGS = [
    (["--num-layers", "0"], ["--num-layers", ">= 1"]),
    (["--hidden-size", "-8"], ["--hidden-size", ">= 1"]),
    (["--token-budget", "0"], ["--token-budget", ">= 1"]),
    (["--clip-grad", "-1"], ["--clip-grad", ">= 0"]),
    (["--lr", "nan"], ["--lr", "finite"]),
]


@pytest.mark.parametrize("argv, words", REPLAY_FLAGS, ids=[c[0][0] for c in REPLAY_FLAGS])
def test_replay_flags_are_usage_errors(argv, words, tmp_path, capsys):
    err = _usage_error(tool("replay").main, ["--trace", str(_trace(tmp_path)), "--steps", "1",
                                             *argv], capsys)
    assert all(w in err for w in words), err


def test_replay_refuses_before_the_work(tmp_path, read_only, capsys):
    replay = tool("replay")
    trace = _trace(tmp_path)
    cases = [
        (["--checkpoint-dir", str(read_only / "ck")], ["--checkpoint-dir", "cannot write"]),
        (["--checkpoint-dir", str(trace / "ck")], ["--checkpoint-dir", "is a file"]),
        (["--json", str(read_only / "r.json")], ["--json", "cannot write"]),
    ]
    for argv, words in cases:
        assert replay.main(["--trace", str(trace), "--steps", "1", *argv]) == 1
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
    long = _trace(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, 10**6)
    assert replay.main(["--trace", str(long), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "1,000,002 tokens" in err and "up to 65,536" in err, err


@pytest.mark.parametrize("text", ["not json", "[]", "{}", '{"steps": 2}'])
def test_replay_replot_of_a_bad_json_is_a_message(text, tmp_path, capsys):
    src = tmp_path / "r.json"
    src.write_text(text)
    assert tool("replay").main(["--replot", str(src), str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "not a replay --json result" in err and "Traceback" not in err, err


def test_layouts_no_longer_says_prefix_reuse_refuses_moe(capsys):
    assert tool("layouts").main(["qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "refuses MoE" not in out and "prefix reuse trains MoE" in out, out
