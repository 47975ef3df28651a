"""tools/plan.py: --vpp, and bad flags or files end with a clear message and a non-zero status,
never a traceback or a silently wrong plan."""

import pytest

from test_schedule import load_tool

BASE = ["--groups", "2", "--suffix-microbatches", "4"]


def exit_of(tool, argv, capsys) -> tuple[object, str]:
    """(exit status, stderr + message) of a refused command line."""
    with pytest.raises(SystemExit) as caught:
        tool.main(argv)
    captured = capsys.readouterr()
    return caught.value.code, captured.err + str(caught.value.code)


def test_vpp_plans_against_megatrons_interleaved_schedule(capsys):
    tool = load_tool()
    assert tool.main(["--pp", "4", "--vpp", "2"] + BASE) == 0
    out = capsys.readouterr().out
    assert out.count("model_chunks") == 0 and "rank3" in out and "grouped exchanges" in out
    assert "7SF7" in out  # virtual stage 7 = rank 3's second model chunk
    bubble = {line[:14].strip(): float(line.split()[-3]) for line in out.splitlines()
              if line.startswith(("prefix reuse", "dense interl."))}
    assert bubble["prefix reuse"] <= bubble["dense interl."]


def test_vpp_with_a_count_megatron_refuses_still_plans(capsys):
    tool = load_tool()
    assert tool.main(["--pp", "4", "--vpp", "2", "--groups", "2",
                      "--suffix-microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert "prefix reuse" in out and "no dense baseline" in out and "last group" in out


@pytest.mark.parametrize("argv, message", [
    (["--pp", "2", "--groups", "0", "--suffix-microbatches", "4"], "--groups"),
    (["--pp", "0"] + BASE, "--pp"),
    (["--pp", "2", "--rows", "-1"] + BASE, "--rows"),
    (["--pp", "2", "--vpp", "0"] + BASE, "--vpp"),
    (["--pp", "1", "--vpp", "2"] + BASE, "needs --pp >= 2"),
    (["--pp", "2", "--groups", "2", "--suffix-microbatches", "4,x"], "--suffix-microbatches"),
    (["--pp", "2", "--groups", "2", "--suffix-microbatches", "4,0"], "--suffix-microbatches"),
    (["--pp", "2", "--groups", "2", "--suffix-microbatches", "1,2,3"], "one count or 2"),
    (["--pp", "2", "--no-prefix", "5"] + BASE, "groups 0..1"),
    (["--pp", "2", "--no-prefix", "a"] + BASE, "--no-prefix"),
    (["--pp", "2", "--prefix-chunk-tokens", "8"] + BASE, "needs --prefix-tokens"),
    (["--pp", "2", "--prefix-tokens", "64", "--prefix-chunk-tokens", "0"] + BASE,
     "--prefix-chunk-tokens"),
    (["--pp", "2", "--microbatch-tokens", "0"] + BASE, "--microbatch-tokens"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    code, err = exit_of(load_tool(), argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.fixture
def saved(tmp_path, capsys):
    """A plan saved by the tool at PP=3."""
    tool = load_tool()
    path = tmp_path / "plan.csv"
    assert tool.main(["--pp", "3"] + BASE + ["--save", str(path)]) == 0
    capsys.readouterr()
    return tool, path


def test_load_refuses_another_layout(saved, capsys):
    tool, path = saved
    code, err = exit_of(tool, ["--pp", "4", "--load", str(path)] + BASE, capsys)
    assert code and "3 rank rows x 1 model chunk(s) but --pp 4 --vpp 1" in err
    code, err = exit_of(tool, ["--pp", "3", "--vpp", "2", "--load", str(path)] + BASE, capsys)
    assert code and "--vpp 2" in err


def test_load_refuses_malformed_cells_and_missing_files(saved, tmp_path, capsys):
    tool, path = saved
    bad = tmp_path / "bad.csv"
    bad.write_text(path.read_text().replace("SF1", "SQ1", 1))
    code, err = exit_of(tool, ["--pp", "3", "--load", str(bad)] + BASE, capsys)
    assert code and "not a schedule CSV: cannot parse action" in err and "SQ1" in err
    bad.write_text("model_chunks: x\n" + path.read_text())
    code, err = exit_of(tool, ["--pp", "3", "--load", str(bad)] + BASE, capsys)
    assert code and "model_chunks: V" in err
    code, err = exit_of(tool, ["--pp", "3", "--load", str(tmp_path / "nope.csv")] + BASE, capsys)
    assert code and "cannot read it" in err


def test_load_of_a_plan_for_another_step_is_invalid_not_silent(saved, tmp_path, capsys):
    tool, path = saved
    rows = path.read_text().splitlines()
    short = tmp_path / "short.csv"  # right layout, a row cut short
    short.write_text("\n".join(rows[:-1] + [rows[-1].rsplit(",", 1)[0]]) + "\n")
    assert tool.main(["--pp", "3", "--load", str(short)] + BASE) == 1
    assert "INVALID: rank 2 never runs" in capsys.readouterr().out
    assert tool.main(["--pp", "3", "--load", str(path), "--groups", "2",
                      "--suffix-microbatches", "5"]) == 1  # other shape than the saved plan
    assert "INVALID" in capsys.readouterr().out
    rows_only_two = tmp_path / "two.csv"
    rows_only_two.write_text("\n".join(rows[:2]) + "\n")
    code, err = exit_of(tool, ["--pp", "3", "--load", str(rows_only_two)] + BASE, capsys)
    assert code and "2 rank rows" in err


def test_the_script_runs_this_checkouts_code(tmp_path):
    """Run as a script from elsewhere, with another checkout installed editable (the shared
    venv's), plan.py still imports the code beside it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "plan.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), "--pp", "2", "--vpp", "2"] + BASE,
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dense interl." in done.stdout and "grouped exchanges" in done.stdout
