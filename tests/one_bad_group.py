"""A step source for tests/test_megatron_lm_refusal.py (`--rl-trace-format
tests.one_bad_group:make`): the synthetic steps of the trainer, except that at iteration 1 the
last group's first response holds a token id beyond the vocabulary. The trainer places whole
groups on data-parallel ranks, so only the rank that gets that group sees it."""

import dataclasses

from megatron_patches.megatron_lm import data

BAD_ITERATION = 1


@dataclasses.dataclass
class OneBadGroup:
    inner: data.StepSource
    vocab_size: int

    def step(self, iteration: int):
        batch = self.inner.step(iteration)
        if iteration == BAD_ITERATION:
            batch.groups[-1].trajectories[0].suffix[0] = self.vocab_size + 5
        return batch


def make(path, args):
    args.rl_trace = None  # the synthetic source of these arguments
    try:
        inner = data.open_step_source(args)
    finally:
        args.rl_trace = path
    return OneBadGroup(inner, args.padded_vocab_size)
