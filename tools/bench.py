"""Dense vs prefix-reuse training step, side by side: same weights, same data.

Three paths time one forward+backward step each (gradients zeroed between steps, no optimizer):

- dense: stock Megatron dense schedule over full [prefix; suffix] rows, with the fused-SDPA core
  attention (`build_model(..., fused_attention=True)`): the fair baseline, since the reuse path's
  attention is fused too (the same CPU flash-kernel family).
- stock dense: the same with Megatron's local attention, which on CPU materialises the score
  matrix (unfused). It is the numerical reference: `max_grad_rel_diff` compares reuse with it.
- reuse: the prefix-reuse schedule on the local-spec model (the reuse hooks replace its core
  attention; `--attention-backend` picks their kernel, the JSON names the one used).

Steps are interleaved (dense, stock, reuse, dense, ...) so machine noise hits the paths alike;
the median per path is reported. `ideal_speedup` is the analytic FLOP ratio of the actual plan
(prefix_schedule/planning/flops.py); `efficiency` = speedup / ideal_speedup. It can exceed 1: the FLOP
model counts matmuls only, and reuse also skips the prefix's per-token elementwise work (RoPE,
norms, activations) G-1 times. Interleaving evens out steady noise, not bursts from other jobs:
the table's min/max per path show how quiet the machine was.

Memory (`memory` in the JSON, single-process runs only; None with several processes): after
timing, one extra untimed step per path (fused dense, reuse) runs under tools/memory_probe.py,
which counts the bytes autograd holds for backward -- saved-tensor storages, each once, while
any saved reference to them is alive -- plus, for reuse, the prefix cache's K/V copies and fp32
gK/gV. It is not the allocator's peak: parameters, gradients, optimizer state and transient
temporaries are excluded. `reuse_suffix_phase_peak_bytes` is the peak from the first suffix
forward to the release of the last suffix microbatch (the prefix graphs, still waiting for
Phase C, are held then too); `suffix_phase_reduction` = 1 - that / dense's whole-step peak.

Parallel layouts: `--pp/--tp/--dp` start pp*tp*dp gloo processes on this machine (one process,
no subprocess, when all are 1), each with max(1, threads // world size) threads. Pipeline stages
use Megatron's 1F1B for dense (variable row lengths); DP ranks are Megatron-DDP-wrapped and each
runs its share from `prefix_schedule.planning.placement.place_groups`, dense and reuse on the same share.
A step's time is the slowest rank's (all-reduce MAX); `max_grad_rel_diff` is the max over ranks;
`ideal_speedup` stays the FLOP ratio of the whole batch (pipeline bubbles and DP imbalance are
what `efficiency` then shows). A rank's failure is reported with its traceback; `--timeout`
bounds the whole multi-process run.

    python tools/bench.py [--prefix-len 1024 --suffix-len 64 --group-size 8 --num-groups 2 ...]
    python tools/bench.py --pp 2 --json out.json
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

from prefix_schedule.attention import backends as attention_backends  # noqa: E402
from prefix_schedule.planning.data import Group, GroupBatch, Trajectory  # noqa: E402
from prefix_schedule.planning.flops import ModelDims, ideal_speedup  # noqa: E402
from prefix_schedule.losses import PolicyLossConfig  # noqa: E402
from prefix_schedule.planning.placement import Placement, place_groups  # noqa: E402
from prefix_schedule.planning.planner import StepPlan, plan_microbatches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/memory_probe.py, however run
import memory_probe  # noqa: E402

__all__ = ["BenchConfig", "make_batch", "run_bench", "format_table", "parse_args", "main"]

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
PATHS = ("dense", "stock_dense", "reuse")
MEMORY_BASIS = ("bytes autograd holds for backward (saved-tensor storages, each once; "
                "parameters excluded) plus, for reuse, the prefix cache's K/V copies and gK/gV; "
                "one untimed step per path; not the allocator's peak (tools/memory_probe.py)")
IDEAL_BASIS = ("FLOP ratio dense/reuse of the whole (global) batch planned as one step "
               "(prefix_schedule/planning/flops.py); ignores pipeline bubbles and DP imbalance")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Workload, model shape, parallel layout and measurement settings of one benchmark run."""

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
    prefix_chunk_tokens: Optional[int] = None
    """Run each cached prefix as chunks of at most this many tokens (one pipeline job each);
    None = one chunk per group."""
    steps: int = 3
    """Timed steps per path (the median is reported)."""
    warmup: int = 1
    """Untimed steps per path before timing."""
    threads: int = 2
    """torch.set_num_threads (split evenly over the processes of a parallel layout)."""
    seed: int = 0
    """Seed of the weights and the data."""
    pp: int = 1
    """Pipeline-parallel stages (world size = pp * tp * dp processes on this machine)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    dp: int = 1
    """Data-parallel ranks (groups placed by prefix_schedule.planning.placement.place_groups)."""
    attention_backend: str = "auto"
    """Shared-prefix attention kernel of the reuse path: auto or a name of
    prefix_schedule.attention.backends.BACKEND_NAMES."""
    timeout: int = 900
    """Seconds the multi-process run may take, start-up included, before it is killed as hung."""
    skip_stock: bool = False
    """Do not time the stock (unfused) dense path; it still gives the one-step gradient reference."""

    def __post_init__(self) -> None:
        minimums = dict(prefix_len=2, suffix_len=1, group_size=1, num_groups=1, num_layers=1,
                        hidden_size=1, ffn_hidden_size=1, num_attention_heads=1,
                        num_query_groups=1, vocab_size=2, steps=1, warmup=0, threads=1, seed=0,
                        pp=1, tp=1, dp=1, timeout=1)
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; give an int >= {minimum}")
        if self.token_budget is None:
            object.__setattr__(self, "token_budget", self.group_size * self.suffix_len)
        elif self.token_budget < self.suffix_len:
            raise ValueError(f"--token-budget={self.token_budget} is smaller than a suffix row "
                             f"({self.suffix_len} tokens); use --token-budget >= {self.suffix_len}")
        if self.prefix_chunk_tokens is not None and self.prefix_chunk_tokens < 1:
            raise ValueError(f"--prefix-chunk-tokens={self.prefix_chunk_tokens}; give an int >= 1")
        choices = (attention_backends.AUTO,) + attention_backends.BACKEND_NAMES
        if self.attention_backend not in choices:
            raise ValueError(f"--attention-backend={self.attention_backend!r}; choose one of {choices}")
        self._check_layout()

    def _check_layout(self) -> None:
        """What Megatron needs of the shape for this layout, said before any process starts."""
        if self.num_layers % self.pp:
            raise ValueError(f"--num-layers={self.num_layers} does not split over --pp={self.pp} "
                             "stages; give a multiple of --pp")
        for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) % self.tp:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} is not a multiple "
                                 f"of --tp={self.tp}")
        if self.num_query_groups % self.tp and self.tp % self.num_query_groups:
            raise ValueError(f"--num-query-groups={self.num_query_groups} must be a multiple or a "
                             f"divisor of --tp={self.tp}")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    def model_dims(self) -> ModelDims:
        """The FLOP-model view of the model (validates the head arithmetic too)."""
        return ModelDims(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         ffn_hidden_size=self.ffn_hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         num_query_groups=self.num_query_groups, vocab_size=self.vocab_size,
                         gated_linear_unit=True)

    def placement(self, batch: GroupBatch) -> Optional[Placement]:
        """The DP placement of `batch` (None without DP); every rank computes the same one."""
        if self.dp == 1:
            return None
        return place_groups(batch, dp_size=self.dp, dims=self.model_dims(),
                            token_budget=self.token_budget,
                            max_seq_len=self.prefix_len + self.suffix_len)


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


def _plan(config: BenchConfig, batch: GroupBatch) -> StepPlan:
    return plan_microbatches(batch, token_budget=config.token_budget,
                             max_seq_len=config.prefix_len + config.suffix_len,
                             prefix_chunk_tokens=config.prefix_chunk_tokens)


def _selected_backend(config: BenchConfig, device="cpu", dtype=torch.float32) -> str:
    """Set the process default to the requested backend; the one the reuse hook will run.
    ValueError (with the reason) if the requested one cannot run here."""
    attention_backends.set_default_backend(config.attention_backend)
    head_dim = config.hidden_size // config.num_attention_heads
    return attention_backends.select_backend(device=device, dtype=dtype, head_dim=head_dim).name


# ---- inside the process (or each rank) that runs the models ----------------------------------

def _build_models(config: BenchConfig, distributed: bool):
    """(local-spec model, fused-SDPA model with the same weights), Megatron initialised; one
    pipeline stage's part of each; DDP-wrapped with data parallelism."""
    import megatron_patches

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    from megatron_patches.models import (TinyLlamaConfig, build_model, initialize_distributed,
                                         initialize_single_process)

    megatron_patches.install()
    if distributed:
        initialize_distributed(seed=config.seed, tp=config.tp, pp=config.pp)
    else:
        initialize_single_process(seed=config.seed)
    shape = TinyLlamaConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                            ffn_hidden_size=config.ffn_hidden_size,
                            num_attention_heads=config.num_attention_heads,
                            num_query_groups=config.num_query_groups, vocab_size=config.vocab_size,
                            max_seq_len=config.prefix_len + config.suffix_len)
    local = build_model(shape, seed=config.seed)  # this pipeline stage's part
    # Another init seed, so that equal weights can only come from load_state_dict.
    fused = build_model(shape, fused_attention=True, seed=config.seed + 1)
    fused.load_state_dict(local.state_dict())
    from megatron_patches.training import prepare_for_training

    return (prepare_for_training(local, ddp=config.dp > 1),
            prepare_for_training(fused, ddp=config.dp > 1))


def _zero(model) -> None:
    from megatron_patches.training import zero_grads

    zero_grads(model)


def _timed(model, run: Callable[[], object]) -> float:
    """Wall seconds of one fwd+bwd step, gradients zeroed (set to None) beforehand."""
    _zero(model)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _check_step(local, batch: GroupBatch, plan: StepPlan) -> Dict[str, float]:
    """One untimed step of stock dense and of reuse on the local model: losses, gradient diff."""
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step

    _zero(local)
    dense = dense_step(local, batch, LOSS)
    dense_grads = param_grads(local)
    _zero(local)
    reuse = reuse_step(local, batch, plan, LOSS)
    diff = max_relative_diff(dense_grads, param_grads(local))
    _zero(local)
    if torch.distributed.get_world_size() == 1:
        return {"loss_dense": dense.loss, "loss_reuse": reuse.loss, "max_grad_rel_diff": diff}
    return {"loss_dense": _global_loss(dense), "loss_reuse": _global_loss(reuse),
            "max_grad_rel_diff": _all_max(diff)}


def _all_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def _global_loss(result) -> float:
    """Token mean over the whole batch: the last stage of each DP replica reports (one TP rank)."""
    from megatron.core import parallel_state

    totals = torch.zeros(2, dtype=torch.float64)
    if (parallel_state.is_pipeline_last_stage()
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        totals += torch.tensor([result.loss * result.num_tokens, float(result.num_tokens)],
                               dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    return float(totals[0] / totals[1])


def _time_paths(config: BenchConfig, local, fused, batch: GroupBatch,
                plan: StepPlan) -> Dict[str, List[float]]:
    """Seconds per timed step and path; with several ranks a step's time is the slowest rank's."""
    from megatron_patches.training import dense_step, reuse_step

    runs = {
        "dense": (fused, lambda: dense_step(fused, batch, LOSS)),
        "stock_dense": (local, lambda: dense_step(local, batch, LOSS)),
        "reuse": (local, lambda: reuse_step(local, batch, plan, LOSS)),
    }
    if config.skip_stock:
        del runs["stock_dense"]
    reduce = _all_max if torch.distributed.get_world_size() > 1 else float
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for step in range(config.warmup + config.steps):
        for name, (model, run) in runs.items():  # interleaved: noise hits every path alike
            seconds = reduce(_timed(model, run))  # the MAX also lines the ranks up for the next
            if step >= config.warmup:
                times[name].append(seconds)
    _zero(local)
    _zero(fused)
    return times


def _measure(config: BenchConfig, distributed: bool = False) -> dict:
    """Build, check and time in this process, or in each rank of a layout (`distributed`, run by
    megatron_patches.launch: its pipeline stage / TP shard / DP share); every rank returns the
    same reduced numbers."""
    local, fused = _build_models(config, distributed)
    batch = make_batch(config)
    placement = config.placement(batch)
    if placement is not None:
        from megatron.core import parallel_state

        batch = placement.ranks[parallel_state.get_data_parallel_rank()].batch
    plan = _plan(config, batch)
    param = next(local.parameters())
    backend = _selected_backend(config, param.device, param.dtype)
    check = _check_step(local, batch, plan)
    times = _time_paths(config, local, fused, batch, plan)
    memory = None if distributed else _memory(local, fused, batch, plan)  # after: untimed
    return {"times": times, "attention_backend": backend, **check, "memory": memory,
            "layout": _megatron_layout()}


def _memory(local, fused, batch: GroupBatch, plan: StepPlan) -> Dict[str, float]:
    """One extra step per path under tools/memory_probe.py: bytes held for backward (saved
    activations, plus the prefix cache for reuse; not the allocator's peak)."""
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.runtime.step import ReuseStep

    _zero(fused)
    dense = memory_probe.measure_dense(fused, lambda: dense_step(fused, batch, LOSS))
    _zero(local)
    reuse = memory_probe.measure_reuse(
        local, ReuseStep(batch, plan), lambda step: reuse_step(local, batch, plan, LOSS, step=step))
    _zero(local)
    _zero(fused)
    return {"dense_peak_saved_bytes": dense.peak_saved_bytes,
            "reuse_peak_saved_bytes": reuse.peak_saved_bytes,
            "reuse_suffix_phase_peak_bytes": reuse.suffix_phase_peak_bytes,
            "reuse_cache_bytes": reuse.cache_peak_bytes,
            "suffix_phase_reduction": 1 - reuse.suffix_phase_peak_bytes / dense.peak_saved_bytes,
            "basis": MEMORY_BASIS}


def _megatron_layout() -> Dict[str, int]:
    """The parallel sizes Megatron actually ran with (the JSON's `layout`)."""
    from megatron.core import parallel_state as ps

    return {"pp": ps.get_pipeline_model_parallel_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def run_bench(config: BenchConfig, raw_times: Optional[Dict[str, List[float]]] = None) -> dict:
    """Run the benchmark; return the result dict that `--json` writes.

    `raw_times`, if given, receives every timed step's seconds per path (for the table's spread).
    """
    dims = config.model_dims()
    threads = max(1, config.threads // config.world_size)
    batch = make_batch(config)
    ideal = ideal_speedup(dims, batch, _plan(config, batch))
    placement = config.placement(batch)
    if config.world_size == 1:
        torch.set_num_threads(config.threads)
        measured = _measure(config)
    else:
        from megatron_patches.launch import launch

        measured = launch(_measure, world_size=config.world_size, args=(config, True),
                          timeout_s=config.timeout, threads_per_rank=threads)[0]
    times = measured.pop("times")
    if raw_times is not None:
        raw_times.update(times)
    median = {name: statistics.median(values) for name, values in times.items()}
    speedup = median["dense"] / median["reuse"]
    result = {
        "dense_seconds": median["dense"],
        "stock_dense_seconds": median.get("stock_dense"),
        "reuse_seconds": median["reuse"],
        "speedup": speedup,
        "ideal_speedup": ideal,
        "ideal_speedup_basis": IDEAL_BASIS,
        "efficiency": speedup / ideal,
        **measured,
        "model": {name: getattr(dims, name) for name in (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "vocab_size", "gated_linear_unit")},
        "workload": {name: getattr(config, name) for name in (
            "prefix_len", "suffix_len", "group_size", "num_groups")},
        "token_budget": config.token_budget,
        "prefix_chunk_tokens": config.prefix_chunk_tokens,
        "threads": config.threads,
        "threads_per_rank": threads,
        "steps": config.steps,
    }
    if placement is not None:
        result["placement"] = placement.describe()
    return result


def format_table(result: dict, raw_times: Optional[Dict[str, List[float]]] = None) -> str:
    """A short human-readable summary of a result dict (with min/max per path if given times)."""
    w, m, lay = result["workload"], result["model"], result["layout"]
    raw_times = raw_times or {}

    def row(label: str, name: str) -> str:
        if result[f"{name}_seconds"] is None:
            return f"{label:<30}{'skipped':>12}"
        values = raw_times.get(name)
        spread = f"{min(values):>10.4f}{max(values):>10.4f}" if values else ""
        return f"{label:<30}{result[name + '_seconds']:>12.4f}{spread}"

    world = lay["pp"] * lay["tp"] * lay["dp"]
    lines = [
        f"workload: {w['num_groups']} groups x {w['group_size']} trajectories, prefix "
        f"{w['prefix_len']}, suffix {w['suffix_len']}, token budget {result['token_budget']}"
        + (f", prefix chunks of <= {result['prefix_chunk_tokens']} tokens"
           if result["prefix_chunk_tokens"] else ""),
        f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, ffn {m['ffn_hidden_size']}, "
        f"heads {m['num_attention_heads']}/{m['num_query_groups']} kv, vocab {m['vocab_size']}; "
        f"{result['threads']} threads, median of {result['steps']} steps",
        f"layout: pp {lay['pp']} x tp {lay['tp']} x dp {lay['dp']} = {world} process(es), "
        f"{result['threads_per_rank']} thread(s) each; attention backend "
        f"{result['attention_backend']}",
        *([result["placement"]] if "placement" in result else []),
        f"{'fwd+bwd seconds' + (' (slowest rank)' if world > 1 else ''):<30}"
        f"{'median':>12}{'min':>10}{'max':>10}",
        row("dense (fused SDPA)", "dense"),
        row("stock dense (local, unfused)", "stock_dense"),
        row("reuse", "reuse"),
        f"speedup {result['speedup']:.3f}x  ideal {result['ideal_speedup']:.3f}x (whole-batch "
        f"FLOPs)  efficiency {result['efficiency']:.3f}",
        f"loss dense {result['loss_dense']:.6f}  reuse {result['loss_reuse']:.6f}  "
        f"max grad rel diff vs stock dense {result['max_grad_rel_diff']:.2e}",
        _memory_line(result["memory"]),
    ]
    return "\n".join(lines)


def _memory_line(memory: Optional[dict]) -> str:
    if memory is None:
        return "held-for-backward memory: not measured with several processes"
    mib = 2.0 ** 20
    return (f"held-for-backward MiB: dense peak {memory['dense_peak_saved_bytes'] / mib:.1f}, "
            f"reuse peak {memory['reuse_peak_saved_bytes'] / mib:.1f}, reuse suffix phase "
            f"{memory['reuse_suffix_phase_peak_bytes'] / mib:.1f} "
            f"({-100 * memory['suffix_phase_reduction']:+.0f}% vs dense), cache "
            f"{memory['reuse_cache_bytes'] / mib:.1f}")


def _field_docs() -> Dict[str, str]:
    """BenchConfig's attribute docstrings (the --help text of each flag)."""
    tree = ast.parse(Path(__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BenchConfig").body
    return {a.target.id: " ".join(d.value.value.split()) for a, d in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr)
            and isinstance(d.value, ast.Constant)}


def parse_args(argv=None) -> tuple[BenchConfig, Optional[Path]]:
    """Command line -> (BenchConfig, JSON output path or None); ValueError on bad values."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults, docs = BenchConfig(), _field_docs()
    special = ("skip_stock", "token_budget", "prefix_chunk_tokens", "attention_backend")
    for field in dataclasses.fields(BenchConfig):
        if field.name not in special:
            p.add_argument("--" + field.name.replace("_", "-"), type=int,
                           default=getattr(defaults, field.name), help=docs.get(field.name))
    p.add_argument("--token-budget", type=int, default=None, help=docs["token_budget"])
    p.add_argument("--prefix-chunk-tokens", type=int, default=None,
                   help=docs["prefix_chunk_tokens"])
    p.add_argument("--attention-backend", default=defaults.attention_backend,
                   choices=(attention_backends.AUTO,) + attention_backends.BACKEND_NAMES,
                   help=docs["attention_backend"])
    p.add_argument("--skip-stock", action="store_true", help=docs["skip_stock"])
    p.add_argument("--json", type=Path, default=None, help="write the result dict here")
    args = vars(p.parse_args(argv))
    out = args.pop("json")
    return BenchConfig(**args), out


def main(argv=None) -> int:
    try:
        config, out = parse_args(argv)
        config.model_dims()
        config.placement(make_batch(config))  # e.g. fewer trajectories than DP ranks
        # a backend that cannot run here, with the reason (models sit where build_model puts them)
        _selected_backend(config, "cuda" if torch.cuda.is_available() else "cpu")
    except ValueError as exc:
        print(f"bench.py: error: {exc}", file=sys.stderr)
        return 2
    from megatron_patches.launch import LaunchError

    raw_times: Dict[str, List[float]] = {}
    try:
        result = run_bench(config, raw_times)
    except LaunchError as exc:  # every rank's traceback and output tail
        print(f"bench.py: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    print(format_table(result, raw_times))
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
