"""Predict dense vs prefix-reuse step time and memory for a model, a layout and a GPU.

    python tools/predict.py --model qwen3-8b --gpus 16 --gpu h20 --prefix-len 10240 \
        --suffix-len 2048 --group-size 16 --groups 16                 # best layout per path
    python tools/predict.py --model qwen3-8b --gpus 16 --gpu h20 --tp 2 --pp 2 --trace T.jsonl
    python tools/predict.py --validate docs/sweep/sweep.csv --json out.json     # vs measured
    python tools/predict.py --paper --json paper.json --png-dir docs/predict    # the paper's grid

Costs come from a roofline per op (prefix_schedule/predict/roofline.py) on a device: one of
the GPUs in prefix_schedule/predict/devices.py (public specs + stated efficiency assumptions),
or a device file that tools/predict_bench.py measured (`--device-file`; on a GPU
tools/gpu_check.py writes one). Each action of the lowered schedule is costed and the NCCL dry
run plays them (pipeline bubble included); both paths pay the same optimizer step. Memory per
rank: static (tools/capacity.py) + activations (planning/memory_model.py). docs/PREDICT.md
says what it models, what it does not, and where it was checked.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout first
sys.path.insert(0, str(ROOT / "tools"))

from argtypes import int_at_most, positive_int  # noqa: E402
from outputs import check_output, check_output_dir  # noqa: E402
from prefix_schedule.predict import Layout, get_device, load_device  # noqa: E402
from predictlib.report import Workload, format_result, predict_layout, search  # noqa: E402
from predictlib.workload import parse_dims, synthetic_batch  # noqa: E402

__all__ = ["main", "DEFAULT_CPU_DEVICE", "allowed_cps", "LIMITS"]

LIMITS = {"prefix-len": 1 << 20, "suffix-len": 1 << 20, "group-size": 1024, "groups": 4096,
          "gpus": 1 << 17}
"""The largest sizes predicted: planning and costing grow with the step's tokens and
microbatches (a 10**7 group took 15.7 GB, a 10**9-token prefix ran for hours)."""
MAX_STEP_TOKENS = 1 << 26
"""Tokens in one step, all groups (--groups x (--prefix-len + --group-size x --suffix-len))."""

TRAINERS = {"megatron-lm": "the Megatron-LM entry point / ReuseStep (CP for attention models)",
            "adapter": "the framework adapter (verl, Megatron-RL train_rl): CP=1 only"}

DEFAULT_CPU_DEVICE = ROOT / "docs" / "predict" / "cpu-device.json"
DEFAULT_BENCH_POINTS = ROOT / "docs" / "predict" / "bench_points.csv"


def _model(name: str):
    """(ModelDims, ModelSpec or None) for a registry name or LxHxFxAxGxV."""
    import capacity
    if name in capacity.CHOICES:
        from megatron_patches.models.model_configs import MODELS
        spec = MODELS[capacity.CHOICES[name]]
        return capacity.dims_of(spec), spec
    if name in capacity.MLA_MODELS:
        raise ValueError(f"--model {name!r}: multi-latent attention is not modelled by the "
                         "predictor (its FLOP and memory models count GQA attention); it refuses "
                         "rather than cost MLA as GQA (docs/LIMITS.md, MLA)")
    if "x" in name:
        return parse_dims(name), None
    raise ValueError(f"--model {name!r}: choose one of {sorted(capacity.CHOICES)} or give "
                     "LAYERSxHIDDENxFFNxHEADSxKV_HEADSxVOCAB")


def _device(args):
    if args.device_file:
        return load_device(args.device_file)
    if args.gpu:
        return get_device(args.gpu)
    raise ValueError("give --gpu NAME (h20, h100, h200, a100, b200) or --device-file FILE")


def _cpu_device(path: Path, measure: bool):
    """The measured CPU device: the cached file, or a fresh microbenchmark written there."""
    if measure or not Path(path).is_file():
        import predict_bench
        result = predict_bench.measure_device("cpu", threads=1)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"measured this machine ({result['raw']['seconds']:.0f} s, load "
              f"{result['raw']['load_avg']:.1f}); wrote {path}")
    return load_device(path)


def _batch(args):
    if args.trace:
        from prefix_schedule.traces import read_steps
        for batch in read_steps(args.trace, start=args.trace_step, stop=args.trace_step + 1):
            return batch
        raise ValueError(f"--trace {args.trace}: no step {args.trace_step} in it")
    missing = [f"--{n}" for n in ("prefix-len", "suffix-len", "group-size")
               if getattr(args, n.replace("-", "_")) is None]
    if missing:
        raise ValueError(f"give --trace T or all of --prefix-len, --suffix-len, --group-size "
                         f"(missing {', '.join(missing)})")
    return synthetic_batch(prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                           group_size=args.group_size, num_groups=args.groups)


def allowed_cps(spec, trainer: str) -> tuple:
    """(the CP sizes the engine runs, why larger ones are refused): 1 only for recurrent layers
    (Gated DeltaNet, Mamba: megatron_patches/runtime/layers.py) and for the framework adapter
    (megatron_patches/frameworks/indexing.py); else 1, 2, 4."""
    if spec is not None and (spec.is_gdn or (spec.hybrid_layer_pattern or "").count("M")):
        return (1,), (f"{spec.name} has recurrent layers (Gated DeltaNet / Mamba), whose prefix "
                      "state prefix reuse does not split over context-parallel ranks")
    if trainer == "adapter":
        return (1,), "the framework adapter (verl, train_rl) runs context_parallel_size=1 only"
    return (1, 2, 4), ""


def _layout(args, cps=(1, 2, 4), why=""):
    given = {k: getattr(args, k) for k in ("tp", "pp", "vpp", "cp", "ep") if getattr(args, k)}
    if not given:
        return None
    lay = {**dict(tp=1, pp=1, vpp=1, cp=1, ep=1), **given}
    if lay["cp"] not in cps:
        raise ValueError(f"--cp {lay['cp']}: {why}; give --cp 1")
    per_replica = lay["tp"] * lay["pp"] * lay["cp"]
    if args.gpus % per_replica:
        raise ValueError(f"--gpus {args.gpus} is not a multiple of tp x pp x cp = {per_replica}")
    return Layout(dp=args.gpus // per_replica, **lay)


def predict(args) -> dict:
    dims, spec = _model(args.model)
    dev = _device(args)
    work = Workload(batch=_batch(args), policy=not args.no_policy, token_budget=args.token_budget,
                    dense_rows_per_microbatch=args.dense_rows_per_microbatch,
                    optimizer=not args.no_optimizer)
    cps, why = allowed_cps(spec, args.trainer)
    lay = _layout(args, cps, why)
    if lay is not None:
        result = predict_layout(dev, dims, lay, work, spec)
        print(format_result(result))
        return {"device": dev.to_json(), "result": result}
    found = search(dev, dims, args.gpus, work, spec, cps=cps)
    for path in ("dense", "reuse"):
        best = found[f"best_{path}"]
        print(f"best layout for {path}:" + (" none fits memory" if best is None else ""))
        if best is not None:
            print(format_result(best))
    if found["speedup_best"]:
        print(f"speedup, each path on its best layout: {found['speedup_best']:.2f}x")
    return dict(found, device=dev.to_json())


def run_validate(args) -> dict:
    from predictlib.validate import validate
    dev = load_device(args.device_file) if args.device_file and not args.measure else \
        _cpu_device(Path(args.device_file or DEFAULT_CPU_DEVICE), args.measure)
    bench = None if args.bench_points == "none" else args.bench_points
    result = validate(dev, args.validate, bench)
    for r in result["rows"]:
        print(f"{r['name']:<40s} predicted {r['predicted_speedup']:5.2f}x measured "
              f"{r['measured_speedup']:5.2f}x error {r['error']:+.1%}")
    print(f"{result['points']} points: median |error| {result['median_abs_error']:.1%}, worst "
          f"{result['max_abs_error']:.1%}; misses (> 10%): {', '.join(result['misses']) or 'none'}")
    if args.png_dir:
        from predictlib.plots import plot_validation
        print("wrote", plot_validation(result, args.png_dir))
    return result


def run_paper(args) -> dict:
    from megatron_patches.models.model_configs import MODELS
    from predictlib.paper import KNOWN_CAPACITY, paper_grid
    import capacity
    spec = MODELS["qwen3-8b"]
    dev = load_device(args.device_file) if args.device_file else get_device(args.gpu or "h20")
    sizes = tuple(args.paper_group_sizes) if args.paper_group_sizes else None
    kw = {"group_sizes": sizes} if sizes else {}
    rows = paper_grid(dev, capacity.dims_of(spec), spec, gpus=args.gpus or 16,
                      groups=args.groups if args.groups_given else 16, **kw)
    cap = [capacity.capacity(spec, memory_gib=dev.memory_gib, group_size=KNOWN_CAPACITY["group_size"],
                             prefix_share=s, layout=capacity.Layout(tp=2, pp=1, dp=8))
           for s in (1 / 6, 1 / 3, 1 / 2, 2 / 3, 5 / 6)]
    for r in rows:
        known = f"  paper {r['paper_speedup']:.3f}x, error {r['error']:+.1%}" if "paper_speedup" in r else ""
        print(f"{r['prefix']:>5}/{r['suffix']:<5} N={r['group_size']:<3} speedup "
              f"{r['speedup']:.2f}x{known}")
    result = {"device": dev.to_json(), "points": rows, "capacity": [
        {"prefix_share": c["prefix_share"], "capacity_ratio": c["capacity_ratio"]} for c in cap],
        "paper_capacity_ratio": KNOWN_CAPACITY["ratio"]}
    if args.png_dir:
        from predictlib.plots import plot_paper
        print("wrote", ", ".join(plot_paper(result, args.png_dir)))
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    import capacity
    p.add_argument("--model", help=f"{', '.join(sorted(capacity.CHOICES))}, or LxHxFxAxGxV")
    p.add_argument("--gpus", type=int_at_most(1 << 17, "layouts are searched over it"),
                   help="GPUs in the job (default 16 with --paper)")
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", help="h20, h100, h200, a100 or b200")
    dev.add_argument("--device-file", help="a measured device (tools/predict_bench.py --out)")
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int_at_most(1024, "a parallel size"),
                       help="fix the layout (none given: search)")
    p.add_argument("--trace", help="an RL trace (prefix_schedule/traces); one step is predicted")
    p.add_argument("--trace-step", type=int, default=0)
    limit = {name: int_at_most(value, "planning grows with it") for name, value in LIMITS.items()}
    p.add_argument("--prefix-len", type=limit["prefix-len"])
    p.add_argument("--suffix-len", type=limit["suffix-len"])
    p.add_argument("--group-size", type=limit["group-size"])
    p.add_argument("--groups", type=limit["groups"], default=None, help="groups per step, all DP ranks (default 1; --paper 16)")
    p.add_argument("--token-budget", type=positive_int, help="suffix microbatch tokens (default: the policy's)")
    p.add_argument("--trainer", choices=sorted(TRAINERS), default="megatron-lm",
                   help="which trainer runs the step: " + "; ".join(
                       f"{k}: {v}" for k, v in TRAINERS.items()))
    p.add_argument("--no-policy", action="store_true", help="plain reuse: never run a group dense")
    p.add_argument("--no-optimizer", action="store_true", help="leave out DP reduce + optimizer")
    p.add_argument("--validate", metavar="CSV", help="check against a sweep CSV (docs/sweep/sweep.csv)")
    p.add_argument("--bench-points", default=str(DEFAULT_BENCH_POINTS),
                   help="bench points checked with --validate ('none' to skip)")
    p.add_argument("--measure", action="store_true", help="rerun the CPU microbenchmark (--validate)")
    p.add_argument("--paper", action="store_true", help="the paper's grid beside its figures")
    p.add_argument("--paper-group-sizes", type=int, nargs="+", help="subset of N for --paper")
    p.add_argument("--png-dir", help="write plots here (matplotlib)")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON")
    p.add_argument("--dense-rows-per-microbatch", type=positive_int, default=1)
    args = p.parse_args(argv)
    args.groups_given = args.groups is not None
    args.groups = args.groups or 1
    _check_args(p, args)
    return p, args


def _check_args(p, args) -> None:
    """Usage errors before any work: sizes past the limits, flags without effect, outputs."""
    if args.png_dir and not (args.validate or args.paper):
        p.error("--png-dir is written by --validate and --paper only; drop it or add one of them")
    if None not in (args.prefix_len, args.suffix_len, args.group_size):
        tokens = args.groups * (args.prefix_len + args.group_size * args.suffix_len)
        if tokens > MAX_STEP_TOKENS:
            p.error(f"--groups {args.groups} x (--prefix-len {args.prefix_len} + --group-size "
                    f"{args.group_size} x --suffix-len {args.suffix_len}) = {tokens:,} tokens in "
                    f"the step; this tool predicts steps of up to {MAX_STEP_TOKENS:,}")
    try:
        check_output(args.json, "--json", inputs=[x for x in (args.validate, args.trace) if x])
        check_output_dir(args.png_dir, "--png-dir")
    except ValueError as error:
        p.error(str(error))


def main(argv=None) -> int:
    p, args = parse_args(argv)
    try:
        if args.validate:
            result = run_validate(args)
        elif args.paper:
            result = run_paper(args)
        else:
            if not args.model or not args.gpus:
                raise ValueError("give --model and --gpus (or --validate CSV, or --paper)")
            result = predict(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
