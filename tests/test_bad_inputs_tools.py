"""Bad inputs to the tools, the trace reader and the Python API (issue 22's probe, kept as cases).

Each case asserts the exit status or exception type and that the message names what to fix.
Tools run in-process through their main(); nothing here starts Megatron or a process.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess

import pytest

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.traces import read_steps
from tools_import import tool

HEADER = {"format": "prefix-reuse-trace", "version": 1, "vocab_size": None, "source": "",
          "metadata": {}}
GROUP = '{"step":0,"prompt":[1,2],"responses":[[3,4]],"advantages":[1.0]}'


def _usage_error(main, argv, capsys) -> str:
    """argparse's refusal: exit status 2, the message on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# ---- flags: refused naming the flag, before any work -------------------------------------

FLAG_CASES = [
    ("layouts", ["llama3-8b", "--microbatches", "-2"], ["--microbatches", ">= 1"]),
    ("layouts", ["llama3-8b", "--gpus", "0"], ["--gpus", ">= 1"]),
    ("layouts", ["llama3-8b", "--seq-len", "-5"], ["--seq-len", ">= 1"]),
    ("layouts", ["llama3-8b", "--gpu-memory-gib", "nan"], ["--gpu-memory-gib", "finite"]),
    ("layouts", ["llama3-8b", "--gpu-memory-gib", "-1"], ["--gpu-memory-gib", "> 0"]),
    ("layouts", ["llama3-8b", "--prefix-len", "-3"], ["--prefix-len", ">= 0"]),
    ("layouts", ["llama3-8b", "--prefix-len", "20000"], ["--prefix-len", "shorter than --seq-len"]),
    ("capacity", ["--model", "tiny", "--memory-gib", "nan"], ["--memory-gib", "finite"]),
    ("capacity", ["--model", "tiny", "--memory-gib", "-5"], ["--memory-gib", "> 0"]),
    ("capacity", ["--model", "tiny", "--reserve-gib", "-100"], ["--reserve-gib", ">= 0"]),
    ("capacity", ["--model", "tiny", "--prefix-share", "nan"], ["--prefix-share", "finite"]),
    ("capacity", ["--model", "tiny", "--group-size", "10000000"], ["--group-size", "limit of 1,024"]),
    ("capacity", ["--model", "tiny", "--cp", "0"], ["--cp", ">= 1"]),
    ("capacity", ["--model", "tiny", "--json", "{tmp}/missing/c.json"], ["--json", "does not exist"]),
    ("capacity", ["--model", "tiny", "--frontier", "{tmp}"], ["--frontier", "is a directory"]),
    ("sweep", ["--list", "--points", "a:b:c"], ["--points", "PREFIX:SUFFIX:GROUP_SIZE"]),
    ("sweep", ["--list", "--points", "1:2"], ["--points", "2 field(s)"]),
    ("sweep", ["--list", "--group-sizes", "abc"], ["--group-sizes", "comma list"]),
    ("sweep", ["--list", "--threads", "0"], ["--threads", ">= 1"]),
    ("trace", ["synth", "--kind", "rag", "--steps", "1", "--group-sizes", "abc", "--out", "{tmp}/t"],
     ["--group-sizes", "comma list"]),
]


@pytest.mark.parametrize("name, argv, words", FLAG_CASES,
                         ids=[f"{c[0]} {' '.join(c[1][-2:])}" for c in FLAG_CASES])
def test_bad_flags_are_usage_errors_naming_the_flag(name, argv, words, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = _usage_error(tool(name).main, argv, capsys)
    assert all(w in err for w in words), err
    assert "Traceback" not in err
    assert not (tmp_path / "missing").exists()


def test_capacity_runs_with_context_parallelism():
    """--cp 2/3 crashed (PrefixWork.length=0): the search started below one cached token per
    CP rank."""
    capacity = tool("capacity")
    spec = capacity.MODELS["llama3-8b-tiny"]
    for cp in (2, 3):
        result = capacity.capacity(spec, memory_gib=80.0, group_size=2, prefix_share=0.5,
                                   layout=capacity.Layout(dp=8, cp=cp))
        assert result["dense"]["none"] > 0 and result["reuse"]["no offload, no recompute"][
            "trajectory"] > 0, result


@pytest.mark.parametrize("kwargs, words", [
    (dict(group_size=10 ** 7), ["group_size=10000000", "[1, 1,024]"]),
    (dict(memory_gib=float("nan")), ["memory_gib=nan", "> 0"]),
    (dict(reserve_gib=-1.0), ["reserve_gib=-1.0", ">= 0"]),
])
def test_capacity_api_bounds_its_inputs(kwargs, words):
    capacity = tool("capacity")
    args = {**dict(memory_gib=80.0, group_size=2, prefix_share=0.5), **kwargs}
    with pytest.raises(ValueError) as info:
        capacity.capacity(capacity.MODELS["llama3-8b-tiny"], **args)
    assert all(w in str(info.value) for w in words), info.value


@pytest.mark.parametrize("argv, words", [
    (["--json", "{tmp}/missing/out.json"], ["--json", "does not exist"]),
    (["--cp", "3", "--group-size", "1", "--num-groups", "2"], ["--cp=3", "--group-size"]),
])
def test_bench_refuses_before_the_run(argv, words, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert tool("bench").main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words) and "dp_size" not in err, err


# ---- trace.py: outputs written whole, never over an input --------------------------------

def _generic(path, *rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


ROW = {"step": 0, "prompt": [1, 2], "response": [3], "advantage": 1.0}


def test_import_generic_refuses_its_input_as_output(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    _generic(source, ROW)
    before = source.read_bytes()
    assert tool("trace").main(["import-generic", str(source), "--out", str(source)]) == 1
    assert "also an input" in capsys.readouterr().err
    assert source.read_bytes() == before


@pytest.mark.parametrize("rows, words", [
    ([], ["no trajectories"]),
    ([ROW, dict(ROW, prompt=[1, 2, 3], advantage="x")], ["lines [2]", "advantages"]),
    ([dict(ROW, step=[0])], ["in.jsonl:1", "step is list", "int or a string"]),
    ([dict(ROW, group={"a": 1})], ["in.jsonl:1", "group is dict", "int or a string"]),
])
def test_a_failed_import_leaves_no_output(rows, words, tmp_path, capsys):
    """A failure after some groups were written used to leave a trace that `validate` accepted;
    an empty input exited 0."""
    source, out, kept = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "kept.jsonl"
    _generic(source, *rows)
    trace = tool("trace")
    assert trace.main(["import-generic", str(source), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not out.exists()
    kept.write_text("old\n")
    assert trace.main(["import-generic", str(source), "--out", str(kept)]) == 1
    assert kept.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "kept.jsonl"]  # no temp


@pytest.mark.parametrize("data, words", [(b"[\xff]", "byte 1 is not UTF-8"),
                                         (b"[" * 200_000 + b"]" * 200_000, "nested too deeply")],
                         ids=["non-UTF-8", "200k-deep"])
def test_import_megatron_names_a_broken_dump(data, words, tmp_path, capsys):
    dump = tmp_path / "rollouts_rank0_iteration1_env.json"
    dump.write_bytes(data)
    argv = ["import-megatron", str(dump), "--out", str(tmp_path / "t.jsonl")]
    assert tool("trace").main(argv) == 1
    err = capsys.readouterr().err
    assert dump.name in err and words in err, err
    assert not (tmp_path / "t.jsonl").exists()


def test_stats_json_into_a_missing_directory_is_refused_first(tmp_path, capsys):
    trace = tool("trace")
    path = tmp_path / "t.jsonl"
    assert trace.main(["synth", "--kind", "rag", "--steps", "1", "--out", str(path)]) == 0
    assert trace.main(["stats", str(path), "--json", str(tmp_path / "no" / "s.json")]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "steps" not in capsys.readouterr().out


def test_synth_keeps_every_row_within_max_seq_len(tmp_path):
    """--max-seq-len 64 wrote 65-token rows (rounding of prompt and response lengths)."""
    path = tmp_path / "m.jsonl"
    assert tool("trace").main(["synth", "--kind", "math", "--steps", "3", "--max-seq-len", "64",
                               "--out", str(path)]) == 0
    lengths = [g.prefix.numel() + t.suffix.numel() for b in read_steps(path)
               for g in b.groups for t in g.trajectories]
    assert max(lengths) == 64


# ---- the trace reader: a clear error with file and line ----------------------------------

def _write_trace(path, body: bytes) -> None:
    data = (json.dumps(HEADER) + "\n").encode() + body
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def _gz(cut):
    data = gzip.compress(((json.dumps(HEADER) + "\n") + (GROUP + "\n") * 40).encode())
    return cut(data)


READER_CASES = {
    "10**400 advantage": (GROUP.replace("[1.0]", "[1" + "0" * 400 + "]"), ":2 ", "advantages"),
    "4,301-digit number": (GROUP.replace("[1.0]", "[1" + "0" * 4400 + "]"), ":2:", "float64"),
    "id >= 2**63": (GROUP.replace("[3,4]", f"[3,{2 ** 63}]"), ":2 ", "outside [0, 2**63)"),
    "10**400 id": (GROUP.replace("[3,4]", "[3,1" + "0" * 400 + "]"), ":2 ", "outside [0, 2**63)"),
    "200k-deep nesting": ("[" * 200_000 + "]" * 200_000, ":2:", "nested too deeply"),
    "non-UTF-8 bytes": (GROUP.replace('"advantages"', '"adv\udcff"'), ":2:", "not UTF-8"),
}


@pytest.mark.parametrize("line, where, words", READER_CASES.values(), ids=READER_CASES.keys())
def test_reader_names_file_and_line(line, where, words, tmp_path):
    path = tmp_path / "t.jsonl"
    _write_trace(path, line.encode("utf-8", "surrogateescape") + b"\n")
    with pytest.raises(ValueError) as info:
        list(read_steps(path))
    assert f"t.jsonl{where}" in str(info.value) and words in str(info.value), info.value


@pytest.mark.parametrize("cut", [lambda d: d[:len(d) // 2], lambda d: d[:20] + b"x" * 30 + d[50:],
                                 lambda d: gzip.decompress(d)],
                         ids=["truncated gz", "corrupt gz", "not gzip"])
def test_reader_refuses_a_broken_gz(cut, tmp_path, capsys):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(_gz(cut))
    assert tool("trace").main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "t.jsonl.gz:" in err and "corrupt or truncated" in err, err


def test_reader_bounds_the_line_length(tmp_path, monkeypatch):
    """[Note: line-length limit]: the limit is read before the line is, so a 2 GB line cannot
    exhaust memory; shown here with a 100-byte limit."""
    path = tmp_path / "t.jsonl"
    _write_trace(path, (GROUP.replace("[3,4]", "[" + ",".join(["3"] * 40) + "]") + "\n").encode())
    monkeypatch.setenv("PREFIX_REUSE_MAX_LINE_BYTES", "100")
    with pytest.raises(ValueError, match=r"t.jsonl:2: line longer than 100 bytes.*"
                                         r"PREFIX_REUSE_MAX_LINE_BYTES"):
        list(read_steps(path))
    monkeypatch.setenv("PREFIX_REUSE_MAX_LINE_BYTES", "-1")
    with pytest.raises(ValueError, match="PREFIX_REUSE_MAX_LINE_BYTES='-1'"):
        list(read_steps(path))
    monkeypatch.delenv("PREFIX_REUSE_MAX_LINE_BYTES")
    assert len(list(read_steps(path))) == 1


# ---- the Python API ----------------------------------------------------------------------

@pytest.mark.parametrize("advantages", [None, "x", {"a": 1}, [1.0, "x", 0.0], [10 ** 400] * 3],
                         ids=["None", "str", "dict", "a str entry", "10**400"])
def test_trajectory_refuses_non_numeric_advantages(advantages):
    with pytest.raises(ValueError, match="advantages"):
        Trajectory(suffix=[1, 2, 3], advantages=advantages)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_model_chunks=0), "num_model_chunks must be an int >= 1, got 0"),
    (dict(num_stages=10 ** 6), "beyond the limit of 1024"),
    (dict(num_stages=512, num_model_chunks=4), "beyond the limit of 1024"),
])
def test_reuse_step_bounds_its_pipeline(kwargs, message):
    """num_model_chunks=0 blamed num_stages; num_stages=10**6 planned for minutes."""
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep

    batch = GroupBatch(groups=[Group(prefix=[1, 2, 3], trajectories=[
        Trajectory(suffix=[4, 5], advantages=1.0) for _ in range(2)])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=64)
    with pytest.raises(ValueError) as info:
        ReuseStep(batch, plan, **kwargs)
    assert message in str(info.value)


# ---- the patch CLI: every target writable, or nothing written ----------------------------

@pytest.fixture
def stock_root(tmp_path, tmp_path_factory):
    pytest.importorskip("megatron.core")
    from test_patches import _stock_copy

    return _stock_copy("installed", tmp_path / "root", tmp_path_factory)


def _targets(root) -> dict:
    from megatron_patches.patching import registry

    return {p.target: (root / p.target).read_bytes() for p in registry.patches_at(root)}


def test_patch_apply_on_an_immutable_target_writes_nothing(stock_root, capsys):
    """An immutable target left the tree 3 of 4 applied with a PermissionError."""
    from megatron_patches.__main__ import main

    before = _targets(stock_root)
    locked = stock_root / sorted(before)[-1]
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(locked)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE)")
    try:
        assert main(["apply", "--root", str(stock_root)]) == 2
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    err = capsys.readouterr().err
    assert "nothing was written" in err and str(locked) in err and "chattr -i" in err
    assert _targets(stock_root) == before


def test_patch_apply_failing_midway_restores_what_it_wrote(stock_root, monkeypatch):
    """A write failing after the check (disk full, a race) puts back the files already written."""
    from megatron_patches.patching import registry

    before = _targets(stock_root)
    assert len({stock_root / t for t in before}) >= 3
    real, calls = registry._write_atomic, []

    def fail_third(path, text):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(registry, "_write_atomic", fail_third)
    with pytest.raises(OSError, match="No space"):
        registry.apply(stock_root)
    assert _targets(stock_root) == before
    assert not [p for p in stock_root.rglob(".*.tmp")]
    assert os.listdir(stock_root)
