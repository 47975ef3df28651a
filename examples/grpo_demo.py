"""GRPO on a tiny Llama-style Megatron model, trained twice: dense and with prefix reuse.

In GRPO every prompt is sampled G times, so a training step sees G copies of the same long prompt.
Dense training runs each [prompt; response] row through the model: the prompt G times. Prefix
reuse runs the prompt once and is exactly the same computation (docs/DESIGN.md):

  Phase A  prefix forward, once per group: every layer's K/V of the prompt go to a cache
           (prefix_schedule/runtime/cache.py); the forward stops after the last layer's K/V.
  Phase B  the G responses are packed into ordinary Megatron microbatches under a token budget
           (prefix_schedule/planning/planner.py); their attention also reads the group's cached K/V
           (megatron_patches/runtime/hooks.py -> prefix_schedule/attention/core.py), and their backward adds
           the prompt-side gradients gK/gV into fp32 buffers of the cache.
  Phase C  prefix backward, once per group, driven by the accumulated gK/gV.

The executor (megatron_patches/runtime/executor.py) walks a schedule of these actions
(prefix_schedule/pipeline/); Megatron selects it like any other schedule via
`get_forward_backward_func()` (megatron_patches/training.py shows both calls).

What this script does: a fixed random prompt per group; each step draws G random responses per
group (not sampled from the model: this demo is about the training step, not generation), scores
them with a rule (the fraction of response tokens below vocab/2), turns the rewards into GRPO
advantages (prefix_schedule/losses.py), and takes one on-policy AdamW step in two copies of the
same initial model: dense and with prefix reuse. It prints both losses, the gradient difference
and the step times, then the weight difference after training and the speedup; it exits 1 if the
two runs disagree beyond 1e-4 relative.

Which dense: Megatron's own dense schedule and layers, with one change -- the core attention is
torch's fused SDPA instead of the local spec's unfused one (`build_model(fused_attention=True)`).
Both compute the same attention; the unfused one materialises the score matrix and on CPU is
several times slower, which would flatter reuse (whose attention is fused). So the dense run is
also the fair speed baseline. `--stock-dense` trains the dense run with the unfused stock
attention instead (slower; tests/test_equivalence.py and tools/bench.py compare with it too).

[Adam and rounding] Dense and reuse gradients agree to ~1e-6 relative (rounding of a different
summation order). Adam divides every entry by its own magnitude, so with eps=1e-8 the entries at
rounding level (~1e-9 here, 7 orders below a tensor's largest) get updates of ~10% of lr whose
size is set by rounding: two dense runs that differ only in the attention kernel (fused vs
unfused) already differ by ~1e-3 (max relative) after one step. eps=1e-5 keeps rounding-level
entries from being amplified, so the weight comparison tests the method, not Adam's amplification.

    python examples/grpo_demo.py [--quick] [--steps 5] [--seed 0] [--stock-dense]

The speedup line gives each run's median step time and spread over the timed steps (dense and
reuse alternate which goes first) and, when the steps spread widely or the machine is busy
(load average above its cores), says beside the figure that it is noise
(megatron_patches/support/noise.py, [Note: timings that say when they are noise]).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

# This checkout's packages first, whatever copy of them an installed package points at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory  # noqa: E402
from prefix_schedule.losses import PolicyLossConfig, grpo_advantages  # noqa: E402
from prefix_schedule.planning.planner import plan_microbatches  # noqa: E402

__all__ = ["DemoConfig", "QUICK", "main"]

TOLERANCE = 1e-4
LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2)  # on-policy: ratio 1, no KL


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Workload and model of the demo."""

    num_groups: int = 2
    """Prompts (groups) per step."""
    group_size: int = 8
    """Responses per prompt (G)."""
    prompt_len: int = 768
    """Tokens of each shared prompt."""
    max_response_len: int = 48
    """Responses have between max_response_len // 2 and max_response_len tokens."""
    num_layers: int = 4
    """Transformer layers of the model."""
    hidden_size: int = 256
    """Model width (ffn = 688 * hidden_size / 256, 8 query heads, 2 K/V heads)."""
    vocab_size: int = 2048
    """Vocabulary size; the reward counts response tokens below vocab_size / 2."""
    steps: int = 5
    """Optimizer steps (the speedup is the median of steps 1.. : step 0 pays warm-up)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    adam_eps: float = 1e-5
    """AdamW eps: entries of a gradient smaller than this are not normalised up to ~lr (why not
    the usual 1e-8: see "[Adam and rounding]" in the module docstring)."""
    seed: int = 0
    """Seed of the weights, the prompts and the responses."""

    def __post_init__(self) -> None:
        for name in ("num_groups", "group_size", "max_response_len", "num_layers", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; it must be >= 1")
        if self.prompt_len < 2:
            raise ValueError(f"prompt_len={self.prompt_len}; give >= 2 tokens so something is cached")
        if self.hidden_size % 64 or self.vocab_size < 2:
            raise ValueError("hidden_size must be a multiple of 64 and vocab_size >= 2")
        if not self.lr > 0 or not self.adam_eps > 0:
            raise ValueError(f"lr={self.lr}, adam_eps={self.adam_eps}; both must be positive")


QUICK = DemoConfig(num_groups=2, group_size=4, prompt_len=96, max_response_len=12, num_layers=2,
                   hidden_size=64, vocab_size=256, steps=2)
"""The --quick preset (tests): same phases, a model and workload that run in seconds."""


def build_models(config: DemoConfig, *, stock_dense: bool = False):
    """(dense model, reuse model) with the same initial weights; see the docstring for which dense."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    shape = TinyLlamaConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                            ffn_hidden_size=688 * config.hidden_size // 256,
                            num_attention_heads=8, num_query_groups=2,
                            vocab_size=config.vocab_size,
                            max_seq_len=config.prompt_len + config.max_response_len)
    reuse = build_model(shape, seed=config.seed)  # local spec: the reuse hooks replace its attention
    dense = build_model(shape, fused_attention=not stock_dense, seed=None)
    dense.load_state_dict(reuse.state_dict())  # (deepcopy cannot copy process-group handles)
    for model in (dense, reuse):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    return dense, reuse


def reward(response: torch.Tensor, vocab_size: int) -> float:
    """The rule the policy is rewarded for: the fraction of response tokens below vocab/2."""
    return (response < vocab_size // 2).float().mean().item()


def sample_step(config: DemoConfig, prompts, gen: torch.Generator):
    """One step's GroupBatch (random responses, GRPO advantages) and its mean reward."""
    groups, all_rewards = [], []
    for prompt in prompts:
        lengths = torch.randint(config.max_response_len // 2 or 1, config.max_response_len + 1,
                                (config.group_size,), generator=gen)
        responses = [torch.randint(0, config.vocab_size, (int(n),), generator=gen) for n in lengths]
        rewards = [reward(r, config.vocab_size) for r in responses]
        advantages = grpo_advantages(rewards)  # one per response, broadcast over its tokens
        groups.append(Group(prefix=prompt, trajectories=[
            Trajectory(suffix=r, advantages=float(a)) for r, a in zip(responses, advantages)]))
        all_rewards += rewards
    return GroupBatch(groups=groups), sum(all_rewards) / len(all_rewards)


def timed(fn):
    """(fn(), wall seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def train_step(config, models, optimizers, batch, reuse_first: bool = False):
    """One optimizer step of both runs on the same batch; returns the numbers printed per step
    (`reuse_first`: time the reuse step before the dense one: runs alternate, so a slow phase of
    the machine hits both alike)."""
    from megatron_patches.runtime.finite_grads import check_finite_grads
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    dense, reuse = models
    # Suffix microbatches hold up to one group's worth of response tokens; the planner packs them
    # greedily, so a group may span two microbatches and a microbatch may hold two groups.
    plan = plan_microbatches(batch, token_budget=config.group_size * config.max_response_len,
                             max_seq_len=config.prompt_len + config.max_response_len)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if reuse_first:
        reuse_result, reuse_s = timed(lambda: reuse_step(reuse, batch, plan, LOSS))
    dense_result, dense_s = timed(lambda: dense_step(dense, batch, LOSS))
    if not reuse_first:
        reuse_result, reuse_s = timed(lambda: reuse_step(reuse, batch, plan, LOSS))
    grad_diff = max_relative_diff(param_grads(dense), param_grads(reuse))
    for name, model in (("dense", dense), ("reuse", reuse)):  # NaN/inf never reach the weights
        check_finite_grads(model, run=name)
    for opt in optimizers:
        opt.step()
    return dict(loss_dense=dense_result.loss, loss_reuse=reuse_result.loss, grad_diff=grad_diff,
                dense_s=dense_s, reuse_s=reuse_s)


def weight_diff(a, b) -> float:
    """max over parameters of max|a-b| / max|a| (the gradient metric, applied to weights)."""
    from megatron_patches.training import max_relative_diff  # inf on NaN/inf either side

    weights = [{n: p.detach().float() for n, p in m.named_parameters()} for m in (a, b)]
    return max_relative_diff(*weights)


def _setup(config: DemoConfig, stock_dense: bool):
    """Megatron (one CPU process), both models and optimizers, the fixed prompts."""
    import megatron_patches

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    from megatron_patches.models.tiny import initialize_single_process

    megatron_patches.install()
    initialize_single_process(seed=config.seed)
    models = build_models(config, stock_dense=stock_dense)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=config.lr, eps=config.adam_eps,
                                    weight_decay=0.01) for m in models]
    gen = torch.Generator().manual_seed(config.seed)
    prompts = [torch.randint(0, config.vocab_size, (config.prompt_len,), generator=gen)
               for _ in range(config.num_groups)]
    return models, optimizers, prompts, gen


def _print_header(config: DemoConfig, stock_dense: bool) -> None:
    print(f"{config.num_groups} prompts x {config.group_size} responses, prompt "
          f"{config.prompt_len} tokens, responses {config.max_response_len // 2}-"
          f"{config.max_response_len}; {config.num_layers} layers, hidden {config.hidden_size}")
    print(f"dense run: Megatron dense schedule, {'stock unfused' if stock_dense else 'fused SDPA'} "
          "attention; reuse run: prefix-reuse schedule (reward: mean over the drawn responses)")
    print(f"{'step':>4} {'reward':>7} {'loss dense':>12} {'loss reuse':>12} {'grad diff':>10} "
          f"{'dense s':>8} {'reuse s':>8}")


def run(config: DemoConfig, *, stock_dense: bool = False) -> bool:
    """Train both runs, print the table; True when dense and reuse agree within TOLERANCE."""
    models, optimizers, prompts, gen = _setup(config, stock_dense)
    from megatron_patches.training import worst_of

    _print_header(config, stock_dense)
    worst, seconds = 0.0, {"dense_s": [], "reuse_s": []}
    for step in range(config.steps):
        batch, mean_reward = sample_step(config, prompts, gen)
        row = train_step(config, models, optimizers, batch, reuse_first=step % 2 == 1)
        loss_diff = abs(row["loss_dense"] - row["loss_reuse"]) / max(abs(row["loss_dense"]), 1e-3)
        worst = worst_of(worst, row["grad_diff"], loss_diff)  # a NaN loss reads as inf
        if step > 0 or config.steps == 1:  # step 0 also pays one-time warm-up costs
            for name in seconds:
                seconds[name].append(row[name])
        print(f"{step:>4} {mean_reward:>7.3f} {row['loss_dense']:>12.6f} {row['loss_reuse']:>12.6f} "
              f"{row['grad_diff']:>10.2e} {row['dense_s']:>8.2f} {row['reuse_s']:>8.2f}")
    weights = weight_diff(*models)
    worst = worst_of(worst, weights)
    print(f"max relative weight difference after {config.steps} AdamW steps: {weights:.2e}")
    from megatron_patches.support.noise import machine_load, speedup_line

    load, cores = machine_load()
    print(speedup_line(seconds["dense_s"], seconds["reuse_s"], load=load, cores=cores,
                       label=f"speedup of reuse over "
                             f"{'stock unfused' if stock_dense else 'fused-attention'} dense"))
    agree = worst <= TOLERANCE
    print(f"agreement {'OK' if agree else 'FAILED'}: dense and reuse differ by at most {worst:.2e} "
          f"relative (losses, gradients, weights; tolerance {TOLERANCE:.0e})")
    return agree


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stock-dense", action="store_true",
                        help="dense run with Megatron's unfused local attention (slower)")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DemoConfig()
    try:
        config = dataclasses.replace(base, seed=args.seed,
                                     steps=base.steps if args.steps is None else args.steps)
    except ValueError as exc:
        parser.error(str(exc))
    return 0 if run(config, stock_dense=args.stock_dense) else 1


if __name__ == "__main__":
    sys.exit(main())
