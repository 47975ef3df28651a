"""The megatron-rl bench's worker (benchlib/adapter_train_rl.py starts it):
`python train_rl_worker.py TREE CONFIG.json OUT.json` with the patched Megatron-LM main tree
first on PYTHONPATH.

Megatron-LM's own code, driven as tests/train_rl_replay.py drives it (its stubs, named and
reasoned there and in megatron_patches/megatron_lm/rl_cpu.py, are imported, never copied): `rl_utils.get_grpo_data_iterator` (the
collection replayed, `prepare_data_for_update` with its stock old/ref log-prob passes) builds
the step's microbatches once, on the bench's workload (`--num-groups` prompts of `--prefix-len`
tokens, `--group-size` rollouts of `--suffix-len` generated tokens ending in eod; `--seq-length`
= prefix + suffix, so rows carry no padding, one row per microbatch); then the training step as
train_step calls it (`training.get_forward_backward_func()(forward_step_func=
train_rl.forward_step, ...)`) is timed on those microbatches: dense = stock Megatron (fused-SDPA
model), reuse = the same call with `TrainRLReuse.install(rl_utils, training)`. The gradient
check runs both on the reuse model's weights (stock local attention), untimed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TOOLS.parent / "tests"), str(TOOLS)]


def _rollouts(config, gen):
    """`--num-groups` GRPO groups in Megatron-LM's agents' types, at the bench's sizes (as
    train_rl_replay._rollouts, whose sizes are the test's)."""
    from megatron.rl.types.rollout import RolloutGroup, TokenRollout
    import train_rl_replay as replay

    eod, groups = replay._ReplayTokenizer.eod, []
    for g in range(config.num_groups):
        prompt = torch.randint(3, 250, (config.prefix_len,), generator=gen).tolist()
        members = []
        for _ in range(config.group_size):
            n = config.suffix_len
            resp = torch.randint(3, 250, (n - 1,), generator=gen).tolist() + [eod]
            members.append(TokenRollout(
                trajectory=[prompt + resp], reward=float(torch.rand(1, generator=gen)),
                generation_mask=[[False] * len(prompt) + [True] * n],
                logprobs=[(-torch.rand(n, generator=gen)).tolist()], env_id="bench"))
        groups.append(RolloutGroup(rollouts=members, uid=f"prompt-{g}"))
    return groups


def _setup(tree: Path, config):
    """Megatron-LM's RL modules with train_rl_replay's stubs at the bench's sizes; the models."""
    from megatron_patches.megatron_lm import compat
    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    import train_rl_replay as replay
    from megatron_patches.megatron_lm.rl_cpu import cpu_thd_forward, stub_missing_modules
    stub_missing_modules()
    import megatron.rl.rl_utils  # noqa: F401
    from megatron.core.models.gpt import GPTModel
    sys.path.insert(0, str(tree))  # train_rl.py
    GPTModel.forward = cpu_thd_forward(GPTModel.forward)
    replay.SEQ_LENGTH = config.prefix_len + config.suffix_len  # read by _args, _step
    replay.GROUPS, replay.G = config.num_groups, config.group_size  # and by the collection
    replay._rollouts = lambda gen: _rollouts(config, gen)
    args = replay._args()
    from benchlib.adapter_common import bench_models
    models = bench_models(config)
    for model in models.values():
        model.config.calculate_per_token_loss = True  # train_rl's --calculate-per-token-loss
    return replay, args, models


def _microbatches(replay, args, model, config):
    """The training step's microbatches, as get_grpo_data_iterator hands them to train_step."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.rl import rl_utils
    record = {"collections": 0}
    rl_utils.get_environment_rollouts = replay._replayed_collection(record)
    args.curr_iteration = 0
    with torch.no_grad():
        iterator = rl_utils.get_grpo_data_iterator(
            [model], None, None, 0, replay._clone_state(model), grpo_iterations=1,
            grpo_prompts_per_step=config.num_groups, grpo_group_size=config.group_size,
            global_batch_size=config.num_groups * config.group_size, sequence_packing=False,
            buffered_rollouts=None, is_correction=False, optimizer_is_on_cpu=False)
    return [next(iterator) for _ in range(get_num_microbatches())]


def main(tree: str, spec: str, out: str) -> None:
    from benchlib.adapter_common import (adapter_result, ideal_speedup, overhead_of, time_paths)
    from benchlib.config import BenchConfig
    config = BenchConfig(**json.loads(Path(spec).read_text()))
    replay, args, models = _setup(Path(tree), config)
    from megatron.rl import rl_utils
    from megatron.training import training
    from megatron_patches.frameworks.megatron_rl import rollout_from_train_rl
    from megatron_patches.training import max_relative_diff, param_grads, zero_grads
    items = _microbatches(replay, args, models["reuse"], config)
    hooks = replay._hooks(args)

    def dense(model):
        return replay._step(model, iter(items), args)

    def reuse(model):
        uninstall = hooks.install(rl_utils, training)
        try:
            return replay._step(model, iter(items), args)
        finally:
            uninstall()
    times = time_paths({"dense": lambda: dense(models["dense"]),
                        "reuse": lambda: reuse(models["reuse"])},
                       {n: (lambda m=m: zero_grads(m)) for n, m in models.items()}, config)
    model = models["reuse"]
    zero_grads(model)
    loss = {"reuse": _lm_loss(reuse(model))}
    reuse_grads = param_grads(model)
    zero_grads(model)  # the reference: the stock step, local attention, same weights
    loss["dense"] = _lm_loss(dense(model))
    diff = max_relative_diff(param_grads(model), reuse_grads)
    tokens, adv, old, mask, _pos, ref, _inf = (torch.cat(t) for t in zip(*items))
    ideal, num_reuse = ideal_speedup(model, rollout_from_train_rl(
        tokens, mask, adv, old, ref, group_size=config.group_size))
    result = adapter_result(config, times, diff=diff,
                            finite=all(torch.isfinite(g).all() for g in reuse_grads.values()),
                            num_microbatches={"dense": len(items), "reuse": num_reuse},
                            ideal=ideal, overhead=overhead_of(config, model))
    result.update(loss=loss, report=hooks.reports[-1], raw_times=times)
    Path(out).write_text(json.dumps(result))


def _lm_loss(losses) -> float:
    """train_rl's reported loss of the step: summed 'lm loss' [sum, count] over microbatches."""
    total = torch.stack([r["lm loss"] for r in losses]).sum(0)
    return float(total[0] / total[1])


if __name__ == "__main__":
    main(*sys.argv[1:4])
