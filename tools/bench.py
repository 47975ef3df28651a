"""Dense vs prefix-reuse training step, side by side in one process: same weights, same data.

Three paths time one forward+backward step each (gradients zeroed between steps, no optimizer):

- dense: stock Megatron dense schedule over full [prefix; suffix] rows, with the fused-SDPA core
  attention (`build_model(..., fused_attention=True)`): the fair baseline, since the reuse path's
  attention is fused too (the same CPU flash-kernel family).
- stock dense: the same with Megatron's local attention, which on CPU materialises the score
  matrix (unfused). It is the numerical reference: `max_grad_rel_diff` compares reuse with it.
- reuse: the prefix-reuse schedule on the local-spec model (the reuse hooks replace its core
  attention).

Steps are interleaved (dense, stock, reuse, dense, ...) so machine noise hits the paths alike;
the median per path is reported. `ideal_speedup` is the analytic FLOP ratio of the actual plan
(prefix_schedule/flops.py); `efficiency` = speedup / ideal_speedup. It can exceed 1: the FLOP
model counts matmuls only, and reuse also skips the prefix's per-token elementwise work (RoPE,
norms, activations) G-1 times. Interleaving evens out steady noise, not bursts from other jobs:
the table's min/max per path show how quiet the machine was.

    python tools/bench.py [--prefix-len 1024 --suffix-len 64 --group-size 8 --num-groups 2 ...]
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

try:
    import prefix_schedule  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_schedule.data import Group, GroupBatch, Trajectory  # noqa: E402
from prefix_schedule.flops import ModelDims, ideal_speedup  # noqa: E402
from prefix_schedule.losses import PolicyLossConfig  # noqa: E402
from prefix_schedule.planner import StepPlan, plan_microbatches  # noqa: E402

__all__ = ["BenchConfig", "make_batch", "run_bench", "format_table", "parse_args", "main"]

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
PATHS = ("dense", "stock_dense", "reuse")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Workload, model shape and measurement settings of one benchmark run."""

    prefix_len: int = 1024
    """Shared prompt tokens per group (P >= 2, so that something is cached)."""
    suffix_len: int = 64
    """Response tokens per trajectory (n >= 1)."""
    group_size: int = 8
    """Trajectories per group (G >= 1)."""
    num_groups: int = 2
    """Groups in the step."""
    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 256
    """Model width."""
    ffn_hidden_size: int = 688
    """SwiGLU inner width."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int = 2
    """K/V heads (GQA)."""
    vocab_size: int = 2048
    """Vocabulary size."""
    token_budget: Optional[int] = None
    """Tokens per suffix microbatch; None = group_size * suffix_len (one group's suffixes)."""
    steps: int = 3
    """Timed steps per path (the median is reported)."""
    warmup: int = 1
    """Untimed steps per path before timing."""
    threads: int = 2
    """torch.set_num_threads."""
    seed: int = 0
    """Seed of the weights and the data."""
    skip_stock: bool = False
    """Do not time the stock (unfused) dense path; it still gives the one-step gradient reference."""

    def __post_init__(self) -> None:
        minimums = dict(prefix_len=2, suffix_len=1, group_size=1, num_groups=1, num_layers=1,
                        hidden_size=1, ffn_hidden_size=1, num_attention_heads=1,
                        num_query_groups=1, vocab_size=2, steps=1, warmup=0, threads=1, seed=0)
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; give an int >= {minimum}")
        if self.token_budget is None:
            object.__setattr__(self, "token_budget", self.group_size * self.suffix_len)
        elif self.token_budget < self.suffix_len:
            raise ValueError(f"--token-budget={self.token_budget} is smaller than a suffix row "
                             f"({self.suffix_len} tokens); use --token-budget >= {self.suffix_len}")

    def model_dims(self) -> ModelDims:
        """The FLOP-model view of the model (validates the head arithmetic too)."""
        return ModelDims(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         ffn_hidden_size=self.ffn_hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         num_query_groups=self.num_query_groups, vocab_size=self.vocab_size,
                         gated_linear_unit=True)


def make_batch(config: BenchConfig) -> GroupBatch:
    """Random prompts and responses; per-token random advantages; old/ref log-probs near uniform.

    Old and reference log-probs sit around log(1/V), where an untrained model's log-probs are,
    so the importance ratios stay near 1 and both the clip and the KL term are exercised.
    """
    gen = torch.Generator().manual_seed(config.seed)
    uniform = -math.log(config.vocab_size)
    n = config.suffix_len

    def near_uniform() -> torch.Tensor:
        return uniform + 0.1 * torch.randn(n, generator=gen)

    groups = []
    for _ in range(config.num_groups):
        prefix = torch.randint(0, config.vocab_size, (config.prefix_len,), generator=gen)
        trajectories = [
            Trajectory(suffix=torch.randint(0, config.vocab_size, (n,), generator=gen),
                       advantages=torch.randn(n, generator=gen),
                       old_logprobs=near_uniform(), ref_logprobs=near_uniform())
            for _ in range(config.group_size)
        ]
        groups.append(Group(prefix=prefix, trajectories=trajectories))
    return GroupBatch(groups=groups)


def _build_models(config: BenchConfig):
    """(local-spec model, fused-SDPA model with the same weights), Megatron initialised."""
    import megatron_patches
    from megatron_patches.models import TinyLlamaConfig, build_model, initialize_single_process
    from megatron_patches.training import scale_grads_by_token_count

    megatron_patches.install()
    initialize_single_process(seed=config.seed)
    shape = TinyLlamaConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                            ffn_hidden_size=config.ffn_hidden_size,
                            num_attention_heads=config.num_attention_heads,
                            num_query_groups=config.num_query_groups, vocab_size=config.vocab_size,
                            max_seq_len=config.prefix_len + config.suffix_len)
    local = build_model(shape, seed=config.seed)
    # Another init seed, so that equal weights can only come from load_state_dict.
    fused = build_model(shape, fused_attention=True, seed=config.seed + 1)
    fused.load_state_dict(local.state_dict())
    for model in (local, fused):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    return local, fused


def _timed(model, run: Callable[[], object]) -> float:
    """Wall seconds of one fwd+bwd step, gradients zeroed (set to None) beforehand."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _check_step(local, batch: GroupBatch, plan: StepPlan) -> Dict[str, float]:
    """One untimed step of stock dense and of reuse on the local model: losses, gradient diff."""
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    local.zero_grad(set_to_none=True)
    dense = dense_step(local, batch, LOSS)
    dense_grads = param_grads(local)
    local.zero_grad(set_to_none=True)
    reuse = reuse_step(local, batch, plan, LOSS)
    diff = max_relative_diff(dense_grads, param_grads(local))
    local.zero_grad(set_to_none=True)
    return {"loss_dense": dense.loss, "loss_reuse": reuse.loss, "max_grad_rel_diff": diff}


def _time_paths(config: BenchConfig, local, fused, batch: GroupBatch,
                plan: StepPlan) -> Dict[str, List[float]]:
    from megatron_patches.training import dense_step, reuse_step

    runs = {
        "dense": (fused, lambda: dense_step(fused, batch, LOSS)),
        "stock_dense": (local, lambda: dense_step(local, batch, LOSS)),
        "reuse": (local, lambda: reuse_step(local, batch, plan, LOSS)),
    }
    if config.skip_stock:
        del runs["stock_dense"]
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for step in range(config.warmup + config.steps):
        for name, (model, run) in runs.items():  # interleaved: noise hits every path alike
            seconds = _timed(model, run)
            if step >= config.warmup:
                times[name].append(seconds)
    local.zero_grad(set_to_none=True)
    fused.zero_grad(set_to_none=True)
    return times


def run_bench(config: BenchConfig, raw_times: Optional[Dict[str, List[float]]] = None) -> dict:
    """Run the benchmark; return the result dict that `--json` writes.

    `raw_times`, if given, receives every timed step's seconds per path (for the table's spread).
    """
    dims = config.model_dims()
    torch.set_num_threads(config.threads)
    batch = make_batch(config)
    plan = plan_microbatches(batch, token_budget=config.token_budget,
                             max_seq_len=config.prefix_len + config.suffix_len)
    ideal = ideal_speedup(dims, batch, plan)
    local, fused = _build_models(config)
    check = _check_step(local, batch, plan)
    times = _time_paths(config, local, fused, batch, plan)
    if raw_times is not None:
        raw_times.update(times)
    median = {name: statistics.median(values) for name, values in times.items()}
    speedup = median["dense"] / median["reuse"]
    return {
        "dense_seconds": median["dense"],
        "stock_dense_seconds": median.get("stock_dense"),
        "reuse_seconds": median["reuse"],
        "speedup": speedup,
        "ideal_speedup": ideal,
        "efficiency": speedup / ideal,
        **check,
        "model": {name: getattr(dims, name) for name in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "vocab_size", "gated_linear_unit")},
        "workload": {name: getattr(config, name) for name in (
            "prefix_len", "suffix_len", "group_size", "num_groups")},
        "token_budget": config.token_budget,
        "threads": config.threads,
        "steps": config.steps,
    }


def format_table(result: dict, raw_times: Optional[Dict[str, List[float]]] = None) -> str:
    """A short human-readable summary of a result dict (with min/max per path if given times)."""
    w, m = result["workload"], result["model"]
    raw_times = raw_times or {}

    def row(label: str, name: str) -> str:
        if result[f"{name}_seconds"] is None:
            return f"{label:<30}{'skipped':>12}"
        values = raw_times.get(name)
        spread = f"{min(values):>10.4f}{max(values):>10.4f}" if values else ""
        return f"{label:<30}{result[name + '_seconds']:>12.4f}{spread}"

    lines = [
        f"workload: {w['num_groups']} groups x {w['group_size']} trajectories, prefix "
        f"{w['prefix_len']}, suffix {w['suffix_len']}, token budget {result['token_budget']}",
        f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"heads {m['num_attention_heads']}/{m['num_query_groups']} kv, vocab {m['vocab_size']}; "
        f"{result['threads']} threads, median of {result['steps']} steps",
        f"{'fwd+bwd seconds':<30}{'median':>12}{'min':>10}{'max':>10}",
        row("dense (fused SDPA)", "dense"),
        row("stock dense (local, unfused)", "stock_dense"),
        row("reuse", "reuse"),
        f"speedup {result['speedup']:.3f}x  ideal {result['ideal_speedup']:.3f}x  "
        f"efficiency {result['efficiency']:.3f}",
        f"loss dense {result['loss_dense']:.6f}  reuse {result['loss_reuse']:.6f}  "
        f"max grad rel diff vs stock dense {result['max_grad_rel_diff']:.2e}",
    ]
    return "\n".join(lines)


def _field_docs() -> Dict[str, str]:
    """BenchConfig's attribute docstrings (the --help text of each flag)."""
    tree = ast.parse(Path(__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BenchConfig").body
    return {a.target.id: d.value.value for a, d in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr)
            and isinstance(d.value, ast.Constant)}


def parse_args(argv=None) -> tuple[BenchConfig, Optional[Path]]:
    """Command line -> (BenchConfig, JSON output path or None); ValueError on bad values."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults, docs = BenchConfig(), _field_docs()
    for field in dataclasses.fields(BenchConfig):
        if field.name in ("skip_stock", "token_budget"):
            continue
        p.add_argument("--" + field.name.replace("_", "-"), type=int,
                       default=getattr(defaults, field.name), help=docs.get(field.name))
    p.add_argument("--token-budget", type=int, default=None, help=docs["token_budget"])
    p.add_argument("--skip-stock", action="store_true", help=docs["skip_stock"])
    p.add_argument("--json", type=Path, default=None, help="write the result dict here")
    args = vars(p.parse_args(argv))
    out = args.pop("json")
    return BenchConfig(**args), out


def main(argv=None) -> int:
    try:
        config, out = parse_args(argv)
        config.model_dims()
    except ValueError as exc:
        print(f"bench.py: error: {exc}", file=sys.stderr)
        return 2
    raw_times: Dict[str, List[float]] = {}
    result = run_bench(config, raw_times)
    print(format_table(result, raw_times))
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
