"""Megatron-LM RL's GRPO training step, stock vs prefix reuse, over 3 iterations (CPU, 1 rank).

Run by tests/test_megatron_rl_train_rl.py as `python tests/train_rl_replay.py OUT.pt` with an
offline, patched Megatron-LM main checkout first on PYTHONPATH (and this repository second).

What is Megatron-LM's own code here (imported from the checkout, never copied):
* `train_rl.forward_step` and `train_rl.loss_func` (its GRPO step: `rl_utils.get_logprobs`,
  `rl_utils.calculate_grpo_loss`, the per-token `(sum, num_tokens, report)` contract), fed the
  unpacked dataset layout `rl_utils.prepare_data_for_update` builds (trajectories padded to
  seq_length, advantages, old/ref log-probs [B, L-1], `get_ltor_masks_and_position_ids` loss mask
  with the generation mask applied, position ids, zero inference log-probs), cycled through
  Megatron's `RerunDataIterator`;
* the old/ref log-prob passes: `rl_utils.compute_logprobs_batch` with `logprobs_forward_step`.
The prefix-reuse side runs the same step through `PrefixReuseAdapter`: one reuse
`get_forward_backward_func` call whose loss is the same `calculate_grpo_loss` + `loss_func`, and
forward-only Phase A + B for the old/ref log-probs.

Stubs (named, none of them changes the math):
* `_WholeRowThd`: train_rl always hands the model a THD `PackedSeqParams` (Transformer Engine
  reads it); without packing it is ONE sequence spanning the whole row (cu_seqlens [0, L]), the
  same computation as local causal attention, which refuses any PackedSeqParams. The stub checks
  exactly that and drops it; anything else raises. It also drops get_logprobs' `fp32_output=True`
  (HybridModel's argument; this snapshot's GPTModel has none, and the model here is fp32).
* `wandb` (imported by rl_utils for one type annotation only) when it is not installed;
  `hybrid_builders` (imported by train_rl, absent from the 2026-08-22 snapshot; used only for
  hybrid models) when it is absent.
Not run: rollout generation (get_environment_rollouts: CUDA inference engine, agents), Megatron's
`train()` loop and its optimizer; the optimizer here is torch SGD on both sides.
"""
from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from argparse import Namespace
from pathlib import Path

import torch

SEQ_LENGTH, MBS, ITERS, GROUPS, G = 64, 2, 3, 2, 4
GRPO = dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
            grpo_entropy_term_weight=0.01)


def _stub_missing_modules() -> None:
    if importlib.util.find_spec("wandb") is None:
        wandb = types.ModuleType("wandb")
        wandb.wandb_run = types.SimpleNamespace(Run=object)
        sys.modules["wandb"] = wandb
    if importlib.util.find_spec("hybrid_builders") is None:
        hybrid = types.ModuleType("hybrid_builders")

        def hybrid_builder(*_a, **_k):
            raise RuntimeError("hybrid_builders is not in this Megatron-LM snapshot")
        hybrid.hybrid_builder = hybrid_builder
        sys.modules["hybrid_builders"] = hybrid


class _WholeRowThd(torch.nn.Module):
    """The model as train_rl calls it, minus the whole-row THD PackedSeqParams (module doc)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.config

    def forward(self, tokens, position_ids, attention_mask, packed_seq_params=None, **kwargs):
        cu = packed_seq_params.cu_seqlens_q.tolist() if packed_seq_params is not None else None
        if cu != [0, tokens.shape[1]] or tokens.shape[0] != 1:
            raise RuntimeError(f"only one whole-row THD sequence runs without TE, got {cu}")
        if kwargs.pop("fp32_output") is not True:  # GPTModel has no such argument: fp32 only
            raise RuntimeError("only fp32 models run here")
        return self.module(tokens, position_ids, attention_mask, **kwargs)


def _args():
    from megatron.training.global_vars import set_args
    from megatron.core.timers import Timers
    import megatron.training.global_vars as gv

    args = Namespace(rl_use_sequence_packing=False, rl_inference_logprobs_is_correction=False,
                     rl_importance_sampling_truncation_coef=None, fp16=False, bf16=False,
                     check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False,
                     micro_batch_size=1, seq_length=SEQ_LENGTH, **GRPO)
    set_args(args)
    gv._GLOBAL_TIMERS = Timers(0, "minmax")
    return args


def _rollouts(gen):
    """GRPO groups: G responses to one prompt per group (a replayed trace's token ids)."""
    rows, gen_masks, advantages, groups = [], [], [], []
    for g in range(GROUPS):
        prompt = torch.randint(3, 250, (30 + 4 * g,), generator=gen)
        for _ in range(G):
            resp = torch.randint(3, 250, (int(torch.randint(6, 16, (1,), generator=gen)),),
                                 generator=gen)
            row = torch.zeros(SEQ_LENGTH, dtype=torch.long)  # pad id 0
            seq = torch.cat([prompt, resp])
            row[:seq.numel()] = seq
            mask = torch.zeros(SEQ_LENGTH, dtype=torch.bool)
            mask[prompt.numel():seq.numel()] = True
            rows.append(row), gen_masks.append(mask), groups.append(f"group-{g}")
            advantages.append(float(torch.randn(1, generator=gen)))
    return torch.stack(rows), torch.stack(gen_masks), torch.tensor(advantages), groups


def _rollout_batch(trajs, loss_mask, advantages, groups, old=None, ref=None):
    """train_rl's rows as the adapter's RolloutBatch (entry j: predicting token j)."""
    from megatron_patches.frameworks import RolloutBatch

    lengths = [int(m.nonzero().max()) + 1 for m in loss_mask]

    def per_token(lp, i):  # [L-1] about tokens[1:] -> [n] about tokens[j]
        return torch.cat([torch.zeros(1), lp[i, :lengths[i] - 1].float()])
    return RolloutBatch(
        tokens=[trajs[i, :n] for i, n in enumerate(lengths)],
        loss_mask=[loss_mask[i, :n].float() for i, n in enumerate(lengths)],
        group_ids=groups, advantages=[float(a) for a in advantages],
        old_logprobs=None if old is None else [per_token(old, i) for i in range(len(lengths))],
        ref_logprobs=None if ref is None else [per_token(ref, i) for i in range(len(lengths))])


def _grpo_loss_fn(args):
    """train_rl's loss through the adapter: each predicted position one [1]-row of
    calculate_grpo_loss (its per-row advantage broadcast), then train_rl.loss_func."""
    import train_rl
    from megatron.rl.rl_utils import calculate_grpo_loss

    def loss_fn(b):
        col = lambda t: t.reshape(-1, 1)  # noqa: E731
        loss, kl, ratios, ent, above, below = calculate_grpo_loss(
            current_logprobs=col(b.logprobs), old_logprobs=col(b.old_logprobs),
            ref_logprobs=col(b.ref_logprobs), advantages=b.advantages,
            clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
            kl_beta=args.grpo_kl_beta, entropy_weight=args.grpo_entropy_term_weight)
        return train_rl.loss_func(col(b.loss_mask), kl, ratios, ent, above, below, loss)
    return loss_fn


def _logprobs(model, wrapped, trajs, pos, batch, reuse):
    """The old/ref log-prob pass: Megatron's compute_logprobs_batch, or reuse Phase A + B."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.rl.rl_utils import compute_logprobs_batch
    from torch.utils.data import DataLoader, TensorDataset
    from megatron_patches.frameworks import PrefixReuseAdapter
    import megatron_patches

    if not reuse:
        with megatron_patches.use_prefix_reuse_schedule(False):
            fb = get_forward_backward_func()
        with torch.no_grad():
            return compute_logprobs_batch(
                model=wrapped, data_loader=DataLoader(TensorDataset(trajs, pos), batch_size=1),
                forward_backward_func=fb, packing_context=None, trajs_batch_size=len(trajs),
                seq_length=SEQ_LENGTH, logprobs_batch_size=1, decoder_seq_length=None,
                dtype=torch.float32, pp_group=model.pg_collection.pp, is_correction=False)
    out = torch.zeros(len(trajs), SEQ_LENGTH - 1)
    with torch.no_grad():
        result = PrefixReuseAdapter(model).forward_backward(batch, None, forward_only=True)
    for i, lp in enumerate(result.logprobs):  # only loss-mask positions are defined
        out[i, :lp.numel() - 1] = lp[1:]
    return out


def _step(model, wrapped, data, batch, reuse, args):
    import train_rl
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from torch.utils.data import DataLoader, TensorDataset
    from megatron_patches.frameworks import PrefixReuseAdapter
    import megatron_patches

    if reuse:
        result = PrefixReuseAdapter(model).forward_backward(batch, _grpo_loss_fn(args))
        return result.losses_reduced, str(result.report)
    loader = DataLoader(TensorDataset(*data), batch_size=args.micro_batch_size)
    with megatron_patches.use_prefix_reuse_schedule(False):
        fb = get_forward_backward_func()
    losses = fb(forward_step_func=train_rl.forward_step,
                data_iterator=RerunDataIterator(itertools.cycle(loader)), model=[wrapped],
                num_microbatches=len(loader), seq_length=SEQ_LENGTH, micro_batch_size=1,
                forward_only=False)
    return losses, "dense"


def _clone_state(model) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def run(reuse: bool, model, init_state, args) -> dict:
    from megatron.training.utils import get_ltor_masks_and_position_ids
    from megatron_patches.training import zero_grads

    model.load_state_dict(init_state)
    wrapped = _WholeRowThd(model)
    # SGD: the weights follow the gradients linearly. (Adam's first step is about lr x sign(g):
    # a near-zero gradient entry's float-order difference can flip it, so weights compared
    # after Adam measure that amplification, not the step.)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    record = {"report": [], "loss": [], "grad_norm": [], "weights": [], "grads": [], "old": [], "ref": []}
    for it in range(ITERS):
        trajs, gen_masks, advantages, groups = _rollouts(torch.Generator().manual_seed(100 + it))
        _, loss_mask, pos = get_ltor_masks_and_position_ids(
            trajs, 1, 0, False, reset_attention_mask=False, eod_mask_loss=False,
            pad_mask_loss=True, create_attention_mask=False)
        loss_mask[~gen_masks] = 0.0
        batch = _rollout_batch(trajs, loss_mask, advantages, groups)
        old = _logprobs(model, wrapped, trajs, pos, batch, reuse)
        current = _clone_state(model)
        model.load_state_dict(init_state)  # the reference policy: the initial weights
        ref = _logprobs(model, wrapped, trajs, pos, batch, reuse)
        model.load_state_dict(current)
        data = [trajs, advantages, old, loss_mask, pos, ref, torch.zeros_like(old)]
        zero_grads(model)
        losses, report = _step(model, wrapped, data, _rollout_batch(trajs, loss_mask, advantages,
                                                            groups, old, ref), reuse, args)
        total = torch.stack([r["lm loss"] for r in losses]).sum(0)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        record["grad_norm"].append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        record["loss"].append(float(total[0] / total[1]))
        record["report"].append(report)
        mask = loss_mask[:, 1:].bool()
        record["old"].append(old[mask]), record["ref"].append(ref[mask])
        optimizer.step()
        record["weights"].append({k: v.detach().clone() for k, v in model.state_dict().items()
                                  if torch.is_tensor(v) and v.is_floating_point()})
        print(f"{'reuse' if reuse else 'stock'} iteration {it + 1}: loss "
              f"{record['loss'][-1]:.6f} grad norm {record['grad_norm'][-1]:.6f}", flush=True)
    return record


def main(out: str) -> None:
    from megatron_patches.megatron_lm import compat

    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    _stub_missing_modules()
    import megatron_patches
    from megatron_patches.models import TinyLlamaConfig, build_model, initialize_single_process
    from megatron_patches.training import scale_grads_by_token_count
    import megatron.rl.rl_utils  # noqa: F401  (Megatron-LM's RL package imports on this machine)

    sys.path.insert(0, str(Path(megatron.rl.rl_utils.__file__).parents[2]))  # train_rl.py
    args = _args()
    megatron_patches.install()
    initialize_single_process(seed=1234)
    model = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                        num_attention_heads=4, num_query_groups=2,
                                        vocab_size=256, max_seq_len=SEQ_LENGTH))
    model.config.calculate_per_token_loss = True  # train_rl's example configs
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    init_state = _clone_state(model)
    torch.save({"stock": run(False, model, init_state, args),
                "reuse": run(True, model, init_state, args)}, out)


if __name__ == "__main__":
    main(sys.argv[1])
