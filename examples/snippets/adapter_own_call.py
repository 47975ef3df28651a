# A framework that keeps its own forward_backward call: prepare, call Megatron, collect.
import torch

import megatron_patches

megatron_patches.enable_cpu_support()
megatron_patches.install()

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter, RolloutBatch
from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_single_process
from megatron_patches.training import prepare_for_training

initialize_single_process()
model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                    num_attention_heads=4, vocab_size=256))
model.config.calculate_per_token_loss = True
model = [prepare_for_training(model, ddp=False)]   # this rank's model chunks
prompt = torch.randint(1, 256, (40,))
tokens = [torch.cat([prompt, torch.randint(1, 256, (8,))]) for _ in range(4)]
rollout = RolloutBatch(tokens=tokens, group_ids=[0] * 4, advantages=[1.0, -1.0, 0.5, -0.5],
                       loss_mask=[torch.cat([torch.zeros(40), torch.ones(8)]) for _ in tokens])


def loss_fn(b):
    loss_sum = (-b.logprobs * b.advantages * b.loss_mask).sum()
    return loss_sum, b.num_tokens, {"loss": torch.stack([loss_sum.detach(), b.loss_mask.sum()])}


adapter = PrefixReuseAdapter(model, AdapterConfig())
prepared = adapter.prepare(rollout)
with megatron_patches.use_prefix_reuse_schedule():
    forward_backward = get_forward_backward_func()
losses = forward_backward(forward_step_func=prepared.forward_step(loss_fn),
                          data_iterator=prepared.step, model=model,
                          num_microbatches=prepared.num_microbatches,
                          seq_length=0, micro_batch_size=1, forward_only=False)
result = prepared.collect(losses)
print(result.report)
