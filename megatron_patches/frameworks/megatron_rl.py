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
Pipeline parallelism: the reuse step drives the stages (the executor's schedule); the log-prob
passes broadcast the last stage's log-probs to every stage of `pp_group`, as
compute_logprobs_batch does.
`TrainRLReuse.install(rl_utils, training)` puts both in place (module attributes) and returns
the function that puts the originals back.

Groups: rows come group-major (grpo_group_size consecutive rows per prompt), so the group id of
row i is i // group_size. Exactness never depends on it: the detector only shares what is equal.

Sequence packing (`--rl-use-sequence-packing`): the step's microbatches are bin indices into
the run's `PackingContext` (megatron/rl/sequence_packing_utils.py). The hooks read every bin of
the step with Megatron's own `load_packed_data_by_index`, take its sequences out (each bin is
THD: sequence k occupies [seq_starts[k], seq_starts[k] + seq_lengths[k]) and attends only to
itself), group them by their global sequence index // group_size, wherever the packer put
them, and run them as one reuse step: a group split over several bins of the step is whole
again. The per-token GRPO terms are the same packed or not (calculate_grpo_loss maps each
sequence's advantage onto its tokens; train_rl.loss_func sums masked tokens), so under
--calculate-per-token-loss the step's loss is the sum over sequences either way. The log-prob
passes return the packed layout [bins, bin_size - 1] (bin position p predicts token p + 1 of the
bin), filled at each sequence's positions; positions between sequences and in the padding are 0
(stock: the model's value there; those positions are outside every loss mask).

Refused before any compute (ValueError): inference-log-prob correction,
calculate_per_token_loss=False (train_rl.loss_func's count would make a per-microbatch mean,
which depends on the microbatching), context parallelism, a row without loss tokens
(train_rl.loss_func counts an empty microbatch as one token, so the dense denominator depends on
the microbatching); for the same reason a packed bin without sequences (the DP padding bins) or
whose sequences have no loss token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, NamedTuple, Optional

import torch

from megatron_patches.frameworks.adapter import AdapterConfig, PrefixReuseAdapter
from megatron_patches.frameworks.rollout import RolloutBatch

__all__ = ["TrainRLReuse", "check_train_rl_args", "rollout_from_train_rl", "packed_sequences",
           "PackedSequence"]


def check_train_rl_args(args, model) -> None:
    """ValueError naming the argument to change when the reuse step cannot be exact."""
    models = model if isinstance(model, list) else [model]
    config = models[0].config
    problems = []
    if getattr(args, "rl_inference_logprobs_is_correction", False):
        problems.append("--rl-inference-logprobs-is-correction: drop it")
    if not config.calculate_per_token_loss:
        problems.append("train_rl's loss needs --calculate-per-token-loss with prefix reuse")
    if config.context_parallel_size > 1:
        problems.append("context parallelism: run CP=1")
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


def _bin_index(batch) -> int:
    """A packed microbatch as train_rl's loaders yield it: (bin index tensor,)."""
    return int(batch[0].reshape(-1)[0])


class PackedSequence(NamedTuple):
    """One sequence of a packed bin (train_rl's `--rl-use-sequence-packing`)."""

    bin: int
    """Its bin's index in the PackingContext."""
    start: int
    """Its first token's position in the bin."""
    length: int
    """Its token count."""
    index: int
    """Its global sequence index (group-major: index // group size is its group)."""
    advantage: torch.Tensor
    """Its GRPO advantage."""
    data: tuple
    """The bin as Megatron's `load_packed_data_by_index` returns it ([1, ...] rows)."""


def packed_sequences(context, bins, load_packed_data_by_index) -> List[PackedSequence]:
    """The sequences of packed `bins`, in bin order. ValueError for a bin without sequences or
    without loss tokens (module docstring)."""
    out = []
    for b in bins:
        if not context.packing_info.bin_seq_indices[b]:
            raise ValueError(f"packed bin {b} holds no sequence (a data-parallel padding bin): "
                             "train_rl.loss_func counts it as 1 token; give every rank real bins")
        data = load_packed_data_by_index(b, context, False)
        adv, loss_mask, starts, lengths, indices = data[1], data[3], data[7], data[8], data[9]
        if not loss_mask.sum() > 0:
            raise ValueError(f"packed bin {b} has no loss token: train_rl.loss_func counts it "
                             "as 1 token")
        out += [PackedSequence(bin=b, start=start, length=n, index=index, advantage=adv[k],
                               data=data)
                for k, (start, n, index) in enumerate(zip(starts, lengths, indices))]
    return out


def _packed_rollout(context, bins, load, group_size) -> RolloutBatch:
    """The step's packed bins as a RolloutBatch of their sequences (entry j predicts token j:
    the bin's [*, bin_size - 1] arrays at position start + j - 1)."""
    seqs = packed_sequences(context, bins, load)

    def per_token(field, q):  # the bin's [1, bin_size - 1] array `field`, for sequence q
        row = q.data[field]
        return torch.cat([row.new_zeros(1), row[0, q.start:q.start + q.length - 1]]).float()
    masks = [per_token(_LOSS_MASK, q) for q in seqs]
    if not all(m.sum() > 0 for m in masks):
        raise ValueError("a packed sequence has no loss token: give sequences that all train")
    return RolloutBatch(
        tokens=[_tokens(q) for q in seqs], loss_mask=masks,
        group_ids=[q.index // group_size for q in seqs],
        advantages=[float(q.advantage) for q in seqs],
        old_logprobs=[per_token(_OLD, q) for q in seqs],
        ref_logprobs=[per_token(_REF, q) for q in seqs])


_TOKENS, _OLD, _LOSS_MASK, _REF = 0, 2, 3, 5
"""Fields of load_packed_data_by_index's tuple (train_rl.forward_step unpacks it by position)."""


def _tokens(q: PackedSequence) -> torch.Tensor:
    return q.data[_TOKENS][0, q.start:q.start + q.length]


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
            if getattr(self.args, "rl_use_sequence_packing", False):
                from megatron.rl.rl_utils import get_rl_runtime_state
                from megatron.rl.sequence_packing_utils import load_packed_data_by_index

                rollout = _packed_rollout(get_rl_runtime_state().packing_context,
                                          [_bin_index(r) for r in rows],
                                          load_packed_data_by_index, self.group_size)
            else:
                tokens, adv, old, mask, _pos, ref, _inf = (torch.cat(t) for t in zip(*rows))
                rollout = rollout_from_train_rl(tokens, mask, adv, old, ref,
                                                group_size=self.group_size)
            _count_sequences(len(rollout.tokens))
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
        if is_correction:
            raise ValueError("compute_logprobs_batch with inference-log-prob correction: drop "
                             "--rl-inference-logprobs-is-correction")
        if packing_context is not None:
            out, shape = self._packed_logprobs(model, data_loader, packing_context, dtype)
        else:
            tokens = torch.cat([batch[0] for batch in data_loader])
            shape = (tokens.shape[0], tokens.shape[1] - 1)
            result = self._every_position(model, list(tokens), list(range(shape[0])))
            out = None if result.logprobs is None else torch.stack(
                [lp[1:] for lp in result.logprobs]).to(dtype).cpu()
        return _from_last_stage(out, shape, dtype, pp_group, model)

    def _every_position(self, model, tokens, sequence_ids):
        """One forward-only reuse pass: log-probs at every position of every sequence."""
        masks = [torch.cat([torch.zeros(1), torch.ones(len(t) - 1)]) for t in tokens]
        rollout = RolloutBatch(tokens=tokens, loss_mask=masks,
                               group_ids=[i // self.group_size for i in sequence_ids])
        with torch.no_grad():
            return PrefixReuseAdapter(model, self.config).forward_backward(
                rollout, None, forward_only=True)

    def _packed_logprobs(self, model, data_loader, context, dtype):
        """The packed layout [bins, bin_size - 1] (module docstring)."""
        from megatron.rl.sequence_packing_utils import load_packed_data_by_index

        bins = [_bin_index(batch) for batch in data_loader]
        seqs = packed_sequences(context, bins, load_packed_data_by_index)
        result = self._every_position(model, [_tokens(q) for q in seqs],
                                      [q.index for q in seqs])
        shape = (len(bins), context.packed_trajs.shape[1] - 1)
        if result.logprobs is None:  # not the last pipeline stage
            return None, shape
        out = torch.zeros(shape, dtype=dtype)
        row = {b: r for r, b in enumerate(bins)}
        for q, lp in zip(seqs, result.logprobs):
            out[row[q.bin], q.start:q.start + q.length - 1] = lp[1:].to(dtype).cpu()
        return out, shape

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


def _from_last_stage(out, shape, dtype, pp_group, model):
    """What compute_logprobs_batch does under pipeline parallelism: the last stage's log-probs
    broadcast to every stage of `pp_group` (on the model's device: NCCL needs CUDA tensors)."""
    if pp_group is None or torch.distributed.get_world_size(pp_group) == 1:
        return out
    models = model if isinstance(model, list) else [model]
    device = next(models[0].parameters()).device
    buffer = torch.empty(shape, dtype=dtype, device=device) if out is None else out.to(device)
    last = torch.distributed.get_process_group_ranks(pp_group)[-1]
    torch.distributed.broadcast(buffer, src=last, group=pp_group)
    return buffer.cpu()


def _count_sequences(n: int) -> None:
    """What train_rl.forward_step does per microbatch: the runtime state's sequence count."""
    from megatron.rl.rl_utils import get_rl_runtime_state

    get_rl_runtime_state().increment_sequences(n)
