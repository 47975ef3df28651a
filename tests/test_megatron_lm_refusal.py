"""The Megatron-LM entry point under torchrun (EP=2 on 2 processes, the tiny Qwen3-MoE twin):
at iteration 1 only one data-parallel rank's group holds a token id beyond the vocabulary, and
both ranks stop with `StepRefused` naming that rank ([Note: agreed refusal] in
megatron_patches/runtime/agreement.py), for reuse (the executor's agreement) and for the dense baseline
(the trainer's own). Before, that rank raised (reuse) or failed inside the embedding (dense)
alone while its peer waited in the expert-parallel collective until the timeout."""

import re

import pytest

from megatron_lm_runs import iterations, torchrun
from test_megatron_lm_moe import moe_args
from test_megatron_lm_entry import tree  # noqa: F401 (fixture)

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("mode", ["reuse", "dense"])
def test_one_ranks_bad_group_stops_every_rank(tree, tmp_path, mode):  # noqa: F811
    trace = tmp_path / "steps.any"
    trace.write_text("synthetic")
    args = [*moe_args(3), "--rl-trace", str(trace), "--rl-trace-format",
            "tests.one_bad_group:make", "--distributed-timeout-minutes", "1"]
    run = torchrun(tree, 2, args + (["--prefix-reuse"] if mode == "reuse" else []), timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-4000:]
    assert sorted(iterations(output)) == [1], output[-4000:]  # iteration 0 ran, 1 was refused
    # (the stall reporter's "rank N failed first (StepRefused: ...)" quotes a refusal: not one)
    refusals = [line for line in output.splitlines()
                if "StepRefused: rank " in line and "refused the step" in line
                and "failed first (" not in line]
    assert len(refusals) >= 2 and len({line.split("StepRefused: ")[1] for line in refusals}) == 1, \
        output[-4000:]
    assert re.search(r"token 0 has id \d+, outside \[0, \d+\)", refusals[0]), refusals[0]
