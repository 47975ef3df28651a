"""A step source for tests/test_finite_grads.py (`--rl-trace-format tests.nan_grad_step:make`):
the trainer's synthetic steps, and at iteration 1 rank 0's first gradient entry is made NaN
after the forward-backward (after Megatron's own DDP NaN check), as a numerical fault would."""

import torch

from megatron_patches.megatron_lm import data, trainer

BAD_ITERATION = 1


def make(path, args):
    real = trainer._forward_backward

    def poisoned(args, model, *rest):
        reports = real(args, model, *rest)
        if args.iteration == BAD_ITERATION and torch.distributed.get_rank() == 0:
            next(model[0].parameters()).main_grad.view(-1)[0] = float("nan")
        return reports

    trainer._forward_backward = poisoned
    args.rl_trace = None  # the synthetic source of these arguments
    try:
        return data.open_step_source(args)
    finally:
        args.rl_trace = path
