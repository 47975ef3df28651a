"""Dense vs prefix-reuse training step, side by side: same weights, same data.

Four paths time one forward+backward step each (gradients zeroed between steps, no optimizer):

- dense: stock Megatron dense schedule over full [prefix; suffix] rows, one row per microbatch,
  with the fused-SDPA core attention (`build_model(..., fused_attention=True)`): the fair
  baseline, since the reuse path's attention is fused too (the same CPU flash-kernel family).
- dense batched (`dense_batched` in the JSON): the same with several equal-length rows per
  microbatch (micro_batch_size > 1), as many as fit the token budget the reuse microbatches
  use (or --dense-micro-batch-size): dense and reuse at the same tokens per microbatch. Not
  timed when only one row fits (then it is the dense path).
- stock dense: the same with Megatron's local attention, which on CPU materialises the score
  matrix (unfused). It is the numerical reference: `max_grad_rel_diff` compares reuse with it.
- reuse: the prefix-reuse schedule on the local-spec model (the reuse hooks replace its core
  attention; `--attention-backend` picks their kernel, the JSON names the one used).

Every path gets the same --warmup untimed steps, then steps are interleaved (dense, batched,
stock, reuse, dense, ...) so machine noise hits the paths alike; the median per path is
reported. Each step is timed between synchronisations (CUDA events on a GPU; `timing` in the
JSON says which). The gradient check runs after timing (untimed). `ideal_speedup` is the analytic FLOP ratio of the actual plan
(prefix_schedule/planning/flops.py); `efficiency` = speedup / ideal_speedup. It can exceed 1: the FLOP
model counts matmuls only, and reuse also skips the prefix's per-token elementwise work (RoPE,
norms, activations) G-1 times. Interleaving evens out steady noise, not bursts from other jobs:
the table's min/max per path show how quiet the machine was.

Memory (`memory` in the JSON, single-process runs only; None with several processes): after
timing, one extra untimed step per path (fused dense, reuse) runs under tools/memory_probe.py,
which models the device bytes of the step (prefix_schedule/runtime/memory.py): saved-tensor
storages, each once, recompute inputs included, plus for reuse the prefix cache's K/V and fp32
gK/gV and offloaded activations once brought back; offloaded bytes count as host. Parameters,
gradients, optimizer state and transient temporaries are excluded. `reuse_suffix_phase_peak_bytes`
is the peak while suffix microbatches run forward or backward (`reuse_phase_peak_bytes` has the
peak of every action kind: PF, SF, SB, PB = Phase C); `suffix_phase_reduction` = 1 - that /
dense's whole-step peak (dense: one row per microbatch); `step_peak_reduction` = 1 - reuse's
whole-step peak / dense's.
`--offload-prefix-activations` offloads the reuse path's dormant prefix activations;
`--recompute` sets the same activation recompute on every path.

Parallel layouts: `--pp/--tp/--dp/--cp` start pp*tp*dp (or pp*tp*cp) processes on this machine
(one process, no subprocess, when all are 1), each with max(1, threads // world size) threads:
gloo on CPU; on a CUDA machine NCCL with one GPU per rank (`torch.cuda.set_device(LOCAL_RANK)`,
megatron_patches.support.launch.rank_backend; refused when there are fewer GPUs than ranks). Pipeline stages
use Megatron's 1F1B for dense (variable row lengths); DP ranks are Megatron-DDP-wrapped and each
runs its share from `prefix_schedule.planning.placement.place_groups`, dense and reuse on the same share.
A step's time is the slowest rank's (all-reduce MAX); `max_grad_rel_diff` is the max over ranks;
`ideal_speedup` stays the FLOP ratio of the whole batch (pipeline bubbles and DP imbalance are
what `efficiency` then shows). A rank's failure is reported with its traceback; `--timeout`
bounds the whole multi-process run.

    python tools/bench.py [--prefix-len 1024 --suffix-len 64 --group-size 8 --num-groups 2 ...]
    python tools/bench.py --pp 2 --json out.json
    python tools/bench.py --adapter generic   # through the framework adapter (benchlib/adapter_bench.py)
    .venv-frameworks/bin/python tools/bench.py --adapter verl   # verl's engine step (make test-frameworks)
    python tools/bench.py --adapter megatron-rl --timeout 3600  # Megatron-LM RL's train step
    python tools/bench.py --linear-attention-freq 4   # GDN hybrid, Qwen3.5 layout (benchlib/hybrid.py)
    python tools/bench.py --hybrid-pattern 'G*M-'     # HybridModel with GDN and Mamba-2 layers
    python tools/bench.py --linear-attention-freq 4 --tp 2   # hybrids run --pp/--tp/--dp too
    python tools/bench.py --hybrid-pattern 'G*|M-' --pp 2    # `|` marks the pipeline stages

Hybrid models (`--linear-attention-freq`, `--hybrid-pattern`; benchlib/hybrid.py) run the same
paths, one process or the --pp/--tp/--dp layouts and --production; the JSON's `model.stages`
lists the layers each pipeline stage built; --recompute full, --tree and --memory-budget-mib
run for both. Refused with the reason: --cp, --vpp, --num-experts, --adapter.

Exit status: 2 bad arguments, 1 a rank failed, 3 the untimed check saw a NaN or inf loss or
gradient difference (on the dense or the reuse side; printed), else 0.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

import torch

# This checkout's packages first: an installed (editable) prefix_schedule may be another checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, memory_probe, however run

from benchlib.config import BenchConfig, build_parser, config_from_args  # noqa: E402
from benchlib.measure import config_batch, selected_backend  # noqa: E402
from benchlib.report import check_failures, format_table, run_bench  # noqa: E402
from benchlib.workload import make_batch  # noqa: E402
from outputs import check_output, write_text_atomic  # noqa: E402

__all__ = ["BenchConfig", "make_batch", "run_bench", "format_table", "parse_args", "main"]


def parse_args(argv=None) -> tuple[BenchConfig, Path | None]:
    """Command line -> (BenchConfig, JSON output path or None); ValueError on bad values."""
    return config_from_args(build_parser(__doc__), argv)


def main(argv=None) -> int:
    try:
        config, out = parse_args(argv)
        check_output(out, "--json")  # before the run, not after it
        config.model_dims()
        config.placement(config_batch(config))  # e.g. fewer trajectories than DP ranks
        if config.cp > 1:
            config.cp_dense_placement(config_batch(config))
        # a backend that cannot run here, with the reason (models sit where build_model puts them)
        selected_backend(config, "cuda" if torch.cuda.is_available() else "cpu")
        if config.world_size > 1:  # NCCL on CUDA needs a GPU per rank (gloo on CPU)
            from megatron_patches.support.launch import rank_backend

            rank_backend("auto", config.world_size - 1, torch.cuda.device_count())
    except ValueError as exc:
        print(f"bench.py: error: {exc}", file=sys.stderr)
        return 2
    from megatron_patches.support.launch import LaunchError

    raw_times: Dict[str, List[float]] = {}
    if config.adapter is not None:  # the step through a framework adapter (docs/FRAMEWORKS.md)
        from benchlib.adapter_bench import format_adapter, run_adapter_bench
        try:
            result = run_adapter_bench(config, raw_times)
        except (ValueError, ImportError) as exc:
            print(f"bench.py: error: {exc}", file=sys.stderr)
            return 2
        print(format_adapter(result))
        if out is not None:
            import json
            out.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    try:
        result = run_bench(config, raw_times)
    except LaunchError as exc:  # every rank's traceback and output tail
        print(f"bench.py: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    print(format_table(result, raw_times))
    if out is not None:
        import json

        write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    failures = check_failures(result)
    for failure in failures:
        print(f"bench.py: error: numerical check failed: {failure}", file=sys.stderr)
    return 3 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
