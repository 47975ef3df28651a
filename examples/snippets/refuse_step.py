# Your own data path refuses on one rank: every rank of the step raises StepRefused together.
import torch

import megatron_patches

megatron_patches.enable_cpu_support()
megatron_patches.install()

from prefix_schedule import Group, GroupBatch, Trajectory, ReuseStep, plan_microbatches
from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_single_process
from megatron_patches.runtime.agreement import refuse_step

initialize_single_process()
model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                    num_attention_heads=4, vocab_size=256))
pp = 1
local = GroupBatch(groups=[Group(prefix=torch.randint(1, 256, (300,)), trajectories=[
    Trajectory(suffix=torch.randint(1, 256, (8,)), loss_mask=torch.ones(8), advantages=1.0)])])
try:
    try:
        plan = plan_microbatches(local, token_budget=256, max_seq_len=256)  # 308 tokens: refused
        step = ReuseStep(local, plan, num_stages=pp)
    except ValueError as error:
        refuse_step(model, error)   # every rank raises StepRefused (peers wait in the executor)
except ValueError as refused:  # StepRefused (a ValueError) naming the ranks; one rank: the error
    print(f"refused on every rank: {refused}")
