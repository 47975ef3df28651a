"""The RL forward step shared by dense and prefix-reuse training (Megatron's forward_step contract).

`make_policy_forward_step(loss_config)` returns a `forward_step_func(data_iterator, model)` that
takes one item (a dense row, a suffix row or a prefix row), runs the model and returns the policy
loss as Megatron's 3-tuple `(loss_sum, num_tokens, report)`; with
`calculate_per_token_loss=True` Megatron divides the gradients by the token count summed over
microbatches and data-parallel ranks, so the update is a token mean over the global batch that does
not depend on how groups are packed or placed.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict

import torch

from prefix_schedule.losses import PolicyLossConfig, entropy_from_logits, policy_loss_sum

from megatron.core import parallel_state, tensor_parallel

__all__ = ["make_policy_forward_step", "token_logprobs", "token_entropy"]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position, vocab-parallel aware (logits [b, s, V/tp], fp32 math).

    Megatron's vocab_parallel_cross_entropy works IN PLACE on its input (it subtracts the max,
    exponentiates and normalises it into the softmax it keeps for backward). `logits.float()` is
    the same tensor when the logits are already fp32, so it gets an fp32 COPY: the caller's
    logits stay logits (token_entropy reads them afterwards).
    """
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True),
                                                         labels)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, vocab-parallel aware (logits [b, s, V/tp], fp32).

    With TP > 1: H = log(sum e^z) - sum(e^z * z) / sum(e^z), z = logits - max over the whole
    vocabulary; the max (no gradient) and both sums are all-reduced over the TP group. The sums'
    all-reduce has an identity backward (Megatron's reduce_from_tensor_model_parallel_region),
    which is exact here: every TP rank computes the same H from the same sums, and d(sum)/d(own
    part) = 1 -- the same argument as vocab_parallel_cross_entropy.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return entropy_from_logits(logits)
    group = parallel_state.get_tensor_model_parallel_group()
    z = logits.float()
    z_max = z.detach().amax(dim=-1, keepdim=True)
    torch.distributed.all_reduce(z_max, op=torch.distributed.ReduceOp.MAX, group=group)
    z = z - z_max
    exp_z = z.exp()
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(exp_z.sum(-1), group=group)
    sum_exp_z = tensor_parallel.reduce_from_tensor_model_parallel_region((exp_z * z).sum(-1),
                                                                         group=group)
    return sum_exp.log() - sum_exp_z / sum_exp


def _policy_loss(item: Dict[str, torch.Tensor], config: PolicyLossConfig, logits: torch.Tensor):
    if "loss_index" in item:  # a prefix-tree node's rows: one entry per (trajectory, token)
        logits = logits[:, item["loss_index"][0]]
    logprobs = token_logprobs(logits, item["labels"])
    entropy = token_entropy(logits) if config.entropy_coef else None
    loss_sum, num_tokens, metrics = policy_loss_sum(
        logprobs,
        loss_mask=item["loss_mask"],
        advantages=item["advantages"],
        old_logprobs=item.get("old_logprobs"),
        ref_logprobs=item.get("ref_logprobs"),
        entropy=entropy,
        config=config,
    )
    report = {"loss": torch.stack([loss_sum.detach().float(), num_tokens.float()])}
    for name, value in metrics.items():
        report[name] = torch.stack([torch.as_tensor(value).detach().float(), num_tokens.float()])
    return loss_sum, num_tokens, report


def make_policy_forward_step(loss_config: PolicyLossConfig) -> Callable:
    """A Megatron `forward_step_func` for GRPO/PPO on items from prefix_schedule builders.

    It carries `check_batch(batch)`, which the reuse executor (and training.dense_step) call
    before any compute: a loss that needs data the batch lacks is refused there, not mid-step.
    """

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        # items are host tensors; like Megatron's get_batch, move them to the model's device
        device = next(model.parameters()).device
        item = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in item.items()}
        extra = {"padding_mask": item["padding_mask"]} if "padding_mask" in item else {}
        output = model(item["tokens"], item["position_ids"], None, **extra)
        if item.get("kind") == "prefix" and "loss_index" not in item:
            # Phase A: no loss; the executor ignores loss_func
            return output, None
        return output, partial(_policy_loss, item, loss_config)

    def check_batch(batch) -> None:
        if loss_config.kl_coef > 0 and not batch.has_ref_logprobs:
            raise ValueError(f"kl_coef={loss_config.kl_coef} needs ref_logprobs, but the batch's "
                             "trajectories have none; give every Trajectory ref_logprobs (the "
                             "reference policy's log-probs) or set kl_coef=0")

    forward_step.check_batch = check_batch
    return forward_step
