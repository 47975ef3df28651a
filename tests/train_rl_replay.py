"""Megatron-LM RL's GRPO training step, stock vs prefix reuse, over 3 iterations (CPU, 1 rank).

Run by tests/test_megatron_rl_train_rl.py as `python tests/train_rl_replay.py OUT.pt` with an
offline, patched Megatron-LM main checkout first on PYTHONPATH (and this repository second).

Both runs execute the same code, Megatron-LM's own (imported from the checkout, never copied):
per iteration (`args.curr_iteration`), `rl_utils.get_grpo_data_iterator` as `train()` calls it,
whose collection (`get_environment_rollouts`) replays a trace, and its
`prepare_data_for_update` on GRPO groups shaped as its agents return
them (`RolloutGroup`s of `TokenRollout`s: prompt + generated tokens ending in eod, generation
mask, inference log-probs, reward): its group stats and GRPO advantages, `prepare_trajectories`,
loss masks, the microbatch calculator, the old and ref log-prob passes (`compute_logprobs_batch`,
ref = the initial weights loaded as its `ref_state_dict`), the inference log-prob alignment and
its `RerunDataIterator`; then the training step as `train_step` calls it
(`training.get_forward_backward_func()(forward_step_func=train_rl.forward_step, ...,
num_microbatches=get_num_microbatches())`) and an SGD step. The reuse run differs only by
`TrainRLReuse.install(rl_utils, training)` (megatron_patches/frameworks/megatron_rl.py): one
reuse step with train_rl's own `calculate_grpo_loss` + `loss_func`, one forward-only reuse pass
per log-prob computation.

Stubs (named, none of them changes the math; the first and last are the launcher's CPU mode's,
megatron_patches/megatron_lm/rl_cpu.py):
* `cpu_thd_forward` (GPTModel.forward): train_rl always hands the model a THD
  `PackedSeqParams`, which Transformer Engine's attention reads and the local (CPU) attention
  refuses. The stand-in has TE's THD semantics without TE: the row [1, T] is cut at
  `cu_seqlens_q` (repeated entries are TE's zero-length ghost sequences) and each sequence runs
  through the stock forward alone, outputs concatenated: causal attention within the sequence
  only, RoPE positions from 0 at each sequence start (TE applies RoPE per cu_seqlens sequence),
  every other layer per token. Without packing that is ONE sequence spanning the whole row;
  with `--rl-use-sequence-packing` a bin's sequences and its padding tail. Anything else
  (padded cu_seqlens, batch > 1, a sequence whose cu_seqlens_kv differ) raises. It also drops
  get_logprobs' `fp32_output=True` (HybridModel's argument; this snapshot's GPTModel has none,
  and the model here is fp32).
* `_replayed_collection` (rl_utils.get_environment_rollouts): one trace entry of GRPO groups per
  collection; the real one runs Megatron's CUDA inference engine behind the agents.
* `_ReplayTokenizer`: the pad/eod/bos ids and log strings prepare_data_for_update asks its
  tokenizer for (the rollouts are token ids: nothing is tokenized).
* `wandb` (imported by rl_utils for one type annotation only) when it is not installed;
  `hybrid_builders` (imported by train_rl, absent from the 2026-08-22 snapshot; used only for
  hybrid models) when it is absent.
Not run here: rollout generation (get_environment_rollouts: CUDA inference engine behind the
agents; the groups here are synthesized in the agents' types), Megatron's `train()` loop and its
optimizer (torch SGD here): tests/test_megatron_rl_train_rl_run.py runs those (a whole
train_rl.py run, rollouts through its agent registry).
"""
from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import torch

from megatron_patches.megatron_lm.rl_cpu import cpu_thd_forward, stub_missing_modules

SEQ_LENGTH, MBS, ITERS, GROUPS, G = 64, 2, 3, 2, 4
GRPO = dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
            grpo_entropy_term_weight=0.01)


def _args():
    from megatron.training.global_vars import set_args
    from megatron.core.timers import Timers
    import megatron.training.global_vars as gv

    args = Namespace(rl_use_sequence_packing=False, rl_inference_logprobs_is_correction=False,
                     rl_importance_sampling_truncation_coef=None, fp16=False, bf16=False,
                     check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False,
                     micro_batch_size=1, seq_length=SEQ_LENGTH, decoder_seq_length=None,
                     global_batch_size=GROUPS * G, grpo_prompts_per_step=GROUPS,
                     grpo_group_size=G, cuda_graph_impl="none", rl_training_cuda_graphs=False,
                     rl_skip_bos_token=False, reset_position_ids=False,
                     decrease_batch_size_if_needed=False, **GRPO)
    set_args(args)
    gv._GLOBAL_TIMERS = Timers(0, "minmax")
    gv._GLOBAL_TOKENIZER = _ReplayTokenizer()
    return args


class _ReplayTokenizer:
    """The tokenizer prepare_data_for_update asks for pad/eod/bos ids and log strings (the
    replayed rollouts are token ids already: nothing is tokenized)."""

    library, vocab_size, pad, eod, bos = "replay", 256, 0, 1, None

    def detokenize(self, ids):
        return " ".join(str(int(i)) for i in ids)


def _rollouts(gen):
    """GRPO groups as Megatron-LM's agents return them: RolloutGroup of G TokenRollouts (prompt +
    generated tokens ending in eod, generation mask, inference log-probs, reward) per prompt."""
    from megatron.rl.types.rollout import RolloutGroup, TokenRollout

    groups = []
    for g in range(GROUPS):
        prompt = torch.randint(3, 250, (30 + 4 * g,), generator=gen).tolist()
        members = []
        for _ in range(G):
            n = int(torch.randint(6, 16, (1,), generator=gen))
            resp = torch.randint(3, 250, (n - 1,), generator=gen).tolist() + [_ReplayTokenizer.eod]
            members.append(TokenRollout(
                trajectory=[prompt + resp], reward=float(torch.rand(1, generator=gen)),
                generation_mask=[[False] * len(prompt) + [True] * n],
                logprobs=[(-torch.rand(n, generator=gen)).tolist()], env_id="replay"))
        groups.append(RolloutGroup(rollouts=members, uid=f"prompt-{g}"))
    return groups


def _replayed_collection(record):
    """get_environment_rollouts replaying a trace of one RolloutGroup list per collection (the
    real one drives Megatron's CUDA inference engine behind the agents)."""
    def collect(model, inference_model, optimizer, n_prompts, samples_per_group):
        if (n_prompts, samples_per_group) != (GROUPS, G):
            raise RuntimeError(f"asked for {n_prompts} x {samples_per_group} rollouts")
        seed = 100 + record["collections"]
        record["collections"] += 1
        return _rollouts(torch.Generator().manual_seed(seed)), {}
    return collect


def _step(model, iterator, args):
    """The training step's call as train_step makes it (hooked or not)."""
    import train_rl
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import training

    return training.get_forward_backward_func()(
        forward_step_func=train_rl.forward_step, data_iterator=iterator, model=[model],
        num_microbatches=get_num_microbatches(), seq_length=SEQ_LENGTH,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=None, forward_only=False)


def _hooks(args):
    import train_rl
    from megatron.rl import rl_utils
    from megatron_patches.frameworks.megatron_rl import TrainRLReuse

    return TrainRLReuse(args=args, train_forward_step=train_rl.forward_step,
                        loss_func=train_rl.loss_func,
                        calculate_grpo_loss=rl_utils.calculate_grpo_loss, group_size=G)


def _clone_state(model) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def run(reuse: bool, model, init_state, args) -> dict:
    from megatron_patches.training import zero_grads
    from megatron.rl import rl_utils
    from megatron.training import training

    model.load_state_dict(init_state)
    hooks = _hooks(args)
    uninstall = hooks.install(rl_utils, training) if reuse else (lambda: None)
    # SGD: the weights follow the gradients linearly. (Adam's first step is about lr x sign(g):
    # a near-zero gradient entry's float-order difference can flip it, so weights compared
    # after Adam measure that amplification, not the step.)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    record = {"report": [], "loss": [], "grad_norm": [], "weights": [], "grads": [], "old": [], "ref": [],
              "collections": 0}
    passes = []  # (old, ref) log-probs of each iteration, as the step receives them
    compute = rl_utils.compute_logprobs_batch

    def recording(*a, **k):
        passes.append(compute(*a, **k))
        return passes[-1]
    rl_utils.compute_logprobs_batch = recording
    collect = rl_utils.get_environment_rollouts
    rl_utils.get_environment_rollouts = _replayed_collection(record)
    iterator = None
    for it in range(ITERS):
        args.curr_iteration = it
        with torch.no_grad():  # as train() calls it
            iterator = rl_utils.get_grpo_data_iterator(
                [model], None, None, it, init_state,  # reference policy: the initial weights
                grpo_iterations=1, grpo_prompts_per_step=GROUPS, grpo_group_size=G,
                global_batch_size=GROUPS * G, sequence_packing=False, buffered_rollouts=iterator,
                is_correction=False, optimizer_is_on_cpu=False)
        zero_grads(model)
        losses = _step(model, iterator, args)
        total = torch.stack([r["lm loss"] for r in losses]).sum(0)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        record["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        record["grad_norm"].append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        record["loss"].append(float(total[0] / total[1]))
        record["report"].append(hooks.reports[-1] if reuse else "dense")
        record["old"].append(passes[-2]), record["ref"].append(passes[-1])
        optimizer.step()
        record["weights"].append({k: v.detach().clone() for k, v in model.state_dict().items()
                                  if torch.is_tensor(v) and v.is_floating_point()})
        print(f"{'reuse' if reuse else 'stock'} iteration {it + 1}: loss "
              f"{record['loss'][-1]:.6f} grad norm {record['grad_norm'][-1]:.6f}", flush=True)
    rl_utils.compute_logprobs_batch = compute
    rl_utils.get_environment_rollouts = collect
    uninstall()
    return record


def main(out: str) -> None:
    from megatron_patches.megatron_lm import compat

    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    stub_missing_modules()
    import megatron_patches
    from megatron_patches.models import TinyLlamaConfig, build_model, initialize_single_process
    from megatron_patches.training import scale_grads_by_token_count
    import megatron.rl.rl_utils  # noqa: F401  (Megatron-LM's RL package imports on this machine)

    from megatron.core.models.gpt import GPTModel

    sys.path.insert(0, str(Path(megatron.rl.rl_utils.__file__).parents[2]))  # train_rl.py
    GPTModel.forward = cpu_thd_forward(GPTModel.forward)
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
