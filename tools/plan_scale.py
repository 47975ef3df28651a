"""Planner scale benchmark: generate, validate, lower and NCCL-simulate one big step's plan.

    python tools/plan_scale.py                      # 4,096 groups at PP=8, 1-4 microbatches each
    python tools/plan_scale.py --groups 1200 --pp 4 --microbatches-per-group 2 --vpp 2

Prints, per configuration, the actions in the plan and the seconds each stage took (CPU time
of this process, so other load on the machine counts less, fastest of --repeat runs; wall time
in brackets). The issue's
target: generate + lower + validate of 4,096 groups at PP=8 under 2 s. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_schedule.pipeline import (build_schedule, lower, number_units,  # noqa: E402
                                      simulate, validate_schedule)


def step_shape(groups: int, per_group: int, mix: bool) -> list[tuple[int, ...]]:
    """`per_group` suffix microbatches per group; with `mix` consecutive groups share one."""
    microbatches: list[tuple[int, ...]] = []
    for g in range(groups):
        for k in range(per_group):
            if mix and k == 0 and microbatches:
                microbatches[-1] += (g,)
            else:
                microbatches.append((g,))
    return microbatches


REPEAT = 1


def timed(fn):
    """(fn(), CPU seconds, wall seconds): the fastest of REPEAT runs (a loaded machine only ever
    makes a run slower)."""
    best = None
    for _ in range(REPEAT):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        run = (time.process_time() - cpu, time.perf_counter() - wall)
        best = run if best is None or run < best else best
    return (out, *best)


def run(groups: int, pp: int, vpp: int, per_group: int, chunks: int, mix: bool,
        simulate_too: bool) -> None:
    mbs = step_shape(groups, per_group, mix)
    units = number_units({g: chunks for g in range(groups)}) if chunks > 1 else None
    rules = dict(microbatch_groups=mbs, prefix_groups=range(groups), prefix_units=units)
    plan, t_gen, w_gen = timed(lambda: build_schedule(num_stages=pp * vpp,
                                                      num_model_chunks=vpp, **rules))
    _, t_val, w_val = timed(lambda: validate_schedule(plan, **rules))
    lowered, t_low, w_low = timed(lambda: lower(plan))
    total, wall = t_gen + t_val + t_low, w_gen + w_val + w_low
    line = (f"groups={groups} pp={pp} vpp={vpp} mb/group={per_group} chunks={chunks} "
            f"mix={int(mix)}: {len(mbs)} microbatches, {sum(map(len, plan.actions))} compute / "
            f"{sum(map(len, lowered.actions))} lowered actions | generate {t_gen:.2f} "
            f"validate {t_val:.2f} lower {t_low:.2f} = {total:.2f} s [{wall:.2f}]"
            f"{'  (< 2 s)' if total < 2 else '  (OVER 2 s)'}")
    if simulate_too:
        _, t_sim, w_sim = timed(lambda: simulate(lowered, p2p="nccl"))
        line += f" | NCCL simulate {t_sim:.2f} s [{w_sim:.2f}]"
    print(line, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4096)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--microbatches-per-group", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prefix-chunks", type=int, default=1, help="chunks per prefix")
    parser.add_argument("--mix", action="store_true", help="neighbouring groups share one")
    parser.add_argument("--no-simulate", action="store_true", help="skip the NCCL dry run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per stage; the fastest counts")
    args = parser.parse_args(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    _, loop, _ = timed(lambda: [None for _ in range(10_000_000)])
    print(f"machine reference: a 10M-item list comprehension took {loop:.2f} s CPU "
          "(compare runs on different machines or loads by this)")
    for per_group in args.microbatches_per_group:
        run(args.groups, args.pp, args.vpp, per_group, args.prefix_chunks, args.mix,
            not args.no_simulate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
