"""Megatron-LM's own `train_rl.py` with `--prefix-reuse` (docs/FRAMEWORKS.md, Megatron-LM RL).

    torchrun ... examples/megatron_lm/train_rl_prefix_reuse.py --train-rl PATH/train_rl.py \\
        [train_rl.py's arguments] --calculate-per-token-loss --prefix-reuse

Runs PATH/train_rl.py as `__main__` (its own argument parsing, rollouts, loop and logging).
With `--prefix-reuse` (removed before train_rl parses), `megatron_patches.install()` runs and
`megatron.training.pretrain` is wrapped so that, once the arguments are parsed, the TrainRLReuse
hooks go in for train_rl's `forward_step` / `loss_func`: each RL iteration's training step and
its old/ref log-prob passes run with prefix reuse (also with `--rl-use-sequence-packing`), each
step's report printed on rank 0. Arguments the reuse step cannot run exactly are refused
before training. Without `--prefix-reuse` nothing of the step is changed. Without CUDA (a no-op
with it) three CPU shims, for both runs: `initialize_megatron(allow_no_cuda=True)`,
megatron/rl's `device="cuda"` factories on the CPU, `Tensor.cpu()` copying (`_cpu_copies`).
Checked: a whole run on CPU, stock vs reuse, packed and not
(tests/test_megatron_rl_train_rl_run.py; docs/FRAMEWORKS.md, Megatron-LM RL).
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import List, Tuple

__all__ = ["main", "split_argv"]


def split_argv(argv: List[str]) -> Tuple[str, bool, List[str]]:
    """(train_rl.py path, --prefix-reuse given, the arguments left for train_rl)."""
    rest, path, reuse = [], None, False
    it = iter(argv)
    for arg in it:
        if arg == "--prefix-reuse":
            reuse = True
        elif arg == "--train-rl":
            path = next(it, None)
        elif arg.startswith("--train-rl="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if not path:
        raise ValueError("give --train-rl PATH/train_rl.py (Megatron-LM's RL entry point)")
    return path, reuse, rest


def _check_args(args) -> None:
    problems = [flag for flag, bad in (
        ("--rl-inference-logprobs-is-correction (drop it)",
         args.rl_inference_logprobs_is_correction),
        ("--calculate-per-token-loss (give it)", not args.calculate_per_token_loss),
        ("--context-parallel-size 1", args.context_parallel_size > 1)) if bad]
    if problems:
        raise ValueError("train_rl.py --prefix-reuse needs: " + "; ".join(problems))


def _with_prefix_reuse(pretrain):
    def pretrain_with_prefix_reuse(full_config, datasets_provider, model_type, forward_step_func,
                                   *rest, **kwargs):
        from megatron.rl import rl_utils
        from megatron.training import get_args, print_rank_0, training

        from megatron_patches.frameworks.megatron_rl import TrainRLReuse

        args = get_args()
        _check_args(args)
        TrainRLReuse(args=args, train_forward_step=forward_step_func,
                     loss_func=forward_step_func.__globals__["loss_func"],
                     calculate_grpo_loss=rl_utils.calculate_grpo_loss,
                     group_size=args.grpo_group_size,
                     on_report=lambda report: print_rank_0(f"> prefix reuse step: {report}"),
                     ).install(rl_utils, training)
        print("> prefix reuse: train_rl's training step and log-prob passes", flush=True)
        return pretrain(full_config, datasets_provider, model_type, forward_step_func, *rest,
                        **kwargs)
    return pretrain_with_prefix_reuse


def _allow_no_cuda() -> None:
    """Without CUDA: `pretrain` calls `initialize_megatron()`, which asserts CUDA unless given
    `allow_no_cuda=True` (our own entry point passes it; main.py); Megatron-LM RL's modules
    create `device="cuda"` tensors (packing statistics, sequence counts): they see the CPU
    layer's torch (compat.see_cpu_torch). With CUDA: untouched."""
    import torch
    from megatron.training import training

    from megatron_patches.megatron_lm import compat

    if torch.cuda.is_available():
        return
    compat.see_cpu_torch("megatron.rl.rl_utils", "megatron.rl.sequence_packing_utils")
    initialize = training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        return initialize(*args, **{**kwargs, "allow_no_cuda": True})
    training.initialize_megatron = initialize_megatron


def _cpu_copies() -> None:
    """Without CUDA: `Tensor.cpu()` returns a copy, as it does from a GPU. train_rl's loop keeps
    weights with `{k: v.cpu() for k, v in model.state_dict().items()}`: the reference policy
    (train()) and the current weights while the reference log-probs are computed
    (prepare_data_for_update loads the reference, then this dict back). On a CPU tensor `.cpu()`
    is the tensor itself, so both dicts would alias the live weights: the reference would follow
    training and, after the first reference pass, training would go on from the reference."""
    import torch

    stock = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        out = stock(self, *args, **kwargs)
        return out.clone() if out.data_ptr() == self.data_ptr() and out.numel() else out
    torch.Tensor.cpu = cpu


def main(argv: List[str]) -> None:
    from megatron_patches.megatron_lm import compat

    path, reuse, rest = split_argv(argv)
    compat.enable_python311_support()
    if compat.enable_megatron_lm_cpu_support():  # a no-op where CUDA exists
        _allow_no_cuda()
        _cpu_copies()
    if reuse:
        import megatron.training

        import megatron_patches

        megatron_patches.install()  # the reuse schedule and attention hooks (refuses unpatched)
        megatron.training.pretrain = _with_prefix_reuse(megatron.training.pretrain)
    sys.argv = [path, *rest]
    sys.path.insert(0, str(Path(path).resolve().parent))  # train_rl's gpt_builders, ...
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
