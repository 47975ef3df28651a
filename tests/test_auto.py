"""The user-facing entry (prefix_schedule.plan_trajectories, ReuseStep.from_trajectories): flat
multi-turn trajectories in, reuse out, equal to stock Megatron dense over the same flat
sequences (fp32, 1e-5), with the report of what was shared and the expected speedup."""

import pytest
import torch

from prefix_schedule import FlatTrajectory, ReuseStep, plan_trajectories
from prefix_schedule.planning.flops import ModelDims
from test_equivalence import LOSS, assert_equal_step

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
DIMS = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, gated_linear_unit=True)


def _agent_rollouts(seed):
    """A system prompt; 2 tasks; per task 2 first turns (trained on), each answered 3 ways; one
    unrelated trajectory (runs dense)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, 256, (n,), generator=gen).tolist()
    system, out = tokens(24), []
    for _ in range(2):
        task = tokens(12)
        for _ in range(2):
            turn = tokens(10)
            for _ in range(3):
                out.append((system + task + turn + tokens(6), len(system) + len(task)))
    out.append((tokens(20), 5))
    flat = []
    for seq, first_loss in out:
        n = len(seq)
        mask = torch.zeros(n)
        mask[first_loss:] = (torch.rand(n - first_loss, generator=gen) > 0.2).float()
        flat.append(FlatTrajectory(tokens=seq, loss_mask=mask,
                                   advantages=torch.randn(n, generator=gen),
                                   old_logprobs=-torch.rand(n, generator=gen) * 6 - 1,
                                   ref_logprobs=-torch.rand(n, generator=gen) * 6 - 1))
    return flat


def test_report_before_running():
    result = plan_trajectories(_agent_rollouts(1), dims=DIMS, max_seq_len=512, min_shared_len=4,
                               node_overhead_tokens=0, min_gain=1.0)
    tree, lone = result.batch.groups
    assert tree.num_nodes == 1 + 2 + 4 and len(tree.trajectories) == 12
    assert result.policy.dense_groups == (1,)  # a lone trajectory gains nothing
    assert result.ideal_speedup > 2.0
    report = result.describe()
    assert "expected speedup" in report and "7 node(s)" in report


@pytest.mark.megatron
@pytest.mark.parametrize("chunk", [None, 8])
def test_from_trajectories_equals_stock_dense(megatron_env, chunk):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import (dense_step, param_grads, reuse_step,
                                           scale_grads_by_token_count)

    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    step = ReuseStep.from_trajectories(_agent_rollouts(2), dims=DIMS, max_seq_len=512,
                                       min_shared_len=4, node_overhead_tokens=0,
                                       prefix_chunk_tokens=chunk, token_budget=40)
    batch, flat = step.batch, _agent_rollouts(2)
    for group, sources in zip(batch.groups, step.report.detection.sources):
        for t, i in enumerate(sources):  # the dense rows are the flat sequences
            row = torch.cat([group.context(group.trajectories[t].node),
                             group.trajectories[t].suffix])
            assert torch.equal(row, flat[i].tokens)
    dense = dense_step(model, batch, LOSS)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, step.plan, LOSS, step=step)
    assert_equal_step(dense, dense_grads, reuse, param_grads(model))
    assert "expected speedup" in step.report.describe()
