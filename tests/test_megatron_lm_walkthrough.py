"""The README's Megatron-LM walkthrough, step by step, where it used to break (issue 21):

* `--rl-trace` reads the project's own trace format (tools/trace.py), by extension and by
  content; a trace-fed run trains reuse == dense (every gradient and weight, 1e-5 relative);
* a run with nothing left to train says so and exits non-zero unless --allow-nothing-to-train;
* negative GRPO losses (which Megatron's log line leaves out) are printed; the argument dump and
  the known-harmless warnings are gone (megatron_patches/megatron_lm/quiet.py);
* bad arguments are one clear line, before any compute: --rl-trace-format nosuchmod:make,
  --clip-grad > 0 without CUDA; `--help` lists our flags on both supported trees;
* Megatron's C++ dataset helpers compile without the venv's python on PATH;
* torchrun_multinode.sh runs where $USER is unset.
"""

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_lm_runs import (REPO, ENTRY, child_env, entry_tree, model_args, rank_params,
                              small_args, torchrun)
from megatron_trees import patched_tree, stock_tree

QWEN = "qwen3-8b-tiny"


def _synth_trace(path: Path, steps: int = 3) -> Path:
    subprocess.run([sys.executable, str(REPO / "tools" / "trace.py"), "synth", "--kind", "rag",
                    "--steps", str(steps), "--max-seq-len", "64", "--vocab-size", "512",
                    "--groups-per-step", "2", "--group-sizes", "3", "--out", str(path)],
                   check=True, capture_output=True, timeout=120)
    return path


def _trace_args(**overrides):
    args = types.SimpleNamespace(rl_trace=None, rl_trace_format=None, padded_vocab_size=512)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _same_batch(a, b) -> bool:
    return len(a.groups) == len(b.groups) and all(
        torch.equal(g.prefix, h.prefix) and all(torch.equal(t.suffix, u.suffix)
                                                for t, u in zip(g.trajectories, h.trajectories))
        for g, h in zip(a.groups, b.groups))


def test_project_trace_is_read_by_extension_and_by_content(tmp_path):
    from megatron_patches.megatron_lm import data
    from megatron_patches.megatron_lm.trace_source import TraceSteps
    from prefix_schedule.traces import read_steps

    trace = _synth_trace(tmp_path / "rag.jsonl", steps=4)
    expected = list(read_steps(trace))
    assert len(expected) == 4
    renamed = tmp_path / "rollouts.data"  # no extension any reader claims: found by content
    shutil.copy(trace, renamed)
    for path in (trace, renamed):
        source = data.open_step_source(_trace_args(rl_trace=str(path)))
        assert isinstance(source, TraceSteps)
        for iteration in (0, 1, 3, 2, 0):  # in order, then jumps (a resumed run)
            assert _same_batch(source.step(iteration), expected[iteration]), (path, iteration)
        with pytest.raises(ValueError, match=r"has no step 4 .*--train-iters"):
            source.step(4)
    named = data.open_step_source(_trace_args(rl_trace=str(renamed),
                                              rl_trace_format="prefix-reuse-trace"))
    assert _same_batch(named.step(1), expected[1])
    assert data.trace_readers()["prefix-reuse-trace"] == (".jsonl", ".jsonl.gz")


def test_a_jsonl_that_is_not_a_trace_says_how_to_import_it(tmp_path):
    from megatron_patches.megatron_lm import data

    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text('{"prompt": [1, 2], "response": [3]}\n')
    with pytest.raises(ValueError, match=r"not a trace header.*import"):
        data.open_step_source(_trace_args(rl_trace=str(rollouts)))
    other = tmp_path / "steps.bin"
    other.write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no trace reader claims this file"):
        data.open_step_source(_trace_args(rl_trace=str(other)))


@pytest.mark.parametrize("fmt,message", [
    ("nosuchmod:make", r"cannot load the reader \(ModuleNotFoundError"),
    ("os:no_such_reader", r"cannot load the reader \(AttributeError"),
    ("os:sep", r"sep is not callable"),
])
def test_rl_trace_format_errors_are_value_errors_before_compute(tmp_path, fmt, message):
    import argparse

    from megatron_patches.megatron_lm.arguments import (add_prefix_reuse_args,
                                                        check_prefix_reuse_args)

    trace = _synth_trace(tmp_path / "t.jsonl", steps=1)
    args = add_prefix_reuse_args(argparse.ArgumentParser()).parse_args(
        ["--rl-trace", str(trace), "--rl-trace-format", fmt])
    for key, value in dict(num_experts=None, grpo_entropy_term_weight=0.0, micro_batch_size=1,
                           calculate_per_token_loss=True, seq_length=64, train_iters=2).items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message):
        check_prefix_reuse_args(args)


def test_quiet_console_leaves_out_only_known_harmless_messages():
    import logging

    from megatron_patches.megatron_lm import quiet

    def shown(message):
        record = logging.LogRecord("megatron.x", logging.WARNING, __file__, 1, message, (), None)
        return quiet._HarmlessFilter().filter(record)

    for prefix, reason in quiet.HARMLESS:
        assert not shown(prefix + " and more") and reason
    assert shown("RerunStateMachine: result validation failed")  # not listed: shown
    args_only = ("Rank 1 common state dict differs from rank 0 common state dict. Keys only on "
                 "rank 0: [], Keys only on 1: [], Mismatched keys: [(('args',), <class "
                 "'argparse.Namespace'>, <class 'argparse.Namespace'>)]")
    assert not shown(args_only)
    assert shown(args_only.replace("(('args',)", "(('optimizer',)"))
    assert shown(args_only.replace("Keys only on 1: []", "Keys only on 1: ['rng_state']"))


def test_dataset_helpers_compile_without_the_venv_on_path(tmp_path_factory):
    """Megatron's Makefile runs `python3 -m pybind11`: the first python3 on PATH. With a PATH
    of the system directories only (no venv), that is a Python without pybind11 and the compile
    fails; the entry point puts this interpreter first (path_with_this_python) and it works."""
    from megatron_patches.megatron_lm.main import path_with_this_python

    pytest.importorskip("pybind11")
    source = stock_tree("0.19.1", tmp_path_factory) / "megatron" / "core" / "datasets"
    bare = "/usr/bin:/bin"
    fixed = path_with_this_python(bare)
    assert fixed != bare, f"{sys.executable}: its directory has no python3 that is itself"

    def make(path):
        build = tmp_path_factory.mktemp("helpers")
        for name in ("Makefile", "helpers.cpp"):
            shutil.copy(source / name, build / name)
        return subprocess.run(["make", "-C", str(build)], env={**os.environ, "PATH": path},
                              capture_output=True, text=True, timeout=600), build

    run, build = make(fixed)
    assert run.returncode == 0 and list(build.glob("helpers_cpp*.so")), run.stdout + run.stderr
    system_has_pybind11 = subprocess.run(["python3", "-m", "pybind11", "--includes"],
                                         env={"PATH": bare}, capture_output=True).returncode == 0
    if not system_has_pybind11:  # the cause, as a user without the venv on PATH meets it
        assert make(bare)[0].returncode != 0


def test_multinode_script_runs_without_user(tmp_path):
    """Containers and SLURM batch steps may leave $USER unset (`set -u` made that fatal)."""
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "SLURM_JOB_ID", "RDZV_ID")}
    env.update(PYTHON="echo", NNODES="1", NPROC_PER_NODE="2", RDZV_ENDPOINT="127.0.0.1:29500")
    script = REPO / "examples" / "megatron_lm" / "torchrun_multinode.sh"
    run = subprocess.run(["bash", str(script), "--seq-length", "64"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert re.search(r"--rdzv-id prefix-reuse-uid\d+ ", run.stdout), run.stdout
    assert run.stdout.rstrip().endswith("train_grpo.py --seq-length 64"), run.stdout


@pytest.mark.megatron
@pytest.mark.parametrize("version", ["0.19.1", "0.20.0"])
def test_help_lists_our_flags_on_both_trees(tmp_path_factory, version):
    tree = patched_tree(version, tmp_path_factory)
    run = subprocess.run([sys.executable, str(ENTRY), "--help"], env=child_env(tree),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for flag in ("--prefix-reuse ", "--rl-trace ", "--allow-nothing-to-train",
                 "--prefix-reuse-megatron-verbose", "--clip-grad"):
        assert flag in run.stdout, flag


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


def _common(trace: Path):
    """Adam with eps=1, far above |g|: each update is near-linear in the gradient, so the
    weights after a step compare at the gradients' tolerance (an entry at float-noise level
    would otherwise get an O(lr) update of noise sign; tests/test_megatron_lm_moe.py)."""
    return [*model_args(QWEN), *small_args(2), "--tensor-model-parallel-size", "2",
            "--adam-eps", "1", "--rl-trace", str(trace)]


def _output(run) -> str:
    return run.stdout + run.stderr


@pytest.mark.megatron
def test_walkthrough_on_a_synthesized_trace(tree, tmp_path):
    """TP=2 on a trace written by tools/trace.py: reuse == dense (the step's gradients and the
    weights after it, 1e-5 relative, finite); negative losses printed; no argument dump; then
    the same command again into the same --save/--load has nothing to train: an error, unless
    --allow-nothing-to-train."""
    from megatron_patches.training import max_relative_diff

    common = _common(_synth_trace(tmp_path / "trace.jsonl"))
    dense = torchrun(tree, 2, [*common, "--prefix-reuse-dump-params", str(tmp_path / "dense")])
    reuse_args = [*common, "--prefix-reuse", "--save", str(tmp_path / "ckpt"), "--load",
                  str(tmp_path / "ckpt"), "--save-interval", "2"]
    reuse = torchrun(tree, 2, [*reuse_args, "--prefix-reuse-dump-params", str(tmp_path / "reuse")])
    for run in (dense, reuse):
        assert run.returncode == 0, _output(run)[-6000:]
        assert "end of arguments" not in _output(run)  # the dump is one line now
        assert "Megatron-LM arguments: " in _output(run)
    for iteration in (1, 2):
        a = rank_params(tmp_path / "dense", iteration)
        b = rank_params(tmp_path / "reuse", iteration)
        assert a.keys() == b.keys() == {"rank_0.safetensors", "rank_1.safetensors"}
        for rank in a:
            assert any(k.startswith("grad.") for k in a[rank])
            for side in (a[rank], b[rank]):
                assert all(torch.isfinite(t).all() for t in side.values()), (iteration, rank)
            assert max_relative_diff(a[rank], b[rank]) <= 1e-5, (iteration, rank)
    _check_loss_lines(_output(reuse))

    again = torchrun(tree, 2, reuse_args)
    assert again.returncode != 0 and "NOTHING TO TRAIN (error)" in _output(again), \
        _output(again)[-4000:]
    allowed = torchrun(tree, 2, [*reuse_args, "--allow-nothing-to-train"])
    assert allowed.returncode == 0, _output(allowed)[-4000:]
    assert "NOTHING TO TRAIN (--allow-nothing-to-train given" in _output(allowed)


def _check_loss_lines(output: str) -> None:
    """Every logged iteration shows its policy loss: on Megatron's line when >= 0, else on ours
    right after it; this trace (seed 0) has a negative one."""
    negatives = 0
    for iteration in (1, 2):
        megatron = re.search(rf"iteration\s+{iteration}/\s*2 \| consumed.*", output).group(0)
        ours = re.search(rf"iteration\s+{iteration}/\s*2 \| policy loss: (-\S+) \|.*negative",
                         output)
        assert ("policy loss:" in megatron) != bool(ours), (iteration, megatron)
        negatives += bool(ours)
    assert negatives >= 1, output[-3000:]


@pytest.mark.megatron
@pytest.mark.parametrize("flags,message", [
    (["--rl-trace-format", "nosuchmod:make"], "cannot load the reader (ModuleNotFoundError"),
    (["--clip-grad", "1.0"], "--clip-grad 1.0 (Megatron's default is 1.0)"),
    (["--save", "ckpt"], "refused the arguments: `assert args.save_interval is not None`"),
])
def test_bad_arguments_are_one_line_before_compute(tree, tmp_path, flags, message):
    args = _common(_synth_trace(tmp_path / "t.jsonl", steps=1))
    run = torchrun(tree, 2, [*args, *flags], timeout=300)
    output = _output(run)
    assert run.returncode != 0
    assert output.count("train_grpo.py: error: ") == 1 and message in output, output[-4000:]
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output
    assert "> initializing torch distributed" not in output  # refused before any process group
