# One prefix-reuse training step on a tiny Megatron model (CPU: enable_cpu_support; a no-op on GPU).
import torch

import megatron_patches

megatron_patches.enable_cpu_support()    # first, before anything imports megatron.core
megatron_patches.install()               # hooks into the patched Megatron (nothing else changes)

from megatron.core.pipeline_parallel import get_forward_backward_func
from prefix_schedule import Group, GroupBatch, Trajectory, ReuseStep, plan_microbatches
from prefix_schedule.losses import PolicyLossConfig
from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_single_process
from megatron_patches.rl import make_policy_forward_step
from megatron_patches.training import prepare_for_training, row_multiple_for

initialize_single_process()              # Megatron's parallel state (TP = PP = 1, one process)
model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                    num_attention_heads=4, vocab_size=256))  # your GPTModel
model.config.calculate_per_token_loss = True   # token mean over the global batch (required)
model = prepare_for_training(model, ddp=False)  # its finalize_model_grads_func; DDP: ddp=True
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

prompt_ids = torch.randint(1, 256, (48,))            # one prompt, sampled 4 times
samples = []
for _ in range(4):
    resp = torch.randint(1, 256, (12,))
    mask = torch.ones(12)                            # 1 where predicting resp[j] counts
    samples.append((resp, mask, 0.5, -torch.rand(12) - 0.5, -torch.rand(12) - 0.5))

batch = GroupBatch(groups=[Group(prefix=prompt_ids, trajectories=[
    Trajectory(suffix=resp, loss_mask=mask, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    for resp, mask, adv, old, ref in samples])])
plan = plan_microbatches(batch, token_budget=4096, max_seq_len=model.max_sequence_length,
                         row_multiple=row_multiple_for(model.config))  # TP under sequence parallelism
step = ReuseStep(batch, plan, num_stages=1)   # plan + schedule + prefix K/V cache; PP stages
# virtual stages: ReuseStep(..., num_model_chunks=V) and model=[chunk_0, ..., chunk_V-1]
with megatron_patches.use_prefix_reuse_schedule():
    forward_backward = get_forward_backward_func()
losses = forward_backward(forward_step_func=make_policy_forward_step(PolicyLossConfig(kl_coef=0.01)),
                          data_iterator=step, model=[model], num_microbatches=step.num_microbatches,
                          seq_length=0, micro_batch_size=1)
optimizer.step()
print(f"one reuse step: {step.num_microbatches} microbatches, reports {len(losses)}")
