"""A whole Megatron-LM `train_rl.py` run on CPU, stock or `--prefix-reuse`, rollouts replayed.

    python -m torch.distributed.run --nproc-per-node 1 tests/train_rl_run.py \\
        --train-rl TREE/train_rl.py [train_rl's arguments] [--prefix-reuse]
    python tests/train_rl_run.py --save-weights CHECKPOINT_DIR OUT.pt

with a patched Megatron-LM main checkout first on PYTHONPATH and this repository second (run by
tests/test_megatron_rl_train_rl_run.py). It runs examples/megatron_lm/train_rl_prefix_reuse.py's
`main` with the arguments, as a user runs the launcher: train_rl.py as `__main__` (its argument
parsing, `pretrain` -> `train()` loop, optimizer, `training_log`, `save_checkpoint`), its rollout
collection through its own extension points: `--langrl-env-config` names `TraceReplayAgent`
(megatron_patches/megatron_lm/rl_replay.py, registered by the launcher in
megatron.rl.agent.registry.AGENT_REGISTRY, which `get_agent` builds through
`WeightedMultiTask.from_config`), driven by Megatron's own `RolloutPipeline`. The launcher's CPU
mode supplies the stand-ins (megatron_patches/megatron_lm/rl_cpu.py names each: the
engine-less inference interface, `NullTokenizer.bos_id`, the THD attention stand-in, `wandb` /
`hybrid_builders` when absent, CUDA-only arguments turned off).

Added here, recorder only (changes nothing): `RECORD_ENV` names a JSON-lines file that gets,
per `training_log` call, the iteration, its loss dict and grad norm at full precision (the log
line rounds them).
Not run: generation (CUDA inference engine), CUDA graphs, Transformer Engine.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megatron_patches.megatron_lm import compat

RECORD_ENV = "TRAIN_RL_RECORD"
__all__ = ["RECORD_ENV", "save_weights", "main"]


def _recording(training_log, path):
    def record(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
               report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        with open(path, "a") as out:
            out.write(json.dumps({"iteration": iteration, "grad_norm": float(grad_norm),
                                  "losses": {k: float(v) for k, v in loss_dict.items()}}) + "\n")
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)
    return record


def save_weights(checkpoints: str, out: str) -> None:
    """The floating-point model tensors of every iteration saved under `checkpoints`
    (--ckpt-format torch) as {iteration: {"RANK_DIR/name": tensor}} in `out`, one RANK_DIR per
    model-parallel rank (mp_rank_00, or mp_rank_00_000 / _001 with pipeline stages). Loading
    Megatron's checkpoint needs the checkout's modules: this runs beside the training run."""
    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    weights = {}
    for path in sorted(Path(checkpoints).glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False, map_location="cpu")["model"]
        weights.setdefault(int(path.parts[-3][5:]), {}).update({
            f"{path.parts[-2]}/{k}": v for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point()})
    torch.save(weights, out)


def main(argv) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "megatron_lm"))
    import train_rl_prefix_reuse as launcher

    if os.environ.get(RECORD_ENV):
        from megatron_patches.megatron_lm.rl_cpu import stub_missing_modules

        stub_missing_modules()  # wandb, before megatron.training imports megatron.rl
        compat.enable_python311_support()
        compat.enable_megatron_lm_cpu_support()
        from megatron.training import training

        training.training_log = _recording(training.training_log, os.environ[RECORD_ENV])
    launcher.main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "--save-weights":
        save_weights(*sys.argv[2:])
    else:
        main(sys.argv[1:])
