"""The adapter fed data shaped exactly as ROLL hands Megatron (field
names, padding / THD layout, alignment, their normaliser and microbatch factor), reuse == the
framework's own dense step over its own microbatches (stock Megatron, fp32 1e-5). The dense
reference runs each microbatch as right-padded rows where the framework packs THD: with causal
attention and no cross-sequence attention both are the same computation. docs/FRAMEWORKS.md
names the file and function of each framework where the adapter goes. slime, NeMo-RL and AReaL
run through their real code in tests/test_fw_slime.py, tests/test_fw_nemo_rl.py and
tests/test_fw_areal.py (make test-frameworks)."""
import pytest
import torch

from framework_data import (SMALL, assert_grads_equal, grpo_sequences, rollout_arrays,
                            reported_sum, run_both)

pytestmark = pytest.mark.megatron
TREES = dict(min_shared_len=8, node_overhead_tokens=0, min_gain=1.0)


def _model(per_token=False):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = per_token
    return model


def _ppo(b, clip=0.2):
    ratio = torch.exp(b.logprobs - b.old_logprobs)
    pg = -torch.minimum(ratio * b.advantages, ratio.clamp(1 - clip, 1 + clip) * b.advantages)
    kl = torch.exp(b.ref_logprobs - b.logprobs) - (b.ref_logprobs - b.logprobs) - 1
    return pg + 0.05 * kl


def _check(model, rollout, loss_fn, micro_batches):
    from megatron_patches.frameworks import AdapterConfig
    dense, dg, reuse, rg = run_both(model, rollout, loss_fn, micro_batches=micro_batches,
                                    config=AdapterConfig(**TREES))
    assert dense.num_microbatches != reuse.num_microbatches
    assert_grads_equal(dg, rg)
    d, r = reported_sum(dense), reported_sum(reuse)
    assert abs(d - r) <= 1e-5 * abs(d), (d, r)


def _sequences(seed):
    seqs, gen = grpo_sequences(seed)
    masks, adv, old, ref = rollout_arrays(seqs, gen)
    return seqs, masks, adv, old, ref




def test_roll_shape(megatron_env):
    """ROLL (roll/distributed/strategy/megatron_strategy.py::MegatronTrainStrategy.train_step,
    roll/pipeline/rlvr/actor_worker.py::loss_func): DataProto `input_ids` [B, L] (prompts
    left-padded, responses right-padded), `attention_mask`, `response_mask` [B, L] (the loss
    reads response_mask[:, 1:]), `advantages` / `old_log_probs` / `ref_log_probs` [B, L-1]
    aligned with the log-probs of input_ids[:, 1:]; token-mean over batch_num_tokens, times
    loss_scale = num_microbatches x dp."""
    from megatron_patches.frameworks import RolloutBatch
    seqs, masks, adv, old, ref = _sequences(14)
    prompt_max = max(s[1] for s in seqs)
    resp_max = max(s[0].numel() - s[1] for s in seqs)
    B, L = len(seqs), prompt_max + resp_max
    ids, attn, resp = (torch.zeros(B, L, dtype=torch.int64), torch.zeros(B, L), torch.zeros(B, L))
    advantages, old_lp, ref_lp = (torch.zeros(B, L - 1) for _ in range(3))
    for b, (s, m, a, o, r) in enumerate(zip(seqs, masks, adv, old, ref)):
        tok, p = s[0], s[1]
        n = tok.numel()
        start = prompt_max - p  # left padding of the prompt
        ids[b, start:start + n], attn[b, start:start + n] = tok, 1
        resp[b, start:start + n] = m
        advantages[b, start:start + n - 1] = a * m[1:]
        old_lp[b, start:start + n - 1], ref_lp[b, start:start + n - 1] = o[1:], r[1:]

    def token_aligned(x):  # [B, L-1] about input_ids[:, 1:] -> [B, L]
        return torch.cat([torch.zeros(B, 1), x], dim=1)
    rollout = RolloutBatch.from_padded(
        input_ids=ids, attention_mask=attn, loss_mask=resp, group_ids=[s[2] for s in seqs],
        advantages=token_aligned(advantages), old_logprobs=token_aligned(old_lp),
        ref_logprobs=token_aligned(ref_lp))
    batch_num_tokens, dp = int(resp[:, 1:].sum()), 1

    def roll_loss(b):
        loss = (_ppo(b) * b.loss_mask).sum() / batch_num_tokens
        return loss * (b.num_microbatches * dp), {"loss": loss.detach()}
    chunks = [list(c) for c in torch.arange(B).chunk(4)]
    _check(_model(), rollout, roll_loss, [[int(i) for i in c] for c in chunks])
