"""Megatron-LM's own `train_rl.py` with `--prefix-reuse` (docs/FRAMEWORKS.md, Megatron-LM RL).

    torchrun ... examples/megatron_lm/train_rl_prefix_reuse.py --train-rl PATH/train_rl.py \\
        [train_rl.py's arguments] --calculate-per-token-loss --prefix-reuse \\
        [--replay-trace TRACE.json]

Runs PATH/train_rl.py as `__main__` (its own argument parsing, rollouts, loop and logging).
With `--prefix-reuse` (removed before train_rl parses), `megatron_patches.install()` runs and
`megatron.training.pretrain` is wrapped so that, once the arguments are parsed, the TrainRLReuse
hooks go in for train_rl's `forward_step` / `loss_func`: each RL iteration's training step and
its old/ref log-prob passes run with prefix reuse (also with `--rl-use-sequence-packing`), each
step's report printed on rank 0. Arguments the reuse step cannot run exactly are refused
before training. Without `--prefix-reuse` nothing of the step is changed.

`--replay-trace TRACE.json` (removed before train_rl parses; format:
megatron_patches/megatron_lm/rl_replay.py, `tools/train_rl_trace.py synth` writes one):
the rollouts come from the trace through train_rl's agent registry (`--langrl-env-config` is
written for it) instead of being generated.

CPU mode, detected (no CUDA; a no-op with it): the stand-ins of
megatron_patches/megatron_lm/rl_cpu.py, each announced on the console (`> CPU mode:`):
CUDA-only arguments turned off as train_grpo.py does, `allow_no_cuda`, an engine-less inference
interface, `NullTokenizer.bos_id`, a THD attention stand-in, `wandb` / `hybrid_builders` when
absent. Without CUDA nothing can generate: `--replay-trace` is required.
Checked: a whole run on CPU, stock vs reuse, packed and not
(tests/test_megatron_rl_train_rl_run.py); the documented CPU command as written
(tests/test_megatron_rl_train_rl_cli.py).
"""
from __future__ import annotations

import os
import runpy
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

__all__ = ["main", "split_argv", "RefusedArguments"]


class RefusedArguments(ValueError):
    """Arguments refused before training (one line on the console, exit status 2)."""


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
        raise RefusedArguments("give --train-rl PATH/train_rl.py (Megatron-LM's RL entry point)")
    return path, reuse, rest


def _check_args(args) -> None:
    problems = [flag for flag, bad in (
        ("--rl-inference-logprobs-is-correction (drop it)",
         args.rl_inference_logprobs_is_correction),
        ("--calculate-per-token-loss (give it)", not args.calculate_per_token_loss),
        ("--context-parallel-size 1", args.context_parallel_size > 1)) if bad]
    if problems:
        raise RefusedArguments("train_rl.py --prefix-reuse needs: " + "; ".join(problems))


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


def _take_replay_trace(rest: List[str]) -> Tuple[Optional[str], List[str]]:
    """(--replay-trace's path or None, the arguments without it)."""
    out, trace = [], None
    it = iter(rest)
    for arg in it:
        if arg == "--replay-trace":
            trace = next(it, None)
            if not trace:
                raise RefusedArguments("--replay-trace needs a path (a trace file: "
                                       "python tools/train_rl_trace.py synth --help)")
        elif arg.startswith("--replay-trace="):
            trace = arg.split("=", 1)[1]
        else:
            out.append(arg)
    return trace, out


def _replay(trace: Optional[str], rest: List[str], on_cpu: bool) -> List[str]:
    """train_rl's arguments with the replay agent's `--langrl-env-config` when a trace is
    given; refuses a CPU run that would have to generate."""
    from megatron_patches.megatron_lm import rl_replay as replay

    has_config = any(a == "--langrl-env-config" or a.startswith("--langrl-env-config=")
                     for a in rest)
    if trace and has_config:
        raise RefusedArguments("give --replay-trace or --langrl-env-config, not both "
                               "(--replay-trace writes the env config naming its agent)")
    if on_cpu and not trace and not has_config:
        raise RefusedArguments("no CUDA: Megatron's inference engine cannot generate rollouts "
                               "here; replay them from a trace: --replay-trace TRACE.json "
                               "(python tools/train_rl_trace.py synth writes one)")
    replay.register_replay_agent()
    if not trace:
        return rest
    try:
        groups = replay.check_trace(trace)
    except ValueError as error:
        raise RefusedArguments(str(error)) from None
    config = replay.write_env_config(trace, tempfile.mkdtemp(prefix="train-rl-replay-"))
    if os.environ.get("RANK", "0") == "0":
        print(f"> rollouts replayed from {trace} ({groups} groups; env config {config})",
              flush=True)
    return [*rest, "--langrl-env-config", config]


def main(argv: List[str]) -> None:
    from megatron_patches.megatron_lm import compat

    path, reuse, rest = split_argv(argv)
    trace, rest = _take_replay_trace(rest)
    compat.enable_python311_support()
    sys.path.insert(0, str(Path(path).resolve().parent))  # train_rl's gpt_builders, ...
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_patches.megatron_lm.rl_cpu import enable_cpu_mode

        if os.environ.get("RANK", "0") == "0":
            print("> CPU mode (no CUDA): the stand-ins of megatron_patches/megatron_lm/rl_cpu.py",
                  flush=True)
        enable_cpu_mode()
    rest = _replay(trace, rest, on_cpu)
    if reuse:
        import megatron.training

        import megatron_patches

        megatron_patches.install()  # the reuse schedule and attention hooks (refuses unpatched)
        megatron.training.pretrain = _with_prefix_reuse(megatron.training.pretrain)
    sys.argv = [path, *rest]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except RefusedArguments as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_rl_prefix_reuse.py: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2)
