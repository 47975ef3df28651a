"""Megatron-LM RL (`train_rl.py`, `megatron/rl/`) on the prefix-reuse adapter.

Two hooks at the points where Megatron-LM's RL loop calls Megatron (docs/FRAMEWORKS.md):

* the training step: `train_step` calls `forward_backward_func(forward_step_func=
  train_rl.forward_step, data_iterator=..., num_microbatches=...)`.
  `TrainRLReuse.forward_backward_func(stock)` returns a function with the same signature that,
  for train_rl's `forward_step` (and not forward-only), reads the step's microbatches from the
  iterator (the unpacked rows `rl_utils.prepare_data_for_update` builds: tokens, advantages,
  old log-probs, loss mask, position ids, ref log-probs, inference log-probs), and runs them as
  ONE prefix-reuse step whose loss is train_rl's own: `rl_utils.calculate_grpo_loss` +
  `train_rl.loss_func` (the per-token `(sum, num_tokens, report)` contract). Every other call goes
  to `stock` unchanged.
* the log-prob passes: `TrainRLReuse.compute_logprobs_batch` has the signature of
  `rl_utils.compute_logprobs_batch` and computes the old/ref log-probs of all rows with one
  forward-only reuse pass (Phase A + B), every position of every row, as Megatron does.
`TrainRLReuse.install(rl_utils, training)` puts both in place (module attributes) and returns
the function that puts the originals back.

Groups: rows come group-major (grpo_group_size consecutive rows per prompt), so the group id of
row i is i // group_size. Exactness never depends on it: the detector only shares what is equal.

Refused before any compute (ValueError): sequence packing (bins are THD rows: not wired),
inference-log-prob correction, calculate_per_token_loss=False (train_rl.loss_func's count would
make a per-microbatch mean, which depends on the microbatching), pipeline or context
parallelism, a row without loss tokens (train_rl.loss_func counts an empty microbatch as one
token, so the dense denominator depends on the microbatching).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.rollout import RolloutBatch

__all__ = ["TrainRLReuse", "check_train_rl_args", "rollout_from_train_rl"]


def check_train_rl_args(args, model) -> None:
    """ValueError naming the argument to change when the reuse step cannot be exact."""
    models = model if isinstance(model, list) else [model]
    config = models[0].config
    problems = []
    if getattr(args, "rl_use_sequence_packing", False):
        problems.append("--rl-use-sequence-packing (packed THD bins are not wired to the "
                        "adapter yet): drop it")
    if getattr(args, "rl_inference_logprobs_is_correction", False):
        problems.append("--rl-inference-logprobs-is-correction: drop it")
    if not config.calculate_per_token_loss:
        problems.append("train_rl's loss needs --calculate-per-token-loss with prefix reuse")
    if config.pipeline_model_parallel_size > 1 or config.context_parallel_size > 1:
        problems.append("pipeline / context parallelism: run PP=1, CP=1")
    if problems:
        raise ValueError("Megatron-LM RL with prefix reuse: " + "; ".join(problems))


def rollout_from_train_rl(tokens, loss_mask, advantages, old_logprobs, ref_logprobs, *,
                          group_size: int) -> RolloutBatch:
    """train_rl's unpacked rows as a RolloutBatch. Rows are cut after their last loss token
    (causal attention: nothing after it changes the loss); [B, L-1] log-probs about tokens[1:]
    become entry j = predicting tokens[j]."""
    masks = loss_mask.float()
    if not (masks[:, 1:].sum(1) > 0).all():
        raise ValueError("a row has no loss token (a PAD row?): train_rl.loss_func counts an "
                         "empty microbatch as 1 token; give rows that all train")
    lengths = [int(m.nonzero().max()) + 1 for m in masks]

    def per_token(lp, i):
        return torch.cat([lp.new_zeros(1), lp[i, :lengths[i] - 1]]).float()
    return RolloutBatch(
        tokens=[tokens[i, :n] for i, n in enumerate(lengths)],
        loss_mask=[masks[i, :n] for i, n in enumerate(lengths)],
        group_ids=[i // group_size for i in range(len(lengths))],
        advantages=[float(a) for a in advantages.reshape(-1)],
        old_logprobs=_per_row(per_token, old_logprobs, len(lengths)),
        ref_logprobs=_per_row(per_token, ref_logprobs, len(lengths)))


def _per_row(convert, logprobs, num_rows):
    return None if logprobs is None else [convert(logprobs, i) for i in range(num_rows)]


@dataclass(kw_only=True)
class TrainRLReuse:
    """The hooks of one Megatron-LM RL run (module docstring)."""

    args: object
    """Megatron-LM's parsed arguments (grpo_* loss coefficients, packing flags)."""
    train_forward_step: Callable
    """train_rl.forward_step: the calls that run as a reuse step."""
    loss_func: Callable
    """train_rl.loss_func."""
    calculate_grpo_loss: Callable
    """rl_utils.calculate_grpo_loss."""
    group_size: int
    """--grpo-group-size (rows per prompt, consecutive)."""
    config: AdapterConfig = field(default_factory=AdapterConfig)
    """How the adapter detects and plans."""
    reports: List[str] = field(default_factory=list)
    """Per reuse training step, the adapter's report (what was shared)."""
    on_report: Optional[Callable[[str], None]] = None
    """Called with each training step's report (the launcher prints it on rank 0)."""

    def loss_fn(self, b):
        """train_rl's GRPO loss on a TokenBatch: each predicted position one [1]-row."""
        a = self.args
        col = lambda t: t.reshape(-1, 1)  # noqa: E731
        loss, kl, ratios, ent, above, below = self.calculate_grpo_loss(
            current_logprobs=col(b.logprobs), old_logprobs=col(b.old_logprobs),
            ref_logprobs=col(b.ref_logprobs), advantages=b.advantages,
            clamp_eps_lower=a.grpo_clamp_eps_lower, clamp_eps_upper=a.grpo_clamp_eps_upper,
            kl_beta=a.grpo_kl_beta, entropy_weight=a.grpo_entropy_term_weight)
        if float(b.num_tokens) == 0:  # assert: a reuse unit predicts no loss token
            raise AssertionError("a reuse microbatch without loss tokens reached train_rl's loss")
        return self.loss_func(col(b.loss_mask), kl, ratios, ent, above, below, loss)

    def forward_backward_func(self, stock: Callable) -> Callable:
        """`stock` with train_rl's training step replaced by one reuse step."""
        def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches,
                             forward_only=False, **kwargs):
            if forward_only or forward_step_func is not self.train_forward_step:
                return stock(forward_step_func=forward_step_func, data_iterator=data_iterator,
                             model=model, num_microbatches=num_microbatches,
                             forward_only=forward_only, **kwargs)
            check_train_rl_args(self.args, model)
            rows = [next(data_iterator) for _ in range(num_microbatches)]
            tokens, adv, old, mask, _pos, ref, _inf = (torch.cat(t) for t in zip(*rows))
            rollout = rollout_from_train_rl(tokens, mask, adv, old, ref,
                                            group_size=self.group_size)
            _count_sequences(tokens.shape[0])
            result = PrefixReuseAdapter(model, self.config).forward_backward(rollout, self.loss_fn)
            self.reports.append(str(result.report))
            if self.on_report is not None:
                self.on_report(self.reports[-1])
            return result.losses_reduced
        return forward_backward

    def compute_logprobs_batch(self, model, data_loader, forward_backward_func, packing_context,
                               trajs_batch_size, seq_length, logprobs_batch_size,
                               decoder_seq_length, dtype, pp_group, is_correction,
                               collect_non_loss_data=False):
        """rl_utils.compute_logprobs_batch as one forward-only reuse pass (all positions)."""
        check_train_rl_args(self.args, model)
        if packing_context is not None or is_correction:
            raise ValueError("compute_logprobs_batch with a packing context or inference-log-prob "
                             "correction: drop --rl-use-sequence-packing / "
                             "--rl-inference-logprobs-is-correction")
        tokens = torch.cat([batch[0] for batch in data_loader])
        n, length = tokens.shape
        every_position = torch.cat([torch.zeros(1), torch.ones(length - 1)])
        rollout = RolloutBatch(tokens=list(tokens), loss_mask=[every_position] * n,
                               group_ids=[i // self.group_size for i in range(n)])
        with torch.no_grad():
            result = PrefixReuseAdapter(model, self.config).forward_backward(
                rollout, None, forward_only=True)
        return torch.stack([lp[1:] for lp in result.logprobs]).to(dtype).cpu()

    def install(self, rl_utils, training) -> Callable[[], None]:
        """Hook `training.get_forward_backward_func` and `rl_utils.compute_logprobs_batch`;
        returns the function that restores them."""
        stock_get = training.get_forward_backward_func
        stock_logprobs = rl_utils.compute_logprobs_batch

        def get_forward_backward_func(*args, **kwargs):
            return self.forward_backward_func(stock_get(*args, **kwargs))
        training.get_forward_backward_func = get_forward_backward_func
        rl_utils.compute_logprobs_batch = self.compute_logprobs_batch

        def uninstall() -> None:
            training.get_forward_backward_func = stock_get
            rl_utils.compute_logprobs_batch = stock_logprobs
        return uninstall


def _count_sequences(n: int) -> None:
    """What train_rl.forward_step does per microbatch: the runtime state's sequence count."""
    from megatron.rl.rl_utils import get_rl_runtime_state

    get_rl_runtime_state().increment_sequences(n)
