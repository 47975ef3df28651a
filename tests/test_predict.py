"""The predictor (prefix_schedule/predict, tools/predict.py): bad input is refused, the roofline's
pieces match hand-computed values and reduce to the FLOP model on an ideal device, the step
prediction runs the schedule, and --validate writes its fields. No Megatron needed."""
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from prefix_schedule.planning.flops import ModelDims, ideal_speedup
from prefix_schedule.predict import GPUS, DeviceSpec, Layout, get_device, load_device, predict_step
from prefix_schedule.predict.roofline import (attention_cost, collective_cost, gemm_cost,
                                              layer_cost, pairs)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from predictlib.validate import validate  # noqa: E402
from predictlib.workload import dense_rows, parse_dims, plan_for, synthetic_batch  # noqa: E402
import predict as predict_cli  # noqa: E402
import predict_bench  # noqa: E402

DIMS = ModelDims(num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                 num_query_groups=2, vocab_size=128, gated_linear_unit=True)


def toy(**kw) -> DeviceSpec:
    base = dict(name="toy", gemm_peak=1e12, gemm_m_half=0.0, gemm_d_half=0.0,
                attention_efficiency=0.5, attention_backward_efficiency=0.25, attention_m_half=0.0,
                attention_backward_flops=2.5, memory_bandwidth=1e12, op_overhead_s=1e-6,
                intra_node_bandwidth=100.0, inter_node_bandwidth=10.0, link_latency_s=0.5,
                gpus_per_node=8)
    return DeviceSpec(**{**base, **kw})


def ideal_device() -> DeviceSpec:
    """Every FLOP at one rate, nothing else costs: the roofline must equal the FLOP model."""
    return toy(attention_efficiency=1.0, attention_backward_efficiency=1.0,
               attention_backward_flops=2.0, memory_bandwidth=1e30, op_overhead_s=0.0)


@pytest.mark.parametrize("field,value", [("gemm_peak", -1.0), ("gemm_peak", math.nan),
                                         ("memory_bandwidth", 0.0), ("op_overhead_s", -1e-6),
                                         ("dtype_bytes", 3), ("gpus_per_node", 0),
                                         ("attention_m_half", math.inf)])
def test_bad_device_fields_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        toy(**{field: value})


def test_gpu_table_is_data_with_sources():
    assert set(GPUS) == {"h20", "h100", "h200", "a100", "b200"}
    assert all(spec.sources and spec.sources[0].startswith("https://") for spec in GPUS.values())
    assert GPUS["h100"].gemm_peak == pytest.approx(989.4e12 * 0.75)
    assert GPUS["h20"].memory_bandwidth == pytest.approx(4.0e12 * 0.8)
    assert GPUS["h20"].attention_flops(1e9, False) == pytest.approx(148e12 * 0.55, rel=1e-6)
    with pytest.raises(ValueError, match="unknown GPU 'h21'"):
        get_device("h21")


def test_device_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_device(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_device(tmp_path / "bad.json")
    (tmp_path / "extra.json").write_text(json.dumps({"device": dict(toy().to_json(), speed=1)}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_device(tmp_path / "extra.json")
    (tmp_path / "skip.json").write_text(json.dumps({"predict_device": {"skipped": "time budget"}}))
    with pytest.raises(ValueError, match="did not run or failed"):
        load_device(tmp_path / "skip.json")
    (tmp_path / "ok.json").write_text(json.dumps({"predict_device": {"device": toy().to_json()}}))
    assert load_device(tmp_path / "ok.json") == toy()  # a gpu_check.py report works too


def test_layout_is_validated():
    with pytest.raises(ValueError, match="Layout.tp"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="ep=3"):
        Layout(ep=3, dp=2)
    with pytest.raises(ValueError, match="do not split"):
        Layout(pp=3).check_model(DIMS)
    with pytest.raises(ValueError, match="tp=4 does not divide"):
        Layout(tp=4).check_model(DIMS)
    with pytest.raises(ValueError, match="ep=2 needs a MoE model"):
        Layout(ep=2, dp=2).check_model(DIMS)


def test_gemm_by_hand():
    dev = toy()
    cost = gemm_cost(dev, 1000, 2000, 500)  # 2e9 FLOPs at 1e12; 7e6 bytes at 1e12 is faster
    assert cost.gemm == pytest.approx(2e-3) and cost.overhead == 1e-6
    skinny = gemm_cost(toy(memory_bandwidth=1e9), 1, 4096, 4096)  # bytes dominate: 2*(4096+4096^2+4096)
    assert skinny.gemm == pytest.approx(2 * (2 * 4096 + 4096 ** 2) / 1e9)
    half = gemm_cost(toy(gemm_m_half=1000.0), 1000, 2000, 500)  # half the peak at m = m_half
    assert half.gemm == pytest.approx(4e-3)


def test_attention_and_collectives_by_hand():
    assert pairs(3, 5) == 3 * 5 + 6
    cost = attention_cost(toy(), 2, 4, [(3, 5)], backward=False)
    assert cost.attention == pytest.approx(4 * 2 * 4 * 21 / (1e12 * 0.5))
    back = attention_cost(toy(), 2, 4, [(3, 5)], backward=True)
    assert back.attention == pytest.approx(2.5 * 4 * 2 * 4 * 21 / (1e12 * 0.25))
    ring = collective_cost(toy(), 300, 3, 3)  # (p-1)/p x bytes / bandwidth + (p-1) x latency
    assert ring.comm == pytest.approx(2 / 3 * 300 / 100 + 2 * 0.5)
    assert collective_cost(toy(), 300, 3, 16).comm == pytest.approx(2 / 3 * 300 / 10 + 1.0)
    assert collective_cost(toy(), 300, 1, 1).total == 0


def test_layer_gemm_flops_equal_the_flop_model():
    dev = ideal_device()
    cost = layer_cost(dev, DIMS, Layout(), [(10, 0)], backward=False)
    h, f, q, kv = 64, 160, 64, 32
    linear = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * f * 2 + 2 * f * h
    assert cost.gemm == pytest.approx(10 * linear / 1e12)
    assert cost.attention == pytest.approx(4 * q * pairs(10, 0) / 1e12)
    assert layer_cost(dev, DIMS, Layout(), [(10, 0)], backward=True).gemm == pytest.approx(2 * cost.gemm)


@pytest.mark.parametrize("prefix,suffix,group_size,groups", [(96, 32, 4, 2), (40, 80, 3, 1)])
def test_ideal_device_reproduces_the_flop_ideal(prefix, suffix, group_size, groups):
    batch = synthetic_batch(prefix_len=prefix, suffix_len=suffix, group_size=group_size,
                            num_groups=groups)
    plan = plan_for(batch, DIMS, policy=False)
    pred = predict_step(ideal_device(), DIMS, Layout(), plan, dense_rows(batch), optimizer=False)
    assert pred.speedup == pytest.approx(ideal_speedup(DIMS, batch, plan), rel=1e-9)
    assert set(pred.reuse.phases) == {"PF", "SF", "SB", "PB"} and set(pred.dense.phases) == {"SF", "SB"}


def test_pipeline_and_tp_are_costed():
    batch = synthetic_batch(prefix_len=256, suffix_len=32, group_size=4, num_groups=2)
    plan = plan_for(batch, DIMS, policy=False, token_budget=64, row_multiple=2)
    dev = GPUS["h100"]
    pp1 = predict_step(dev, DIMS, Layout(), plan, dense_rows(batch))
    pp2 = predict_step(dev, DIMS, Layout(pp=2, tp=2), plan, dense_rows(batch))
    assert pp1.reuse.bubble_fraction == 0 and pp2.reuse.bubble_fraction > 0
    assert pp2.reuse.cost.comm > 0 and pp1.reuse.cost.comm == 0  # DP=1, TP=1: no collectives
    assert pp1.speedup > 1
    with pytest.raises(ValueError, match="dense_rows"):
        predict_step(dev, DIMS, Layout(), plan, [])


def test_fit_curve_recovers_its_parameters():
    points = [(m, d, 100.0 * m / (m + 64) * d / (d + 256)) for m in (16, 64, 512, 4096)
              for d in (64, 256, 2048)]
    assert predict_bench.fit_curve(points) == pytest.approx((100.0, 64.0, 256.0))
    with pytest.raises(ValueError):
        predict_bench.fit_curve([(1, 1, 0.0)])


def _sweep_rows(tmp_path, count: int) -> Path:
    with open(ROOT / "docs" / "sweep" / "sweep.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["group_size"] in ("2", "4")][:count]
        fields = reader.fieldnames
    out = tmp_path / "sweep.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return out


def test_validate_writes_its_fields(tmp_path):
    dev = toy(memory_bandwidth=5e10, op_overhead_s=5e-6, gemm_peak=5e10,
              intra_node_bandwidth=1e10, inter_node_bandwidth=1e10, link_latency_s=5e-5)
    result = validate(dev, _sweep_rows(tmp_path, 3), ROOT / "docs" / "predict" / "bench_points.csv")
    assert {"points", "median_abs_error", "max_abs_error", "rows", "by_source", "misses",
            "device"} <= set(result)
    assert result["points"] == len(result["rows"]) == 3 + 6
    for row in result["rows"]:
        assert row["error"] == pytest.approx(row["predicted_speedup"] / row["measured_speedup"] - 1)
        assert math.isfinite(row["predicted_speedup"]) and row["predicted_speedup"] > 0
    assert all(r["plan_matches"] for r in result["rows"] if r["source"] == "sweep")
    assert result["max_abs_error"] == max(abs(r["error"]) for r in result["rows"])
    with pytest.raises(ValueError, match="lacks columns"):
        validate(dev, ROOT / "docs" / "predict" / "bench_points.csv")


def test_cli_refuses_bad_input(capsys, tmp_path):
    for argv, message in (
            (["--model", "gpt5", "--gpus", "8", "--gpu", "h100", "--prefix-len", "8",
              "--suffix-len", "8", "--group-size", "2"], "--model 'gpt5'"),
            (["--model", "qwen3-8b", "--gpus", "16", "--gpu", "h20"], "missing --prefix-len"),
            (["--model", "qwen3-8b", "--gpus", "16", "--gpu", "h20", "--tp", "3", "--prefix-len",
              "8", "--suffix-len", "8", "--group-size", "2"], "not a multiple of tp x pp x cp"),
            (["--model", "qwen3-8b", "--gpus", "16", "--gpu", "x1", "--prefix-len", "8",
              "--suffix-len", "8", "--group-size", "2"], "unknown GPU"),
            (["--model", "qwen3-8b", "--gpus", "16", "--prefix-len", "8", "--suffix-len", "8",
              "--group-size", "2"], "give --gpu NAME"),
            (["--validate", str(tmp_path / "none.csv"), "--device-file",
              str(tmp_path / "none.json")], "does not exist")):
        with pytest.raises(SystemExit):
            predict_cli.main(argv)
        assert message in capsys.readouterr().err


def test_cli_predicts_one_layout(tmp_path, capsys):
    out = tmp_path / "p.json"
    predict_cli.main(["--model", "4x256x688x8x2x2048", "--gpus", "2", "--gpu", "h100", "--pp", "2",
                      "--prefix-len", "512", "--suffix-len", "64", "--group-size", "4",
                      "--json", str(out)])
    result = json.loads(out.read_text())["result"]
    assert result["speedup"] > 1 and result["layout"]["pp"] == 2 and result["reuse"]["fits"]
    assert {"step_s", "phases", "bubble_fraction", "comm_share", "peak_gib"} <= set(result["reuse"])
    assert "speedup" in capsys.readouterr().out


def test_microbenchmark_quick_grid_makes_a_device(tmp_path):
    result = predict_bench.measure_device("cpu", repeats=1, quick=True)
    (tmp_path / "d.json").write_text(json.dumps(result))
    dev = load_device(tmp_path / "d.json")
    assert dev.dtype_bytes == 4 and dev.gemm_peak > 0 and dev.memory_bandwidth > 0
    assert dataclasses.asdict(dev)["sources"]


def test_cli_predicts_a_trace_step(tmp_path):
    from prefix_schedule.traces import TraceWriter
    from prefix_schedule.traces.format import TraceHeader
    from prefix_schedule.traces.synth import SynthConfig, synth_steps

    batch, _ = next(synth_steps(SynthConfig(kind="rag", steps=1, group_sizes=(4,), max_seq_len=256,
                                            vocab_size=128)))
    with TraceWriter(tmp_path / "t.jsonl", TraceHeader(vocab_size=128)) as writer:
        writer.write_step(batch, step=0)
    out = tmp_path / "p.json"
    predict_cli.main(["--model", "4x256x688x8x2x2048", "--gpus", "1", "--gpu", "a100",
                      "--tp", "1", "--trace", str(tmp_path / "t.jsonl"), "--json", str(out)])
    result = json.loads(out.read_text())["result"]
    assert result["microbatches"]["dense"] == sum(len(g.trajectories) for g in batch.groups)
    assert result["speedup"] > 1  # rag: 80-98% of every row is the shared prompt
