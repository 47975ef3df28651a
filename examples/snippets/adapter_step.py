# The framework adapter: a framework's batch and loss in, one prefix-reuse step out (CPU here).
import torch

import megatron_patches

megatron_patches.enable_cpu_support()    # first, before anything imports megatron.core
megatron_patches.install()

from megatron_patches.frameworks import AdapterConfig, PrefixReuseAdapter, RolloutBatch
from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_single_process
from megatron_patches.training import prepare_for_training

initialize_single_process()
model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                    num_attention_heads=4, vocab_size=256))  # your GPTModel
model.config.calculate_per_token_loss = True    # the (loss_sum, num_tokens, report) contract
model = prepare_for_training(model, ddp=False)  # sets finalize_model_grads_func (DDP: ddp=True)

prompt = torch.randint(1, 256, (40,))
tokens = [torch.cat([prompt, torch.randint(1, 256, (8,))]) for _ in range(4)]  # G = 4 samples
masks = [torch.cat([torch.zeros(40), torch.ones(8)]) for _ in tokens]
rollout = RolloutBatch(
    tokens=tokens,         # per sequence: token ids, prompt + response (every turn), unpadded
    loss_mask=masks,       # per sequence, per token: 1 where PREDICTING tokens[j] counts (entry 0 is 0)
    group_ids=[0] * 4,     # per sequence: verl's uid, slime's group_index, Megatron-LM RL's group
    advantages=[1.0, -1.0, 0.5, -0.5],   # per sequence: a float or one per token (None: zeros)
    old_logprobs=[-torch.rand(48) for _ in tokens], ref_logprobs=None,  # per token, or None
    fields={"rollout_is_weights": [torch.ones(48) for _ in tokens]},  # further per-token arrays
)
# or RolloutBatch.from_padded(input_ids=[B, L], attention_mask=[B, L], loss_mask=[B, L], ...)
# or RolloutBatch.from_packed(tokens=[T], cu_seqlens=[N+1], loss_mask=[T], ...)   (THD)


def loss_fn(b):  # the framework's loss for one microbatch (a TokenBatch): per-token contract
    ratio = torch.exp(b.logprobs - b.old_logprobs)
    loss_sum = (-ratio * b.advantages * b.fields["rollout_is_weights"] * b.loss_mask).sum()
    return loss_sum, b.num_tokens, {"loss": torch.stack([loss_sum.detach(), b.loss_mask.sum()])}


adapter = PrefixReuseAdapter(model, AdapterConfig())
result = adapter.forward_backward(rollout, loss_fn)                       # training step
logp = adapter.forward_backward(rollout, None, forward_only=True).logprobs  # old/ref log-probs
print(result.report)
