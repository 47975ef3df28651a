"""Where an MoE reuse step's time goes, by CPU time (steady on a loaded machine).

Builds the bench's models (tools/benchlib, `--num-experts 8 --moe-router-topk 2` and the bench's
default workload unless given other bench flags), then runs dense one row per microbatch, dense
in the reuse plan's packing and reuse interleaved, `--repeats` times after one warm-up each, and
prints per path the minimum thread CPU time (time.thread_time: with `--threads 1` all compute
is on this thread), speedups and efficiencies against the FLOP model, and the inclusive CPU time
and call count of the MoE pieces (MoE layer stages, SequentialMLP, the routing wrapper and our
statistics in it) and of the reuse phases. docs/BENCHMARKS.md "MoE" has a run.

    python tools/moe_profile.py [--repeats 3] [--threads 1] [bench flags, e.g. --token-budget 1024]
"""
from __future__ import annotations

import collections
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from benchlib.config import build_parser, config_from_args  # noqa: E402

CPU = collections.defaultdict(float)
CALLS = collections.Counter()


def _timed(owner, name: str, label: str) -> None:
    stock = getattr(owner, name)

    @functools.wraps(stock)
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return stock(*args, **kwargs)
        finally:
            CPU[label] += time.thread_time() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def _instrument() -> None:
    from megatron.core.transformer.moe import experts, moe_layer, router

    import megatron_patches.runtime.moe as moe
    from megatron_patches.runtime import stage_runner

    for name in ("route", "preprocess", "dispatch", "routed_experts_compute", "combine",
                 "postprocess"):
        _timed(moe_layer.MoELayer, name, f"MoELayer.{name}")
    _timed(experts.SequentialMLP, "forward", "SequentialMLP.forward")
    _timed(router.TopKRouter, "routing", "TopKRouter.routing (with the reuse wrapper)")
    _timed(moe, "_prefix_routing", "reuse: prefix router statistics")
    _timed(moe, "_suffix_routing", "reuse: suffix router statistics")
    for name in ("prefix_forward", "suffix_forward", "suffix_backward", "prefix_backward"):
        _timed(stage_runner.StageRunner, name, f"reuse phase {name}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    repeats = 3
    if "--repeats" in argv:
        at = argv.index("--repeats")
        repeats = int(argv[at + 1])
        del argv[at:at + 2]
    if "--num-experts" not in argv:
        argv += ["--num-experts", "8", "--moe-router-topk", "2"]
    if "--threads" not in argv:  # thread_time sees this thread only
        argv += ["--threads", "1"]
    config, _ = config_from_args(build_parser(__doc__), argv + ["--skip-stock"])
    torch.set_num_threads(config.threads)
    from benchlib.measure import LOSS, _dense_run, config_batch, config_plan, selected_backend
    from benchlib.models import build_models, zero
    from benchlib.steps import dense_step, reuse_step
    from prefix_schedule.planning.flops import ideal_speedup

    local, fused = build_models(config, False)
    batch = config_batch(config)
    plan = config_plan(config, batch)
    selected_backend(config)
    packed = _dense_run(config, plan)
    ideal = ideal_speedup(config.model_dims(), batch, plan)
    runs = {"dense (1 row/mb)": lambda: dense_step(fused, batch, LOSS),
            "dense (plan's packing)": lambda: packed(fused, batch),
            "reuse": lambda: reuse_step(local, batch, plan, LOSS)}
    for run in runs.values():
        zero(local), zero(fused), run()
    _instrument()
    seconds = {name: [] for name in runs}
    pieces = {}
    for _ in range(repeats):
        for name, run in runs.items():
            zero(local), zero(fused)
            CPU.clear(), CALLS.clear()
            start = time.thread_time()
            run()
            seconds[name].append(time.thread_time() - start)
            pieces[name] = (dict(CPU), dict(CALLS))
    print(f"threads {config.threads}, token budget {config.token_budget}, ideal {ideal:.3f}x; "
          f"thread CPU seconds per step, min of {repeats}")
    for name, values in seconds.items():
        print(f"{name:<24} {min(values):8.3f}   all: {' '.join(f'{v:.3f}' for v in values)}")
        cpu, calls = pieces[name]
        for label in sorted(cpu, key=lambda k: -cpu[k]):
            print(f"    {label:<44} {cpu[label]:8.3f} s  {calls[label]:4d} calls")
    for name in list(runs)[:2]:
        speedup = min(seconds[name]) / min(seconds["reuse"])
        print(f"{name} / reuse: {speedup:.3f}x, efficiency {speedup / ideal:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
