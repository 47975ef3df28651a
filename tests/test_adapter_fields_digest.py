"""Issue 37: TP=2 ranks holding different per-token `fields` trained on (rank 0's gradient
moved): the step's agreement signature (IndexedReuseStep.signature, compared across the
step's TP/PP/CP peers by the executor before any compute) did not cover `fields`. Now it folds
in RolloutBatch.fields_digest. Checked in-process: the signatures two peers would compare."""
import pytest
import torch

from test_adapter import _model, _rollout

pytestmark = pytest.mark.megatron


def _with_fields(rollout, fields):
    from megatron_patches.frameworks import RolloutBatch
    return RolloutBatch(tokens=rollout.tokens, loss_mask=rollout.loss_mask,
                        advantages=rollout.advantages, old_logprobs=rollout.old_logprobs,
                        ref_logprobs=rollout.ref_logprobs, group_ids=rollout.group_ids,
                        fields=fields)


def _weights(rollout, bump=None, name="rollout_is_weights"):
    rows = [torch.ones(n) for n in rollout.lengths]
    if bump is not None:
        rows[bump] = rows[bump].clone()
        rows[bump][-1] = 0.5
    return {name: rows}


CASES = [  # (fields of peer A, fields of peer B, same signature?)
    (lambda r: _weights(r), lambda r: _weights(r), True),
    (lambda r: _weights(r), lambda r: _weights(r, bump=0), False),
    (lambda r: _weights(r), lambda r: _weights(r, bump=len(r.lengths) - 1), False),
    (lambda r: _weights(r), lambda r: _weights(r, name="other"), False),
    (lambda r: _weights(r), lambda r: {}, False),
]


@pytest.mark.parametrize("a, b, same", CASES)
def test_fields_are_in_the_step_signature(megatron_env, a, b, same):
    from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter
    base = _rollout()
    adapter = PrefixReuseAdapter(_model(), AdapterConfig(min_shared_len=8, node_overhead_tokens=0,
                                                         min_gain=1.0))
    first = adapter.prepare(_with_fields(base, a(base))).step.signature()
    second = adapter.prepare(_with_fields(base, b(base))).step.signature()
    assert (first == second) is same
