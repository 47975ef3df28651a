"""The predictor against measured speedups: docs/sweep/sweep.csv rows and bench points.

Every point is re-planned as its run planned it (the FLOP-model policy, or one group's suffixes
per microbatch / the bench's token budget), costed on the device (a measured CPU file for this
machine's runs) and compared by speedup: error = predicted / measured - 1. Nothing here is
fitted to the measured points: the device's numbers come from the microbenchmark alone.
"""
from __future__ import annotations

import csv
import math
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


class Cells:
    """One CSV row; each value read names the file, row and column when it is not what the
    column holds (a hand-edited or truncated CSV otherwise fails as "invalid literal for int()")."""

    def __init__(self, path, number: int, row: dict) -> None:
        self.path, self.number, self.row = path, number, row

    def _bad(self, column: str, what: str) -> ValueError:
        return ValueError(f"{self.path} row {self.number}, column {column!r}: "
                          f"{self.row.get(column)!r} is not {what}; fix or drop the row")

    def text(self, column: str) -> str:
        value = self.row.get(column)
        if value is None or not value.strip():
            raise self._bad(column, "given")
        return value

    def int(self, column: str, minimum: int = 1) -> int:
        try:
            value = int(self.text(column))
        except ValueError:
            raise self._bad(column, f"an integer >= {minimum}") from None
        if value < minimum:
            raise self._bad(column, f"an integer >= {minimum}")
        return value

    def positive(self, column: str) -> float:
        """A finite number > 0 (a speedup: 0 or NaN makes every error meaningless)."""
        try:
            value = float(self.text(column))
        except ValueError:
            raise self._bad(column, "a finite number > 0") from None
        if not (math.isfinite(value) and value > 0):
            raise self._bad(column, "a finite number > 0")
        return value

    def flag(self, column: str) -> bool:
        value = self.text(column)
        if value not in ("True", "False"):
            raise self._bad(column, "True or False (as tools/sweep.py writes it)")
        return value == "True"

    def dims(self, column: str = "model") -> ModelDims:
        try:
            return parse_dims(self.text(column))
        except ValueError as error:
            raise self._bad(column, f"a model LxHxFxAxGxV ({error})") from None


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
    return [Cells(path, number, row) for number, row in enumerate(rows, start=2)]


def _batch(row: Cells):
    return synthetic_batch(prefix_len=row.int("prefix"), suffix_len=row.int("suffix"),
                           group_size=row.int("group_size"), num_groups=row.int("num_groups"))


def _sweep_point(dev: DeviceSpec, row: Cells) -> dict:
    dims, policy, measured = row.dims(), row.flag("policy_on"), row.positive("cpu_speedup")
    batch = _batch(row)
    plan = plan_for(batch, dims, policy=policy)
    pred = predict_step(dev, dims, Layout(), plan, dense_rows(batch), optimizer=False)
    name = (f"sweep {row.text('prefix')}/{row.text('suffix')} G={row.text('group_size')} "
            f"policy {'on' if policy else 'off'}")
    return _row(name, "sweep", pred.dense.step_s, pred.reuse.step_s, measured,
                plan_matches=len(plan.microbatches) == row.int("microbatches"),
                measured_ideal=row.positive("ideal") if row.row.get("ideal") else None)


def _bench_dims(row: Cells) -> ModelDims:
    dims = row.dims()
    if row.int("num_experts", minimum=0):
        import dataclasses
        dims = dataclasses.replace(dims, num_experts=row.int("num_experts"),
                                   moe_router_topk=row.int("topk"))
    return dims


def _bench_point(dev: DeviceSpec, row: Cells) -> dict:
    dims, measured = _bench_dims(row), row.positive("measured")
    batch = _batch(row)
    seconds = {}
    for path, prefix in (("reuse", ""), ("dense", "dense_")):
        lay = Layout(tp=row.int(prefix + "tp"), pp=row.int(prefix + "pp"), vpp=row.int("vpp"),
                     cp=row.int(prefix + "cp"), ep=row.int("ep"), dp=row.int(prefix + "dp"))
        share = rank_share(batch, lay.dp)
        plan = plan_for(share, dims, policy=False, token_budget=row.int("token_budget"),
                        row_multiple=lay.tp)
        pred = predict_step(dev, dims, lay, plan,
                            dense_rows(share, row.int("dense_rows_per_mb")), optimizer=False)
        seconds[path] = getattr(pred, path).step_s
    return _row(f"bench {row.text('name')}", "bench", seconds["dense"], seconds["reuse"],
                measured)


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
