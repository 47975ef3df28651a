# Flat sequences in, shared prefixes (and prefix trees) found by the planner. No Megatron needed.
import torch

from prefix_schedule import FlatTrajectory, ReuseStep, plan_trajectories
from prefix_schedule.planning.flops import ModelDims

system, question = torch.randint(1, 256, (64,)), torch.randint(1, 256, (32,))
rollouts = []
for _ in range(4):  # one prompt (system + question) sampled 4 times
    seq = torch.cat([system, question, torch.randint(1, 256, (16,))])
    mask = torch.cat([torch.zeros(96), torch.ones(16)])
    rollouts.append((seq, mask, 1.0, -torch.rand(112), None))
pipeline_size = 1

flat = [FlatTrajectory(tokens=seq, loss_mask=mask, advantages=adv,      # per token of seq:
                       old_logprobs=old_lp, ref_logprobs=ref_lp)        # entry j predicts seq[j]
        for seq, mask, adv, old_lp, ref_lp in rollouts]
result = plan_trajectories(flat, dims=ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                                num_attention_heads=4, num_query_groups=2,
                                                vocab_size=256, gated_linear_unit=True),
                            max_seq_len=4096)
print(result.describe())   # groups, tree nodes, tokens saved, dense groups, expected speedup
step = ReuseStep(result.batch, result.plan, num_stages=pipeline_size)   # then as above
