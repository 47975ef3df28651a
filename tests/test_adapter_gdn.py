"""The framework adapter on a Gated DeltaNet hybrid with a prefix tree whose root is also read
by a trajectory of its own (it stops one token before the root's end, inside the root's cached
tokens): the adapter plans with StepPlan.state_reads, so the root is cut where that reader
stops, and the step equals the framework's dense microbatching (fp32, 1e-5)."""
import pytest
import torch

from framework_data import assert_grads_equal, reported_sum, rollout_arrays, run_both
from test_adapter import _pairs, _trees, token_mean_times_microbatches

pytestmark = pytest.mark.megatron


def _sequences(seed=4):
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(1, 256, (n,), generator=gen)
    system, out = tokens(30), []
    for k in range(2):  # two follow-ups of the system prompt, two samples each
        follow = tokens(14)
        out += [(torch.cat([system, follow, tokens(5 + k)]), 30, "uid-tree") for _ in range(2)]
    out += [(torch.cat([system, tokens(9)]), 30, "uid-tree")]  # reads the root itself
    prompt = tokens(25)
    out += [(torch.cat([prompt, tokens(6 + k)]), 25, "uid-0") for k in range(3)]
    return out, gen


def test_gdn_tree_through_the_adapter_equals_dense(megatron_env):
    from megatron_patches.frameworks import PrefixReuseAdapter, RolloutBatch
    from test_gdn import _gdn_model

    seqs, gen = _sequences()
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    rollout = RolloutBatch(tokens=[s[0] for s in seqs], loss_mask=masks, advantages=adv,
                           old_logprobs=old, ref_logprobs=ref, group_ids=[s[2] for s in seqs])
    model = _gdn_model(attention_output_gate=True)
    model.config.calculate_per_token_loss = False  # the 2-tuple contract of this loss
    plan = PrefixReuseAdapter(model, _trees()).prepare(rollout).step.plan
    trees = [w for w in plan.prefixes if w.nodes is not None]
    assert plan.state_reads and trees, "no tree, or planned without state_reads"
    units = [c for c in plan.prefix_units().values() if c.group == trees[0].group]
    assert len(units) > len(trees[0].nodes), "no node was cut where a reader stops"
    loss_fn = token_mean_times_microbatches(rollout.num_loss_tokens)
    dense, dg, reuse, rg = run_both(model, rollout, loss_fn, config=_trees(),
                                    micro_batches=_pairs(rollout.num_sequences))
    assert_grads_equal(dg, rg)
    assert abs(reported_sum(dense) - reported_sum(reuse)) <= 1e-5 * abs(reported_sum(dense))
