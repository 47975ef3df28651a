"""The predictor against measured speedups: docs/sweep/sweep.csv rows and bench points.

Every point is re-planned as its run planned it (the FLOP-model policy, or one group's suffixes
per microbatch / the bench's token budget), costed on the device (a measured CPU file for this
machine's runs) and compared by speedup: error = predicted / measured - 1. Nothing here is
fitted to the measured points: the device's numbers come from the microbenchmark alone.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.predict.devices import DeviceSpec
from prefix_schedule.predict.roofline import Layout
from prefix_schedule.predict.step import predict_step

from predictlib.workload import dense_rows, parse_dims, plan_for, rank_share, synthetic_batch

__all__ = ["SWEEP_COLUMNS", "BENCH_COLUMNS", "validate", "summarize"]

SWEEP_COLUMNS = ("prefix", "suffix", "group_size", "num_groups", "policy_on", "model",
                 "cpu_speedup", "microbatches")
BENCH_COLUMNS = ("name", "tp", "pp", "vpp", "cp", "ep", "dp", "dense_tp", "dense_pp", "dense_cp",
                 "dense_dp", "model", "num_experts", "topk", "prefix", "suffix", "group_size",
                 "num_groups", "token_budget", "dense_rows_per_mb", "measured")


def _read(path, columns) -> list:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist; give a sweep CSV (docs/sweep/sweep.csv) "
                         "or a bench-points CSV (docs/predict/bench_points.csv)")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    missing = sorted(set(columns) - set(rows[0] if rows else ()))
    if not rows or missing:
        raise ValueError(f"{str(path)!r} has no rows or lacks columns {missing}; expected "
                         f"{', '.join(columns)}")
    return rows


def _sweep_point(dev: DeviceSpec, row: dict) -> dict:
    dims = parse_dims(row["model"])
    batch = synthetic_batch(prefix_len=int(row["prefix"]), suffix_len=int(row["suffix"]),
                            group_size=int(row["group_size"]), num_groups=int(row["num_groups"]))
    plan = plan_for(batch, dims, policy=row["policy_on"] == "True")
    pred = predict_step(dev, dims, Layout(), plan, dense_rows(batch), optimizer=False)
    name = (f"sweep {row['prefix']}/{row['suffix']} G={row['group_size']} "
            f"policy {'on' if row['policy_on'] == 'True' else 'off'}")
    return _row(name, "sweep", pred.dense.step_s, pred.reuse.step_s, float(row["cpu_speedup"]),
                plan_matches=len(plan.microbatches) == int(row["microbatches"]),
                measured_ideal=float(row["ideal"]) if row.get("ideal") else None)


def _bench_dims(row: dict) -> ModelDims:
    dims = parse_dims(row["model"])
    if int(row["num_experts"]):
        import dataclasses
        dims = dataclasses.replace(dims, num_experts=int(row["num_experts"]),
                                   moe_router_topk=int(row["topk"]))
    return dims


def _bench_point(dev: DeviceSpec, row: dict) -> dict:
    dims = _bench_dims(row)
    batch = synthetic_batch(prefix_len=int(row["prefix"]), suffix_len=int(row["suffix"]),
                            group_size=int(row["group_size"]), num_groups=int(row["num_groups"]))
    seconds = {}
    for path, prefix in (("reuse", ""), ("dense", "dense_")):
        lay = Layout(tp=int(row[prefix + "tp"]), pp=int(row[prefix + "pp"]),
                     vpp=int(row["vpp"]), cp=int(row[prefix + "cp"]),
                     ep=int(row["ep"]), dp=int(row[prefix + "dp"]))
        share = rank_share(batch, lay.dp)
        plan = plan_for(share, dims, policy=False, token_budget=int(row["token_budget"]),
                        row_multiple=lay.tp)
        pred = predict_step(dev, dims, lay, plan, dense_rows(share, int(row["dense_rows_per_mb"])),
                            optimizer=False)
        seconds[path] = getattr(pred, path).step_s
    return _row(f"bench {row['name']}", "bench", seconds["dense"], seconds["reuse"],
                float(row["measured"]))


def _row(name, source, dense_s, reuse_s, measured, **extra) -> dict:
    predicted = dense_s / reuse_s
    return dict(name=name, source=source, predicted_dense_s=dense_s, predicted_reuse_s=reuse_s,
                predicted_speedup=predicted, measured_speedup=measured,
                error=predicted / measured - 1, **extra)


def summarize(rows: list) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"points": len(rows), "median_abs_error": statistics.median(errors),
            "max_abs_error": max(errors)}


def validate(dev: DeviceSpec, sweep_csv, bench_csv=None) -> dict:
    """Predict every point; the summary over all and per source, and every row."""
    rows = [_sweep_point(dev, r) for r in _read(sweep_csv, SWEEP_COLUMNS)]
    if bench_csv:
        rows += [_bench_point(dev, r) for r in _read(bench_csv, BENCH_COLUMNS)]
    by_source = {s: summarize([r for r in rows if r["source"] == s])
                 for s in dict.fromkeys(r["source"] for r in rows)}
    misses = [r["name"] for r in rows if abs(r["error"]) > 0.10]
    return dict(summarize(rows), by_source=by_source, misses=misses, device=dev.to_json(),
                rows=rows)
