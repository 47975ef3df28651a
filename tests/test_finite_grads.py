"""[Note: non-finite gradients stop the step] (megatron_patches/runtime/finite_grads.py): a step whose
gradients hold NaN or inf is stopped before the optimizer, naming the step and the parameter;
in the Megatron-LM entry point on every rank together (issue 22: NaN weights trained on)."""
import pytest
import torch

from test_megatron_lm_entry import tree  # noqa: F401 (fixture)

pytestmark = pytest.mark.megatron


def test_check_names_the_step_and_the_first_bad_parameter():
    from megatron_patches.runtime.finite_grads import NonFiniteGradients, check_finite_grads

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    check_finite_grads(model, step=4)  # no gradients yet: nothing to check
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    check_finite_grads(model, step=4)
    model[1].weight.grad[0, 1] = float("inf")
    model[1].bias.main_grad = torch.tensor([float("nan")])  # main_grad wins over .grad (DDP)
    with pytest.raises(NonFiniteGradients, match=r"step 4: run reuse: the gradient of 1.weight "
                                                 r"holds 0 NaN and 1 inf entries \(2 param"):
        check_finite_grads(model, step=4, run="reuse")
    assert issubclass(NonFiniteGradients, ValueError)


def test_entry_point_stops_a_non_finite_step_on_every_rank(tree, tmp_path):  # noqa: F811
    from megatron_lm_runs import iterations, torchrun
    from test_megatron_lm_moe import moe_args

    trace = tmp_path / "steps.any"
    trace.write_text("synthetic")
    args = [*moe_args(3), "--rl-trace", str(trace), "--rl-trace-format",
            "tests.nan_grad_step:make", "--distributed-timeout-minutes", "1", "--prefix-reuse"]
    run = torchrun(tree, 2, args, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-4000:]
    assert sorted(iterations(output)) == [1], output[-4000:]  # iteration 0 ran, 1 was stopped
    refusals = [line for line in output.splitlines()
                if "StepRefused: rank 0 refused the step" in line]
    assert len(refusals) >= 2, output[-4000:]
    assert "step 1: the gradient of" in refusals[0] and "holds 1 NaN" in refusals[0], refusals[0]
