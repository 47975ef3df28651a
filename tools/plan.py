"""Plan, validate, lower and simulate one prefix-reuse step; compare with dense 1F1B.

    python tools/plan.py --pp 4 --groups 3 --suffix-microbatches 4 --mix
    python tools/plan.py --pp 4 --groups 2 --suffix-microbatches 3,5 --prefix-tokens 2048 \\
        --microbatch-tokens 4096 --rows 4 --png plan.png --chrome-trace plan.json --save plan.csv
    python tools/plan.py --pp 4 --groups 2 --suffix-microbatches 4 --prefix-tokens 4096 \\
        --microbatch-tokens 1024 --prefix-chunk-tokens 1024
    python tools/plan.py --pp 4 --vpp 2 --groups 2 --suffix-microbatches 4

Prints the per-rank grid, validates it, lowers it (p2p grouped into exchanges), simulates the
lowered plan under NCCL semantics and prints makespan, bubble fraction and peak memory next to a
dense plan of the same trajectories (every row recomputing its prompt): Megatron's 1F1B, or with
`--vpp V` (V model chunks per rank, virtual stages) Megatron's interleaved 1F1B. Costs are unit
(forward 1, backward 2) unless --prefix-tokens is given. `--prefix-chunk-tokens N` runs each
prefix as chunks of at most N tokens (PF/PB indices are then prefix units, listed with their
group and chunk). `--load CSV` runs a saved plan instead of generating one (the shape arguments
must describe the same step, and --pp/--vpp its layout). Bad arguments or files end with a
message and exit status 2 (arguments) or 1 (files, invalid plans), never a traceback.
The PNG (matplotlib) has one row per rank: PF blue, SF green, SB orange, PB purple, labelled with
the group (prefix unit) / microbatch index; a legend sits below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# This checkout first, even where another one is installed (`pip install -e .` of a sibling).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/outputs.py

from prefix_schedule.pipeline import (ActionKind, Schedule, ScheduleError,  # noqa: E402
                                      build_schedule, format_grid, lower, simulate,
                                      validate_schedule)
from prefix_schedule.pipeline.baselines import (Comparison, TokenCostModel,  # noqa: E402
                                                compare_with_dense)
from prefix_schedule.pipeline.simulate import SimResult, chrome_trace  # noqa: E402
from prefix_schedule.pipeline.units import chunk_spans, number_units  # noqa: E402

COLOURS = {ActionKind.PREFIX_FORWARD: "#4278dc", ActionKind.SUFFIX_FORWARD: "#46aa5a",
           ActionKind.SUFFIX_BACKWARD: "#eb8c32", ActionKind.PREFIX_BACKWARD: "#9650be"}


def _count(minimum: int):
    """argparse type: an int >= minimum (argparse turns the ValueError into a usage error)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError(text)
        return value
    parse.__name__ = f"int >= {minimum}"
    return parse


def _counts(text: str) -> list[int]:
    """argparse type: one int >= 1 or a comma list of them."""
    values = [int(x) for x in text.split(",")]
    if min(values) < 1:
        raise ValueError(text)
    return values


_counts.__name__ = "comma list of ints >= 1"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=_count(1), required=True, help="pipeline ranks")
    parser.add_argument("--vpp", type=_count(1), default=1,
                        help="model chunks per rank (virtual pipeline stages; needs --pp >= 2)")
    parser.add_argument("--groups", type=_count(1), required=True, help="groups in the step")
    parser.add_argument("--suffix-microbatches", type=_counts, required=True,
                        help="suffix microbatches per group: one int, or a comma list per group")
    parser.add_argument("--mix", action="store_true",
                        help="consecutive groups share their boundary microbatch")
    parser.add_argument("--no-prefix", default="",
                        help="comma list of groups without a cached prefix")
    parser.add_argument("--prefix-tokens", type=_count(1), help="cached prefix tokens per group "
                        "(switches to token costs)")
    parser.add_argument("--prefix-chunk-tokens", type=_count(1), help="run each prefix as "
                        "chunks of at most this many tokens (needs --prefix-tokens)")
    parser.add_argument("--microbatch-tokens", type=_count(1), default=4096,
                        help="suffix tokens per microbatch (token costs)")
    parser.add_argument("--rows", type=_count(1), default=4,
                        help="trajectory rows per microbatch")
    parser.add_argument("--png", type=Path, help="write a timeline PNG")
    parser.add_argument("--chrome-trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    parser.add_argument("--save", type=Path, help="save the compute-only plan as CSV")
    parser.add_argument("--load", type=Path, help="run this CSV plan instead of generating one")
    args = parser.parse_args(argv)
    if args.vpp > 1 and args.pp < 2:
        parser.error("--vpp > 1 needs --pp >= 2 (Megatron interleaves only pipelines of >= 2 "
                     "ranks)")
    if args.prefix_chunk_tokens is not None and args.prefix_tokens is None:
        parser.error("--prefix-chunk-tokens needs --prefix-tokens (chunks are cut in tokens)")
    counts = args.suffix_microbatches
    if len(counts) not in (1, args.groups):
        parser.error(f"--suffix-microbatches needs one count or {args.groups} (one per group), "
                     f"got {len(counts)}")
    try:
        args.no_prefix = {int(x) for x in args.no_prefix.split(",") if x.strip()}
    except ValueError:
        parser.error(f"--no-prefix: expected a comma list of group ids, got {args.no_prefix!r}")
    if not args.no_prefix <= set(range(args.groups)):
        parser.error(f"--no-prefix names groups {sorted(args.no_prefix - set(range(args.groups)))}"
                     f" but the step has groups 0..{args.groups - 1}")
    _check_size(parser, args)
    _check_outputs(parser, args)
    return args


MAX_PP = 1024
MAX_CELLS = 50_000
"""The largest plan this tool builds: pipeline stages x (suffix microbatches + prefix units).
Planning, simulating and printing grow faster than linearly in it (about a minute and 1 GB at
the limit on one CPU core); beyond it the tool would run for hours or exhaust memory."""


def _check_size(parser, args) -> None:
    if args.pp > MAX_PP:
        parser.error(f"--pp {args.pp}: this tool plans pipelines of up to {MAX_PP:,} ranks")
    counts = list(args.suffix_microbatches)
    microbatches = (sum(counts) if len(counts) > 1 else counts[0] * args.groups)
    chunks = 1
    if args.prefix_chunk_tokens is not None:
        chunks = -(-args.prefix_tokens // args.prefix_chunk_tokens)
    units = (args.groups - len(args.no_prefix)) * chunks
    cells = args.pp * args.vpp * (microbatches + units)
    if cells > MAX_CELLS:
        parser.error(f"--pp {args.pp} x --vpp {args.vpp} stages x ({microbatches:,} suffix "
                     f"microbatches + {units:,} prefix units) = {cells:,} plan cells; this tool "
                     f"plans up to {MAX_CELLS:,} (about a minute and 1 GB): give fewer --groups, "
                     "--suffix-microbatches or stages (a larger --prefix-chunk-tokens)")


def _check_outputs(parser, args) -> None:
    """The output files can be written, before any planning (tools/outputs.py)."""
    from outputs import check_output

    inputs = [args.load] if args.load else []
    for flag in ("png", "chrome_trace", "save"):
        try:
            check_output(getattr(args, flag), "--" + flag.replace("_", "-"), inputs=inputs)
        except ValueError as error:
            parser.error(str(error))


def shape_from_args(args) -> tuple[list[tuple[int, ...]], list[int]]:
    """(microbatch_groups, prefix_groups) described by the command line."""
    counts = list(args.suffix_microbatches)
    if len(counts) == 1:
        counts *= args.groups
    microbatches: list[tuple[int, ...]] = []
    for group, count in enumerate(counts):
        for k in range(count):
            if args.mix and k == 0 and microbatches:  # boundary microbatch holds both groups
                microbatches[-1] += (group,)
            else:
                microbatches.append((group,))
    return microbatches, [g for g in range(args.groups) if g not in args.no_prefix]


def prefix_units(args, prefix_groups) -> tuple[dict | None, dict | None]:
    """(unit -> (group, chunk), unit -> tokens) with --prefix-chunk-tokens, else (None, None)."""
    if args.prefix_chunk_tokens is None:
        return None, None
    spans = chunk_spans(args.prefix_tokens, args.prefix_chunk_tokens)
    units = number_units({g: len(spans) for g in prefix_groups})
    return units, {u: spans[c][1] for u, (_, c) in units.items()}


def cost_model(args, microbatches, prefix_groups, unit_tokens=None) -> TokenCostModel | None:
    if args.prefix_tokens is None:
        return None
    rows = []
    for groups in microbatches:  # split the rows evenly, the first groups take the remainder
        share, extra = divmod(args.rows, len(groups))
        rows.append({g: share + (i < extra) for i, g in enumerate(groups)})
    return TokenCostModel(prefix_tokens={g: args.prefix_tokens for g in prefix_groups},
                          microbatch_rows=rows, suffix_tokens=[args.microbatch_tokens] * len(rows),
                          unit_tokens=unit_tokens)


def load_plan(args) -> Schedule:
    """The --load CSV, refused (SystemExit, status 1) if unreadable, malformed or on another
    layout than --pp/--vpp."""
    try:
        plan = Schedule.from_csv(args.load.read_text())
    except OSError as error:
        raise SystemExit(f"--load {args.load}: cannot read it ({error.strerror})")
    except ValueError as error:  # ScheduleError: a malformed cell or header
        raise SystemExit(f"--load {args.load}: not a schedule CSV: {str(error).splitlines()[0]}")
    if (plan.num_ranks, plan.num_model_chunks) != (args.pp, args.vpp):
        raise SystemExit(f"--load {args.load}: the plan has {plan.num_ranks} rank rows x "
                         f"{plan.num_model_chunks} model chunk(s) but --pp {args.pp} --vpp "
                         f"{args.vpp} were given; pass the layout the plan was made for")
    return plan


def main(argv=None) -> int:
    args = parse_args(argv)
    microbatches, prefix_groups = shape_from_args(args)
    units, unit_tokens = prefix_units(args, prefix_groups)
    costs = cost_model(args, microbatches, prefix_groups, unit_tokens)
    if args.load:
        plan = load_plan(args)
    else:
        plan = build_schedule(num_stages=args.pp * args.vpp, num_model_chunks=args.vpp,
                              microbatch_groups=microbatches, prefix_groups=prefix_groups,
                              cost=costs.cost if costs else None, prefix_units=units)
    print(f"microbatch groups: {microbatches}\nprefix groups: {prefix_groups}")
    if units is not None:
        print("prefix units: " + " ".join(f"u{u}=g{g}c{c}[{unit_tokens[u]}]"
                                          for u, (g, c) in units.items()))
    print()
    print(format_grid(plan))
    try:
        validate_schedule(plan, microbatch_groups=microbatches, prefix_groups=prefix_groups,
                          prefix_units=units)
        lowered = lower(plan, cost=costs.cost if costs else None)
        result = simulate(lowered, cost=costs.cost if costs else None,
                          memory=costs.memory if costs else None)
    except ScheduleError as error:
        print(f"\nINVALID: {error}")
        return 1
    num_exchanges = sum(a.kind is ActionKind.EXCHANGE for row in lowered.actions for a in row)
    print(f"\nvalid; lowered to {sum(map(len, lowered.actions))} actions ({num_exchanges} "
          "grouped exchanges); simulated under NCCL semantics without deadlock, every receive "
          "matched to its send in posting order")
    try:
        comparison = compare_with_dense(plan, num_microbatches=len(microbatches), costs=costs)
    except ValueError as error:  # Megatron would not interleave this many microbatches
        print(report(Comparison(plan=result, dense=None), costs, args.vpp))
        print(f"no dense baseline: {error}")
    else:
        print(report(comparison, costs, args.vpp))
    if args.save:
        args.save.write_text(plan.to_csv())
    if args.chrome_trace:
        args.chrome_trace.write_text(chrome_trace(result))
    if args.png:
        write_timeline(args.png, result)
    return 0


def report(comparison, costs, vpp: int = 1) -> str:
    unit = ("unit costs: forward 1, backward 2; memory: live prefix 2, microbatch 1\n(dense "
            "microbatches cost as much as suffix ones here; --prefix-tokens for real sizes)"
            if costs is None else "token costs (memory in token-activation units)")
    dense = "dense 1F1B" if vpp == 1 else "dense interl."
    lines = [f"\n{unit}:", f"{'':14}{'makespan':>12}{'bubble':>8}{'idle/rank':>12}{'peak mem':>12}"]
    for name, result in (("prefix reuse", comparison.plan), (dense, comparison.dense)):
        if result is None:
            continue
        idle = sum(result.idle) / len(result.idle)
        lines.append(f"{name:14}{result.makespan:>12,.0f}{result.bubble_fraction:>8.3f}"
                     f"{idle:>12,.1f}{max(result.peak_memory):>12,.0f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- PNG (matplotlib)
def write_timeline(path: Path, result: SimResult) -> None:
    """One row per rank, a box per compute action coloured by kind and labelled with its index
    (group, prefix unit or microbatch) where it fits; idle time light grey; a legend below."""
    tools = str(Path(__file__).resolve().parent)  # benchlib, however this script was loaded
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from benchlib.plotting import panels, save

    num = len(result.timeline)
    fig, (ax,) = panels(1)
    fig.set_size_inches(min(16.0, 4.0 + result.makespan / 4), 1.2 + 0.45 * num)
    for rank, row in enumerate(result.timeline):
        ax.barh(rank, result.makespan, left=0, height=0.8, color="#ebebeb")
        for timed in row:
            if not timed.action.kind.is_compute:
                continue
            width = timed.end - timed.start
            ax.barh(rank, width, left=timed.start, height=0.8, edgecolor="white", linewidth=0.5,
                    color=COLOURS[timed.action.kind])
            if width >= result.makespan / 80:  # a label only where it can fit
                ax.text(timed.start + width / 2, rank, str(timed.action.index), ha="center",
                        va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(num), [f"rank {r}" for r in range(num)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (cost units)")
    ax.set_title(f"makespan {result.makespan:,.0f}, bubble {result.bubble_fraction:.3f}",
                 fontsize=10)
    handles = [_legend_patch(colour, kind.value) for kind, colour in COLOURS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if num < 4 else -0.2),
              ncol=len(handles), fontsize=8, frameon=False)
    save(fig, path)


def _legend_patch(colour: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=colour, label=label)


if __name__ == "__main__":
    sys.exit(main())
