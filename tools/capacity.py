"""Longest trajectory that fits one GPU, dense vs prefix reuse, from the accounting model.

    python tools/capacity.py --model llama3-8b --memory-gib 80 --group-size 2
    python tools/capacity.py --model qwen3-8b --memory-gib 80 --group-size 8 --tp 2 --prefix-share 0.9
    python tools/capacity.py --model llama3-8b --memory-gib 80 --frontier docs/capacity/frontier.png
    python tools/capacity.py --model nemotron-h-8b --memory-gib 80 --group-size 8 --prefix-share 0.9

Models: the paper's, the GDN hybrids (Qwen3-Next / Qwen3.5) and Nemotron-H (a HybridModel
pattern of Mamba-2, attention without RoPE and squared-ReLU MLPs); tools/capacity_specs.py maps a
spec to the accounting model's shape and counts its parameters layer by layer.

Per GPU (the heaviest pipeline stage), with the assumptions printed beside every result:
* static: bf16 weights (2 B / parameter), fp32 main gradients (4 B), Adam under Megatron's
  distributed optimizer (fp32 master weights and two moments, 12 B, sharded over --dp; expert
  parameters over --dp / --ep); parameters / TP (experts / (TP x EP)); --reserve-gib for the
  CUDA context, communication buffers and fragmentation;
* activations: prefix_schedule/planning/memory_model.py ([Note: predicted device memory]) in
  bf16: what the model's layers save for backward, the prefix cache's K/V and fp32 gK/gV,
  dormant prefix activations (on the device, in host memory with offload, none with full
  recompute), Phase C's working set; TP shards every term (sequence parallelism), CP every
  row's tokens but not the cache: a CP rank keeps the whole prefix's gathered K/V and fp32
  gK/gV (Phase C's reduce-scatter buffer, after the suffix phase, is not added); a pipeline's
  first stage holds PP microbatches (1F1B), its last the loss;
* the workload: one group of --group-size trajectories of T tokens, the first
  --prefix-share x T shared; `--pack group` (default; the paper's comparison): a microbatch holds
  the group -- dense its G full rows, reuse the prefix once and the G suffixes; `--pack
  trajectory`: one trajectory per microbatch (dense one row, reuse one suffix);
* each path picks what fits best at equal memory: dense recompute none or full; reuse none,
  offload or full recompute, each with prefix chunks (whole, or halves down to 1/64 of the
  prefix and >= 16 tokens).
Every reuse option is exact vs dense (docs/DESIGN.md "Memory"). `capacity_ratio` = longest
reuse trajectory / longest dense trajectory, each path at its best.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Callable, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from argtypes import (fraction, int_at_most, non_negative_float, positive_float,  # noqa: E402
                      positive_int)
from capacity_specs import (Layout, check_modelled, dims_of, rotary_percent_of,  # noqa: E402
                            static_bytes)
from outputs import check_output, write_text_atomic  # noqa: E402
from megatron_patches.models.model_configs_mla import MLA_MODELS  # noqa: E402
from megatron_patches.models.model_configs import (HYBRID_MODELS, MODELS,  # noqa: E402
                                                   NEMOTRON_MODELS, PAPER_MODELS, ModelSpec)
from prefix_schedule.planning.flops_layers import ATTENTION  # noqa: E402
from prefix_schedule.planning.memory_model import (ActivationModel, MemoryOptions,  # noqa: E402
                                                   dense_peak_bytes, reuse_phase_peaks)
from prefix_schedule.planning.planner import (PrefixWork, Segment, StepPlan,  # noqa: E402
                                              SuffixMicrobatch)

__all__ = ["Layout", "MAX_GROUP_SIZE", "activation_models", "capacity", "check_modelled",
           "dims_of", "longest", "main", "static_bytes"]

GIB = 1024 ** 3
CHOICES = {"tiny": "llama3-8b-tiny", **{name: name for name in PAPER_MODELS},
           **{name: name for group in (HYBRID_MODELS, NEMOTRON_MODELS) for name in group}}
REUSE_OPTIONS = (MemoryOptions(), MemoryOptions(offload=True), MemoryOptions(recompute="full"))
MIN_CHUNK = 16
MAX_CHUNKS = 64  # prefix chunks tried: halves of the prefix down to 1/64 of it, >= 16 tokens
MAX_GROUP_SIZE = 1024
"""Largest group modelled (GRPO uses 2-128): the work grows with it (10**7 took 271 s)."""


def activation_models(spec: ModelSpec, layout: Layout, act_bytes: int) -> List[ActivationModel]:
    """The first stage (PP microbatches in flight) and, with PP > 1, the last (the loss)."""
    stage = spec.num_layers // layout.pp
    common = dict(dims=dims_of(spec), act_bytes=act_bytes, qk_norm=spec.qk_norm, tp=layout.tp,
                  rotary_percent=rotary_percent_of(spec), stage_layers=stage)
    first = ActivationModel(**common, head=layout.pp == 1, in_flight=layout.pp)
    return [first] if layout.pp == 1 else \
        [first, ActivationModel(**common, head=True, first_layer=spec.num_layers - stage)]


def _split(T: int, share: float, cp: int) -> tuple:
    prefix = min(T - 1, max(2, round(share * T)))
    return -(-prefix // cp), -(-(T - prefix) // cp)


def _group_plan(P: int, n: int, G: int, pack: str, chunk: Optional[int]) -> StepPlan:
    segments = [Segment(group=0, trajectory=t, row_start=(t * n if pack == "group" else 0),
                        length=n, cached_len=P - 1) for t in range(G)]
    rows = [segments] if pack == "group" else [[s] for s in segments]
    return StepPlan(microbatches=[SuffixMicrobatch(index=i, segments=r) for i, r in enumerate(rows)],
                    prefixes=[PrefixWork(group=0, length=P - 1)],
                    token_budget=max(sum(s.length for s in r) for r in rows),
                    prefix_chunk_tokens=chunk)


def dense_peak(models, T: int, G: int, pack: str, recompute: str, cp: int) -> float:
    row = -(-(T - 1) // cp)
    return max(dense_peak_bytes(m, [G * row] if pack == "group" else [row] * G, recompute)
               for m in models)


def reuse_peak(models, T: int, G: int, pack: str, option: MemoryOptions, share: float,
               cp: int) -> tuple:
    """(smallest predicted peak over the prefix chunkings, the chunk size that gives it)."""
    P, n = _split(T, share, cp)
    whole = _split(T, share, 1)[0] - 1  # cached tokens of the whole prefix
    best = None
    chunk: Optional[int] = None
    while True:
        plan = _group_plan(P, n, G, pack, chunk)
        peak = max(reuse_phase_peaks(m, plan, option)["step"] + _cp_cache_extra(m, P - 1, whole)
                   for m in models)
        if best is None or peak < best[0]:
            best = (peak, chunk)
        chunk = -(-(P - 1) // 2) if chunk is None else chunk // 2
        if chunk < max(MIN_CHUNK, (P - 1) / MAX_CHUNKS):
            return best


def _cp_cache_extra(model, local: int, whole: int) -> float:
    """What a CP rank's cache holds beyond a non-CP step of its `local` cached tokens
    ([Note: CP prefix cache] in runtime/cache.py): the gathered K/V of the `whole` prefix, which
    suffix reads return, and fp32 gK/gV for every token of it (0 without CP)."""
    if whole <= local:
        return 0.0
    return model.num_mixers(ATTENTION) * (model.kv_copy() * whole + model.gkv() * (whole - local))


def longest(fits: Callable[[int], bool], limit: int = 1 << 24, low: int = 4) -> int:
    """Largest T in [low, limit] with fits(T) (0 if none), assuming fits is monotone."""
    if not fits(low):
        return 0
    lo, hi = low, 2 * low
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _shortest_reuse(share: float, cp: int) -> int:
    """The shortest trajectory whose prefix leaves every CP rank a cached token (P >= 2)."""
    T = 4
    while _split(T, share, cp)[0] < 2:
        T += 1
    return T


def _check_sizes(memory_gib: float, group_size: int, prefix_share: float,
                 reserve_gib: float) -> None:
    if not 0 < prefix_share < 1:
        raise ValueError(f"prefix_share={prefix_share}; give a fraction in (0, 1)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or \
            not 1 <= group_size <= MAX_GROUP_SIZE:
        raise ValueError(f"group_size={group_size!r}; give an int in [1, {MAX_GROUP_SIZE:,}] (the "
                         "model builds a plan with one segment per trajectory, many times over)")
    if not (math.isfinite(memory_gib) and memory_gib > 0):
        raise ValueError(f"memory_gib={memory_gib}; give the GPU's memory as a number > 0")
    if not (math.isfinite(reserve_gib) and reserve_gib >= 0):
        raise ValueError(f"reserve_gib={reserve_gib}; give a number >= 0")


def capacity(spec: ModelSpec, *, memory_gib: float, group_size: int, prefix_share: float,
             layout: Layout = Layout(), pack: str = "group", act_bytes: int = 2,
             reserve_gib: float = 4.0) -> dict:
    """Longest trajectory per path and option, and the capacity ratio (module docstring)."""
    _check_sizes(memory_gib, group_size, prefix_share, reserve_gib)
    static = static_bytes(spec, layout)
    free = memory_gib * GIB - reserve_gib * GIB - sum(static.values())
    result = {"model": spec.name, "memory_gib": memory_gib, "group_size": group_size,
              "prefix_share": prefix_share, "pack": pack, "layout": dataclasses.asdict(layout),
              "static_gib": {k: v / GIB for k, v in static.items()},
              "activation_budget_gib": free / GIB, "dense": {}, "reuse": {}}
    if free <= 0:
        result["capacity_ratio"] = result["capacity_ratio_plain"] = None
        return result
    models = activation_models(spec, layout, act_bytes)
    G, cp = group_size, layout.cp
    for recompute in ("none", "full"):
        result["dense"][recompute] = longest(
            lambda T: dense_peak(models, T, G, pack, recompute, cp) <= free)
    for option in REUSE_OPTIONS:
        refusal = models[0].refusal(option) or (
            "recompute='full' with context parallelism: prefix reuse refuses it "
            "(runtime/executor.py); use offload or no recompute"
            if option.recompute == "full" and cp > 1 else None)
        if refusal:  # full recompute with CP
            result["reuse"][option.describe()] = {"trajectory": 0, "prefix_chunk_tokens": None,
                                                  "refused": refusal}
            continue
        T = longest(lambda T: reuse_peak(models, T, G, pack, option, prefix_share, cp)[0] <= free,
                    low=_shortest_reuse(prefix_share, cp))
        chunk = reuse_peak(models, T, G, pack, option, prefix_share, cp)[1] if T else None
        result["reuse"][option.describe()] = {"trajectory": T, "prefix_chunk_tokens": chunk}
    dense = max(result["dense"].values())
    reuse = max(r["trajectory"] for r in result["reuse"].values())
    result["capacity_ratio"] = reuse / dense if dense else None
    plain = result["reuse"][MemoryOptions().describe()]["trajectory"]
    result["capacity_ratio_plain"] = plain / result["dense"]["none"] if result["dense"]["none"] \
        else None  # no offload, no recompute on either path
    return result


def assumptions(layout: Layout, act_bytes: int, reserve_gib: float, pack: str) -> str:
    return (f"assumptions: {'bf16' if act_bytes == 2 else 'fp32'} activations and weights, fp32 "
            f"main grads, Adam with Megatron's distributed optimizer over DP={layout.dp} "
            f"(TP={layout.tp}, PP={layout.pp}, CP={layout.cp}, EP={layout.ep}, sequence "
            f"parallel), {reserve_gib:g} GiB reserved; activations per "
            "prefix_schedule/planning/memory_model.py (Megatron local-spec layers, flash-style "
            "attention, no s^2 term; Gated DeltaNet mixers as fla-core 0.6.0 saves, "
            "memory_model_gdn.py; Mamba-2 mixers as mamba-ssm 2.3.2 saves, "
            f"memory_model_mamba.py); one group per step, packed per {pack}; each path at its "
            "best: dense recompute none or full, reuse none / offload / full recompute with "
            "prefix chunks")


def format_result(r: dict) -> str:
    s = r["static_gib"]
    lines = [f"{r['model']} on {r['memory_gib']:g} GiB, G={r['group_size']}, prefix share "
             f"{r['prefix_share']:g}: static {sum(s.values()):.1f} GiB (weights {s['weights']:.1f}, "
             f"grads {s['grads']:.1f}, optimizer {s['optimizer']:.1f}), activations "
             f"{r['activation_budget_gib']:.1f} GiB"]
    if r["capacity_ratio"] is None and not r["dense"]:
        return lines[0] + "\n  nothing fits: raise --dp, --tp or --pp"
    G = r["group_size"]
    for name, T in r["dense"].items():
        lines.append(f"  dense, recompute {name:<21}: T = {T:>7}  ({G * T} tokens per group)")
    for name, v in r["reuse"].items():
        if v.get("refused"):
            lines.append(f"  reuse, {name:<31}: refused ({v['refused']})")
            continue
        chunk = f", prefix chunks <= {v['prefix_chunk_tokens']}" if v["prefix_chunk_tokens"] else ""
        lines.append(f"  reuse, {name:<31}: T = {v['trajectory']:>7}  ({G * v['trajectory']} "
                     f"tokens per group{chunk})")
    ratio = r["capacity_ratio"]
    plain = r["capacity_ratio_plain"]
    lines.append(f"  capacity_ratio (best reuse / best dense): "
                 f"{'n/a' if ratio is None else f'{ratio:.2f}'}; without offload or recompute on "
                 f"either path: {'n/a' if plain is None else f'{plain:.2f}'}")
    return "\n".join(lines)


def frontier(spec: ModelSpec, path: str, shares, group_sizes, **kw) -> List[dict]:
    """capacity_ratio over prefix share x group size, as a PNG (benchlib/plotting.py)."""
    from benchlib.progress import Progress

    points = [(g, s) for g in group_sizes for s in shares]
    rows = []
    with Progress(len(points), name="frontier", unit="point") as progress:
        for g, s in points:
            rows.append(capacity(spec, group_size=g, prefix_share=s, **kw))
            progress.step()
    plot_frontier(rows, path, title=f"{spec.name}, {kw['memory_gib']:g} GiB")
    return rows


def plot_frontier(rows: List[dict], path: str, *, title: str) -> None:
    """Two panels (each path at its best; no offload, no recompute): capacity_ratio vs prefix
    share, one line per group size."""
    from benchlib.plotting import line_chart, panels, save

    fig, axes = panels(2)
    group_sizes = sorted({r["group_size"] for r in rows})
    for ax, (key, what) in zip(axes, (("capacity_ratio", "each path at its best"),
                                      ("capacity_ratio_plain", "no offload, no recompute"))):
        line_chart(ax, title=f"{title}: {what}", xlabel="prefix share",
                   ylabel="capacity ratio (reuse / dense)", markers=True,
                   series={f"G={g}": ([r["prefix_share"] for r in rows if r["group_size"] == g],
                                      [r[key] for r in rows if r["group_size"] == g])
                           for g in group_sizes})
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(CHOICES) + sorted(MLA_MODELS))
    p.add_argument("--memory-gib", type=positive_float, default=80.0)
    p.add_argument("--group-size", type=int_at_most(MAX_GROUP_SIZE, "the work grows with it"),
                   nargs="+", default=[2])
    p.add_argument("--prefix-share", type=fraction, nargs="+", default=[0.5, 0.75, 0.9])
    for name, default in (("tp", 1), ("pp", 1), ("dp", 8), ("cp", 1), ("ep", 1)):
        p.add_argument(f"--{name}", type=positive_int, default=default)
    p.add_argument("--pack", choices=("group", "trajectory"), default="group")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--reserve-gib", type=non_negative_float, default=4.0)
    p.add_argument("--frontier", metavar="PNG", help="plot capacity_ratio over --prefix-share x "
                   "--group-size instead of printing")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        check_output(args.json, "--json")
        check_output(args.frontier, "--frontier")
    except ValueError as exc:
        p.error(str(exc))
    if args.model in MLA_MODELS:
        p.error(f"{args.model}: multi-latent attention is not modelled by the capacity tool (its "
                "memory model counts GQA K/V; an MLA layer caches heads x (qk_head_dim + "
                "qk_pos_emb_head_dim) K and heads x v_head_dim V per token, docs/DESIGN.md "
                "'MLA'); it refuses rather than cost MLA as GQA")
    spec = MODELS[CHOICES[args.model]]
    try:
        check_modelled(spec)
    except ValueError as exc:
        p.error(str(exc))
    layout = Layout(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, ep=args.ep)
    bad = [f"--{k}={v}" for k, v in dataclasses.asdict(layout).items() if v < 1]
    heads = spec.linear_num_key_heads if spec.is_gdn else spec.mamba_num_groups or args.tp
    if bad or spec.num_layers % args.pp or spec.num_query_groups % args.tp or \
            heads % args.tp or (args.dp * args.cp) % args.ep:
        p.error(f"layout {layout}: sizes >= 1, --pp dividing {spec.num_layers} layers, --tp "
                f"dividing {spec.num_query_groups} K/V heads (and the GDN key heads or Mamba "
                "groups), --ep dividing --dp x --cp")
    if (spec.is_gdn or spec.is_nemotron_h) and args.cp > 1:
        p.error("Gated DeltaNet / Mamba-2 layers with --cp > 1: prefix reuse refuses context "
                "parallelism for them (runtime/gdn_hooks.py, mamba_hooks.py); use --cp 1")
    if any(g < 1 for g in args.group_size) or not all(0 < s < 1 for s in args.prefix_share):
        p.error("--group-size >= 1 and --prefix-share in (0, 1)")
    kw = dict(memory_gib=args.memory_gib, layout=layout, pack=args.pack,
              act_bytes=2 if args.dtype == "bf16" else 4, reserve_gib=args.reserve_gib)
    print(assumptions(layout, kw["act_bytes"], args.reserve_gib, args.pack))
    if args.frontier:
        rows = frontier(spec, args.frontier, args.prefix_share, args.group_size, **kw)
        for r in rows:
            print(f"G={r['group_size']:<3} share {r['prefix_share']:<5g} capacity_ratio "
                  f"{r['capacity_ratio'] or float('nan'):.2f} (without offload or recompute "
                  f"{r['capacity_ratio_plain'] or float('nan'):.2f})")
        print(f"wrote {args.frontier}")
    else:
        rows = [capacity(spec, group_size=g, prefix_share=s, **kw)
                for g in args.group_size for s in args.prefix_share]
        print("\n".join(format_result(r) for r in rows))
    if args.json:
        import json

        write_text_atomic(args.json, json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
