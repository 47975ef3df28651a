"""Groups stay whole under verl's `trainer.balance_batch` at DP=2 (make test-frameworks).

verl 0.9.1's own `RayPPOTrainer._balance_batch` runs on a GRPO batch (uid per sample, groups
contiguous as the rollout returns them) and verl's own mini-batch iterator
(`tu.make_iterator`, what `TrainingWorker.train_mini_batch` iterates) slices each rank's share.
Default balancing (length-balanced partitions, then reordered inside each partition) splits
groups over ranks; with `actor_rollout_ref.actor.use_prefix_grouper=True` -- read by the
trainer's `__init__` (`self.use_prefix_grouper`) and honoured by `_balance_batch`
(`get_group_balanced_partitions`), used nowhere else on the Megatron path in 0.9.1 -- every
group lands on one rank and in one mini-batch. The sharing kept is measured as prompt tokens
computed under reuse / prompt tokens dense (a group's prompt once per rank-and-mini-batch that
holds part of it). Stand-ins (named): the trainer object around `_balance_batch` (its config,
`use_prefix_grouper` and the DP size of the actor worker group).
"""
import os
import types

import numpy as np
import pytest
import torch

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    import verl  # noqa: F401  (make test-frameworks: a broken install fails, never skips)
else:
    verl = pytest.importorskip("verl", reason="verl is installed by `make test-frameworks`")

N, GROUPS, MINI = 4, 8, 2  # rollout.n, prompts per step, ppo_mini_batch_size (prompts)


def _grpo_batch(seed=0):
    from verl import DataProto
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(20, 200, (GROUPS,), generator=gen)
    rows, uids, prompts = [], [], []
    for g in range(GROUPS):
        for _ in range(N):
            rows.append(int(prompt_lens[g]) + int(torch.randint(5, 300, (1,), generator=gen)))
            uids.append(f"uid{g}")
            prompts.append(int(prompt_lens[g]))
    width = max(rows)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, n in enumerate(rows):
        mask[i, :n] = 1
    batch = DataProto.from_dict(tensors={"attention_mask": mask,
                                         "prompt_len": torch.tensor(prompts)},
                                non_tensors={"uid": np.array(uids, dtype=object)})
    return batch


def _balance(batch, *, dp, use_prefix_grouper):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    trainer = types.SimpleNamespace(
        use_prefix_grouper=use_prefix_grouper, actor_rollout_wg=None,
        _get_dp_size=lambda wg, role: dp,
        config=types.SimpleNamespace(actor_rollout_ref=types.SimpleNamespace(
            actor={"ppo_mini_batch_size": MINI})))
    RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    return batch


def _shards(batch, dp):
    """Per rank (verl's dispatch splits the reordered batch in dp equal chunks), per
    mini-batch (verl's make_iterator, shuffle off as actor.shuffle's default): the uids."""
    from verl.utils import tensordict_utils as tu
    td = batch.to_tensordict()
    per_rank = len(td) // dp
    out = []
    for r in range(dp):
        part = td[r * per_rank:(r + 1) * per_rank]
        minis = tu.make_iterator(part, mini_batch_size=MINI * N // dp, epochs=1, seed=42 + r,
                                 dataloader_kwargs={"shuffle": False})
        out.append([(list(m["uid"]), m["prompt_len"].tolist()) for m in minis])
    return out


def _sharing_kept(batch, dp):
    """Prompt tokens computed with reuse / dense: a group's prompt once per mini-batch that
    holds any of its samples, vs once per sample."""
    dense = reuse = 0
    for rank in _shards(batch, dp):
        for uids, prompt_lens in rank:
            seen = {}
            for uid, p in zip(uids, prompt_lens):
                dense += p
                seen[uid] = p
            reuse += sum(seen.values())
    return reuse / dense


@pytest.mark.parametrize("dp", [1, 2])
def test_verl_prefix_grouper_balancing_keeps_groups_whole(dp):
    default = _balance(_grpo_batch(), dp=dp, use_prefix_grouper=False)
    grouped = _balance(_grpo_batch(), dp=dp, use_prefix_grouper=True)
    for rank in _shards(grouped, dp):
        for uids, _ in rank:
            for uid in set(uids):
                assert uids.count(uid) == N, f"group {uid} split: {uids}"
    split = sum(len(set(u)) for rank in _shards(default, dp) for u, _ in rank)
    kept_default, kept_grouped = _sharing_kept(default, dp), _sharing_kept(grouped, dp)
    print(f"DP={dp}: prompt tokens computed / dense: default balance_batch {kept_default:.3f}, "
          f"use_prefix_grouper=True {kept_grouped:.3f} (ideal {1 / N:.3f})")
    assert kept_grouped == pytest.approx(1 / N)
    assert split > GROUPS and kept_default > kept_grouped  # verl's default splits groups
