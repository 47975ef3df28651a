"""The framework adapter's host overhead per step: `PrefixReuseAdapter.prepare` (detection,
policy, planning, the step's build; no model run) on a synthetic rollout of `--groups` groups x
`--group-size` sequences (a `--prefix-len` prompt + `--suffix-len` response each), with the
bench model's shape (tools/benchlib: the same function `tools/bench.py --adapter` reports as
`adapter_overhead_seconds`). Prints the median of `--repeats` runs in wall seconds and this
process's CPU seconds per run (less sensitive to other jobs on a shared machine); `--profile`
adds cProfile's top functions by cumulative time.

`--checkout DIR` imports prefix_schedule / megatron_patches / benchlib from another checkout
of this repository (e.g. main, for a before/after on one machine); default: this one.

    python tools/adapter_overhead.py                       # 512 x 16, the issue's size
    python tools/adapter_overhead.py --checkout /path/to/main --repeats 3
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    for name in ("groups", "group_size", "prefix_len", "suffix_len", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (args.checkout / "prefix_schedule").is_dir():
        parser.error(f"--checkout {args.checkout}: no prefix_schedule/ there")
    return args


def _cpu_of_prepare() -> list:
    """This process's CPU seconds of each `PrefixReuseAdapter.prepare` call from now on."""
    from megatron_patches.frameworks import PrefixReuseAdapter
    prepare, seconds = PrefixReuseAdapter.prepare, []

    def timed(self, rollout):
        start = time.process_time()
        try:
            return prepare(self, rollout)
        finally:
            seconds.append(time.process_time() - start)
    PrefixReuseAdapter.prepare = timed
    return seconds


def main(argv=None) -> int:
    args = _args(argv)
    sys.path[:0] = [str(args.checkout), str(args.checkout / "tools")]
    import megatron_patches
    megatron_patches.enable_cpu_support()  # before megatron.core loads (a no-op with CUDA)
    megatron_patches.install()
    from benchlib.adapter_bench import adapter_overhead
    from benchlib.config import BenchConfig
    from benchlib.models import model_shape
    from megatron_patches.models.tiny import build_model, initialize_single_process
    initialize_single_process(seed=0)
    config = BenchConfig(prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    model = build_model(model_shape(config))
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    cpu = _cpu_of_prepare()
    seconds = adapter_overhead(num_groups=args.groups, group_size=args.group_size,
                               prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                               model=model, repeats=args.repeats)
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    print(f"adapter overhead: {seconds:.3f} s per step (median of {args.repeats}; CPU "
          f"{statistics.median(cpu):.3f} s) at "
          f"{args.groups} groups x {args.group_size}, prefix {args.prefix_len}, suffix "
          f"{args.suffix_len}; checkout {args.checkout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
