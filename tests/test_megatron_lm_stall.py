"""A rank of the Megatron-LM entry point (examples/megatron_lm/train_grpo.py, PP=2, gloo, the
core_r0.19.0 checkout) stopped with SIGSTOP mid-run or at start-up: the job ends within
$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S (+ 5 s to collect the ranks' ends + torchrun's 30 s grace
before it SIGKILLs the stopped rank), and rank 0's error names rank 1 as stalled
(megatron_patches/megatron_lm/stalls.py). Before, the entry point waited Megatron's 10 minutes
("Timed out waiting 600000ms for recv", naming no rank).

The timeout arithmetic of `--distributed-timeout-minutes` / the variable, without processes:
test_megatron_lm_units-style cases at the bottom.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from megatron_lm_runs import ENTRY, REPO, child_env, entry_tree, model_args, small_args

TIMEOUT_S = 5
BOUND_S = TIMEOUT_S + 5 + 30 + 15  # timeout, the ends' collection, torchrun's grace, slack


def _rank_process(root: psutil.Process, rank: int):
    for child in root.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train_grpo" in " ".join(
                    child.cmdline()):
                return child
        except psutil.Error:
            pass
    return None


def _stop_rank_and_time(tree, args, when: str):
    """Run torchrun; SIGSTOP rank 1 as soon as it exists (`startup`) or once iteration 1 is
    logged (`midrun`); returns (seconds from the stall's start to the job's end, output). At
    start-up the stall starts when rank 0 has parsed the arguments (its "collective timeout"
    line): its imports before that are no wait for a peer."""
    env = {**child_env(tree), "PREFIX_REUSE_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", str(ENTRY), *args], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, seen = [], {}
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    root, stopped, start = psutil.Process(proc.pid), None, time.monotonic()
    try:
        while stopped is None and proc.poll() is None and time.monotonic() - start < 400:
            for child in root.children(recursive=True):
                seen[child.pid] = child
            ready = when == "startup" or any("iteration        1/" in line for line in lines)
            target = _rank_process(root, 1) if ready else None
            if target is not None:
                target.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
            time.sleep(0.05)
        assert stopped is not None, "".join(lines)[-4000:]
        while when == "startup" and proc.poll() is None and time.monotonic() - start < 400 and \
                not any("collective timeout:" in line for line in lines):
            seen.update((c.pid, c) for c in root.children(recursive=True))
            time.sleep(0.05)
        stopped = time.monotonic() if when == "startup" else stopped
        try:
            proc.wait(timeout=BOUND_S + 60)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in seen.values():
            try:
                child.kill()
            except psutil.Error:
                pass
        proc.wait()
        reader.join(timeout=10)
    return took, "".join(lines)


@pytest.mark.megatron
@pytest.mark.parametrize("when", ["midrun", pytest.param("startup", marks=pytest.mark.slow)])
def test_a_stopped_rank_ends_the_entry_point_within_the_timeout_named(when, tmp_path_factory):
    tree = entry_tree("0.19.1", tmp_path_factory)
    args = [*model_args("llama3.1-8b-tiny"), *small_args(10**6), "--prefix-reuse",
            "--pipeline-model-parallel-size", "2"]
    took, output = _stop_rank_and_time(tree, args, when)
    assert took < BOUND_S, (took, output[-4000:])
    assert "[rank 0] rank 1 stalled" in output, output[-4000:]
    assert f"collective timeout: {TIMEOUT_S} s" in output, output[-4000:]


# ---- the timeout's source, in-process ----------------------------------------------------

TIMEOUT_CASES = [  # (argv, env, Megatron's parsed minutes, expected minutes or error words)
    ([], None, 10, 10),
    ([], "30", 10, 0.5),
    (["--distributed-timeout-minutes", "2"], "30", 2, 2),
    (["--distributed-timeout-minutes=2"], "30", 2, 2),
    ([], "soon", 10, ["PREFIX_REUSE_COLLECTIVE_TIMEOUT_S", "seconds > 0"]),
    ([], "0", 10, ["PREFIX_REUSE_COLLECTIVE_TIMEOUT_S", "seconds > 0"]),
    (["--distributed-timeout-minutes", "0"], None, 0, ["--distributed-timeout-minutes 0",
                                                       "minutes > 0"]),
    (["--distributed-timeout-minutes", "-1"], "30", -1, ["minutes > 0"]),
]


@pytest.mark.parametrize("argv, env, parsed, expected", TIMEOUT_CASES)
def test_collective_timeout_source(argv, env, parsed, expected, monkeypatch):
    from megatron_patches.megatron_lm.stalls import apply_collective_timeout

    if env is None:
        monkeypatch.delenv("PREFIX_REUSE_COLLECTIVE_TIMEOUT_S", raising=False)
    else:
        monkeypatch.setenv("PREFIX_REUSE_COLLECTIVE_TIMEOUT_S", env)
    args = SimpleNamespace(distributed_timeout_minutes=parsed)
    if isinstance(expected, list):
        with pytest.raises(ValueError) as info:
            apply_collective_timeout(args, argv)
        assert all(w in str(info.value) for w in expected), info.value
    else:
        apply_collective_timeout(args, argv)
        assert args.distributed_timeout_minutes == expected


def test_the_launch_scripts_export_the_timeout():
    for name in ("torchrun_multinode.sh", "train_grpo.sbatch"):
        text = (REPO / "examples" / "megatron_lm" / name).read_text()
        assert "export PREFIX_REUSE_COLLECTIVE_TIMEOUT_S" in text, name
    assert os.path.exists(ENTRY)
