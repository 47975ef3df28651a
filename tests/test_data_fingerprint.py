"""Ranks that run one step together (a replica's TP and PP ranks) given same-shaped but
different token ids are refused on every rank: the replica's agreement fingerprint folds in a
digest of the data (batch_checks.batch_digest; issue 22: they trained on, grad norm 1.0894 vs
1.0946). No extra collective: the existing per-step flag all-reduce carries it."""

import pytest
import torch

from dist_harness import run_distributed
from test_agreed_refusal import SHAPES, _outcome, _reuse
from test_equivalence import LOSS, make_batch
from test_moe_parallel import MODEL

pytestmark = pytest.mark.megatron


def _other_tokens(batch):
    suffix = batch.groups[1].trajectories[0].suffix
    suffix[3] = (int(suffix[3]) + 1) % MODEL["vocab_size"]  # same shapes, one token differs
    return batch


def model_parallel_rank(parallel: str) -> dict:
    """`parallel` "pp" or "tp": 2 ranks of one replica; the second gets one other token id."""
    import megatron_patches
    from megatron.core import parallel_state as ps
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import dense_step, prepare_for_training, zero_grads

    megatron_patches.install()
    initialize_distributed(seed=1234, **{parallel: 2})
    model = prepare_for_training(build_model(TinyLlamaConfig(**MODEL)), ddp=True)
    second = (ps.get_pipeline_model_parallel_rank() if parallel == "pp"
              else ps.get_tensor_model_parallel_rank()) == 1
    batch = lambda: _other_tokens(make_batch(3, SHAPES)) if second else make_batch(3, SHAPES)  # noqa: E731
    out = {"reuse": _outcome(model, lambda: _reuse(model, batch())),
           "dense": _outcome(model, lambda: dense_step(model, batch(), LOSS))}
    zero_grads(model)
    _reuse(model, make_batch(3, SHAPES))  # the same data on both: runs
    out["good_step"] = all(torch.isfinite(p.main_grad).all() for p in model.parameters())
    return out


@pytest.mark.parametrize("parallel", ["pp", "tp"])
def test_same_shaped_but_different_tokens_are_refused_on_every_rank(megatron_env, parallel):
    results = run_distributed(model_parallel_rank, world_size=2, kwargs=dict(parallel=parallel),
                              timeout_s=240, collective_timeout_s=30)
    for rank, out in enumerate(results):
        for path in ("reuse", "dense"):
            got = out[path]
            assert got["type"] == "StepRefused" and not got["computed"], (rank, path, got)
            assert "or data: token ids" in got["message"], (rank, path, got)
        assert out["good_step"], rank


def test_batch_digest_sees_every_array():
    from prefix_schedule.planning.batch_checks import batch_digest

    base = batch_digest(make_batch(3, SHAPES))
    assert batch_digest(make_batch(3, SHAPES)) == base
    edits = [lambda tr: tr.suffix.__setitem__(0, int(tr.suffix[0]) ^ 1),
             lambda tr: tr.loss_mask.__setitem__(1, 1 - float(tr.loss_mask[1])),
             lambda tr: tr.advantages.__setitem__(0, float(tr.advantages[0]) + 1e-6),
             lambda tr: tr.old_logprobs.__setitem__(0, float(tr.old_logprobs[0]) - 1e-3),
             lambda tr: tr.ref_logprobs.__setitem__(0, float(tr.ref_logprobs[0]) - 1e-3)]
    for edit in edits:
        batch = make_batch(3, SHAPES)
        edit(batch.groups[1].trajectories[1])
        assert batch_digest(batch) != base
    batch = make_batch(3, SHAPES)
    batch.groups[0].prefix[0] = (int(batch.groups[0].prefix[0]) + 1) % 256
    assert batch_digest(batch) != base
