"""The predictor's microbenchmark: op throughputs of this machine (or a GPU) as a device file.

    python tools/predict_bench.py --out predict-device.json            # CPU, 1 thread, 3 repeats, ~25 s
    python tools/predict_bench.py --device cuda --out gpu-device.json  # what gpu_check.py runs

Measures, each the median over repeats (a shared machine is noisy: rerun, and pass the file you
trust with `tools/predict.py --device-file`):
- GEMM FLOP/s for m tokens x square d x d weights (m 32..2048, d 256 and 1024), fitted to the
  curve in prefix_schedule/predict/devices.py (peak, m_half, d_half);
- causal attention (torch SDPA, 8 heads, head dim 64) forward and forward+backward FLOP/s at
  128..2048 tokens, fitted the same way (efficiency vs the GEMM peak, m_half);
- memory bandwidth: an out-of-place add over 2M elements (3 x 4 bytes per element moved; 8 MB
  tensors, the size of the validated models' activations: a CPU's caches make smaller ones
  faster and larger ones slower; on a GPU 64M elements, beyond its L2);
- the fixed cost per op: a chain of tiny autograd ops, forward and backward.
Links (gloo p2p and collectives between processes on one machine) are not measured: the file
says so in `sources`, with memory bandwidth / 4 and 50 us latency assumed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first

__all__ = ["device_fields", "fit_curve", "measure_device", "main"]

ATTN_HEADS, ATTN_DIM = 8, 64
FULL = {"gemm_m": (32, 128, 512, 2048), "gemm_d": (256, 1024), "attn_s": (128, 512, 2048)}
QUICK = {"gemm_m": (32, 512), "gemm_d": (256,), "attn_s": (128, 512)}  # gpu_check --dry-run


def _timed(fn, sync, min_s: float = 0.1, max_reps: int = 7) -> float:
    """Median seconds of fn() over repeats (at least 3, until min_s has passed)."""
    fn()
    sync()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_curve(points, with_width: bool = True) -> tuple:
    """(peak, m_half, d_half) of FLOP/s = peak * m/(m+m_half) * d/(d+d_half) over points
    [(m, d, flops_per_s)], least squares in log space on a grid of halves."""
    if not points or any(p[2] <= 0 for p in points):
        raise ValueError("fit_curve needs points with positive throughput")
    halves = [0.0] + [2.0 ** e for e in range(0, 14)]
    best = None
    for mh in halves:
        for dh in (halves if with_width else [0.0]):
            logs = [math.log(f) - math.log(m / (m + mh)) - (math.log(d / (d + dh)) if dh else 0)
                    for m, d, f in points]
            peak = sum(logs) / len(logs)
            err = sum((x - peak) ** 2 for x in logs)
            if best is None or err < best[0] - 1e-12:
                best = (err, math.exp(peak), mh, dh)
    return best[1], best[2], best[3]


def _gemm_points(torch, device, dtype, sync, grid):
    out = []
    for d in grid["gemm_d"]:
        w = torch.randn(d, d, device=device, dtype=dtype)
        for m in grid["gemm_m"]:
            x = torch.randn(m, d, device=device, dtype=dtype)
            out.append((m, d, 2 * m * d * d / _timed(lambda: x @ w, sync)))
    return out


def _attention_points(torch, device, dtype, sync, grid):
    import torch.nn.functional as F
    fwd, bwd = [], []
    for s in grid["attn_s"]:
        q, k, v = (torch.randn(1, ATTN_HEADS, s, ATTN_DIM, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        flops = 4 * ATTN_HEADS * ATTN_DIM * s * (s + 1) / 2
        t_f = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sync)
        t_fb = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
                      .backward(), sync)
        fwd.append((s, 1, flops / t_f))
        bwd.append((s, 1, 2.5 * flops / max(t_fb - t_f, 1e-9)))
    return fwd, bwd


def _bandwidth(torch, device, dtype, sync) -> float:
    n = 1 << (26 if device.startswith("cuda") else 21)
    a, b = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device, dtype=dtype)
    c = torch.empty_like(a)
    return 3 * n * a.element_size() / _timed(lambda: torch.add(a, b, out=c), sync)


def _op_overhead(torch, device, sync) -> tuple:
    x = torch.ones(4, device=device, requires_grad=True)
    ops = 200

    def forward():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        return y

    t_f = _timed(forward, sync) / ops
    t_fb = _timed(lambda: forward().sum().backward(), sync) / ops
    return t_f, max(t_fb - t_f, 0.0)


def _raw_once(torch, device, dtype, sync, grid) -> dict:
    fwd, bwd = _attention_points(torch, device, dtype, sync, grid)
    op_f, op_b = _op_overhead(torch, device, sync)
    return {"gemm": _gemm_points(torch, device, dtype, sync, grid), "attention_forward": fwd,
            "attention_backward": bwd, "memory_bandwidth": _bandwidth(torch, device, dtype, sync),
            "op_forward_s": op_f, "op_backward_s": op_b}


def _median_raw(runs: list) -> dict:
    """Per measured point, the median over the repeats (the machine is shared and noisy)."""
    out = {}
    for key, first in runs[0].items():
        if isinstance(first, list):
            out[key] = [(*first[i][:2], statistics.median(r[key][i][2] for r in runs))
                        for i in range(len(first))]
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def device_fields(raw: dict, *, name: str, cuda: bool, memory_gib: float, note: str) -> dict:
    """DeviceSpec fields from the measured points (the curves of devices.py fitted)."""
    peak, m_half, d_half = fit_curve(raw["gemm"])
    a_peak, a_half, _ = fit_curve(raw["attention_forward"], with_width=False)
    b_peak, _, _ = fit_curve(raw["attention_backward"], with_width=False)
    bandwidth = raw["memory_bandwidth"]
    return {"name": name, "gemm_peak": peak, "gemm_m_half": m_half, "gemm_d_half": d_half,
            "attention_efficiency": a_peak / peak, "attention_backward_efficiency": b_peak / peak,
            "attention_m_half": a_half, "attention_backward_flops": 2.5,
            "memory_bandwidth": bandwidth, "op_overhead_s": (raw["op_forward_s"] +
                                                              raw["op_backward_s"]) / 2.5,
            "dtype_bytes": 2 if cuda else 4, "memory_gib": memory_gib,
            "intra_node_bandwidth": bandwidth / 4, "inter_node_bandwidth": bandwidth / 4,
            "link_latency_s": 50e-6, "gpus_per_node": 8,
            "sources": [note, "links not measured: memory bandwidth / 4 and 50 us latency assumed"]}


def measure_device(device: str = "cpu", threads: int = 1, name: str = "", repeats: int = 3,
                   quick: bool = False) -> dict:
    """Run the microbenchmark `repeats` times; {"device": DeviceSpec fields, "raw": the
    per-point medians, "runs": every repeat}. `quick`: a smaller grid (a dry run)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    grid = QUICK if quick else FULL
    runs = [_raw_once(torch, device, dtype, sync, grid) for _ in range(repeats)]
    raw = _median_raw(runs)
    memory = torch.cuda.get_device_properties(0).total_memory / 2 ** 30 if cuda else 0.0
    note = (f"tools/predict_bench.py on {device}, {threads} thread(s), torch {torch.__version__}, "
            f"median of {repeats} repeats")
    spec = device_fields(raw, name=name or f"{device}-measured", cuda=cuda, memory_gib=memory,
                         note=note)
    raw.update(load_avg=os.getloadavg()[0], seconds=time.perf_counter() - started)
    return {"device": spec, "raw": raw, "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="device file to write (JSON)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="a smaller grid (seconds, less exact)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the sweep ran with 1)")
    p.add_argument("--name", default="")
    p.add_argument("--repeats", type=int, default=3, help="whole-benchmark repeats (median)")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        p.error("--threads and --repeats must be >= 1")
    result = measure_device(args.device, args.threads, args.name, args.repeats, args.quick)
    Path(args.out).write_text(json.dumps(result, indent=1))
    d = result["device"]
    print(f"{d['name']}: GEMM peak {d['gemm_peak'] / 1e9:.1f} GFLOP/s (m_half {d['gemm_m_half']:g},"
          f" d_half {d['gemm_d_half']:g}), attention {d['attention_efficiency']:.2f} / "
          f"{d['attention_backward_efficiency']:.2f} of it, memory {d['memory_bandwidth'] / 1e9:.1f}"
          f" GB/s, {d['op_overhead_s'] * 1e6:.1f} us per op; {result['raw']['seconds']:.1f} s, load "
          f"{result['raw']['load_avg']:.1f}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
