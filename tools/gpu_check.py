"""GPU check of the shared-prefix attention backends.

Every available backend x mode (two_part, copy) against the float64 oracle -- output, dq, dk, dv
and the prefix dK/dV -- in bf16 and fp16, on packed rows of 3 groups with length-1 suffixes and
GQA (two layouts have a slot without a prefix, one has only 1-token suffixes), then fwd+bwd time and peak memory at prefix 4096,
16 suffixes x 512, H=32/8, D=128, bf16. Prints both tables; exit status 1 on any failure.

    python tools/gpu_check.py [--json results.json] [--repeats 5]

Without CUDA it says so, checks the torch backend on CPU at a small size and exits 0 (1 if that
check fails).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from prefix_schedule.attention import PackedMeta, reference_attention, shared_prefix_attention  # noqa: E402
from prefix_schedule.attention.backends import BACKEND_NAMES, availability  # noqa: E402

# max |error| / max |oracle| per tensor; fp32 (the CPU run) allows 1e-4 because a length-1
# suffix's dK is a small difference of large terms (fp32 SDPA in copy mode is as far off).
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-10}
GRADS = ("out", "dq", "dk", "dv", "dprefix_k", "dprefix_v")
# lengths, group slot per suffix, prefix length per slot
LAYOUTS = {
    "3groups": ([37, 1, 64, 1, 129, 90, 1], [0, 0, 1, 1, 1, 2, 2], [300, 129, 257]),
    "empty_slot": ([37, 1, 64, 1, 129, 90, 1], [0, 0, 1, 1, 1, 2, 2], [300, 0, 257]),
    # every query entry has one token: flash-attn's max_seqlen_q == 1 GQA path in both parts
    "len1_only": ([1, 1, 1], [0, 1, 2], [300, 0, 257]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd repetitions (median)")
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def make_case(layout, heads, kv_heads, head_dim, device, seed=0):
    """float64 leaves (q, k, v, prefix_k, prefix_v), meta and grad_out."""
    lengths, slots, prefix_lens = layout
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    meta = PackedMeta.from_lengths(lengths, slots)
    T = meta.total_len
    q, k, v = rand(T, heads, head_dim), rand(T, kv_heads, head_dim), rand(T, kv_heads, head_dim)
    pk = [rand(p, kv_heads, head_dim) for p in prefix_lens]
    pv = [rand(p, kv_heads, head_dim) for p in prefix_lens]
    return (q, k, v, pk, pv), meta, rand(T, heads, head_dim)


def leaves(tensors, dtype):
    q, k, v, pk, pv = tensors
    f = lambda x: x.detach().to(dtype).requires_grad_()  # noqa: E731
    return f(q), f(k), f(v), [f(x) for x in pk], [f(x) for x in pv]


def out_and_grads(fn, tensors, meta, grad_out, **kw):
    q, k, v, pk, pv = tensors
    out = fn(q, k, v, pk, pv, meta, **kw)
    dq, dk, dv, *dp = torch.autograd.grad(out, [q, k, v, *pk, *pv], grad_out.to(out.dtype))
    n = len(pk)
    return [out, dq, dk, dv, torch.cat(dp[:n]), torch.cat(dp[n:])]


def rel_err(actual, expected) -> float:
    if not torch.isfinite(actual).all():
        return float("inf")
    ref = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() / max(ref, 1e-30)


def check_correctness(device, dtypes, names, heads, kv_heads, head_dim):
    rows = []
    for layout_name, layout in LAYOUTS.items():
        base, meta, grad_out = make_case(layout, heads, kv_heads, head_dim, device)
        for dtype in dtypes:
            rounded = leaves(base, dtype)  # the oracle sees exactly the rounded inputs
            want = out_and_grads(reference_attention, leaves(rounded, torch.float64), meta,
                                 grad_out.to(dtype).double())
            for name in names:
                for mode in ("two_part", "copy"):
                    row = dict(backend=name, mode=mode, dtype=str(dtype).replace("torch.", ""),
                               layout=layout_name)
                    try:
                        got = out_and_grads(shared_prefix_attention, leaves(rounded, dtype), meta,
                                            grad_out, mode=mode, backend=name)
                        row.update({g: rel_err(a, b) for g, a, b in zip(GRADS, got, want)})
                        row["ok"] = all(row[g] <= TOL[dtype] for g in GRADS)
                    except Exception as e:  # noqa: BLE001 -- report and go on to the next backend
                        row.update(ok=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
    return rows


def time_fwd_bwd(name, mode, device, repeats, warmup):
    layout = ([512] * 16, [0] * 16, [4096])
    base, meta, grad_out = make_case(layout, 32, 8, 128, device, seed=1)
    tensors = leaves(base, torch.bfloat16)
    g = grad_out.to(torch.bfloat16)
    del base, grad_out
    times = []
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = shared_prefix_attention(*tensors, meta, mode=mode, backend=name)
        torch.autograd.grad(out, [tensors[0], tensors[1], tensors[2], *tensors[3], *tensors[4]], g)
        end.record()
        torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(start.elapsed_time(end))
        del out
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return dict(backend=name, mode=mode, ms=statistics.median(times), peak_extra_mib=peak)


def print_table(rows, columns):
    def cell(row, c):
        value = row.get(c, "")
        return f"{value:.2e}" if isinstance(value, float) and c in GRADS else (
            f"{value:.2f}" if isinstance(value, float) else str(value))
    widths = [max(len(c), *(len(cell(r, c)) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(cell(row, c).ljust(w) for c, w in zip(columns, widths)))
        if "error" in row:
            print(f"    error: {row['error']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    report = dict(device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__)
    dtype = torch.bfloat16 if cuda else torch.float32
    avail = availability(device, dtype, 128 if cuda else 64)
    report["availability"] = {n: a.reason or "available" for n, a in avail.items()}
    for name, why in report["availability"].items():
        print(f"{name:20s} {why}")
    if cuda:
        names = [n for n in BACKEND_NAMES if avail[n]]
        rows = check_correctness(device, (torch.bfloat16, torch.float16), names, 32, 8, 128)
    else:
        print("no CUDA device: GPU backends not checked; checking the torch backend on CPU")
        rows = check_correctness(device, (torch.float32, torch.bfloat16), ["torch"], 8, 2, 64)
    print()
    print_table(rows, ["backend", "mode", "dtype", "layout", *GRADS, "ok"])
    report["correctness"] = rows
    timing = []
    if cuda:
        for name in (n for n in BACKEND_NAMES if avail[n]):
            for mode in ("two_part", "copy"):
                try:
                    timing.append(time_fwd_bwd(name, mode, device, args.repeats, args.warmup))
                except Exception as e:  # noqa: BLE001
                    timing.append(dict(backend=name, mode=mode, ok=False, error=f"{type(e).__name__}: {e}"))
        print("\nfwd+bwd, prefix 4096, 16 suffixes x 512, H=32/8, D=128, bf16")
        print_table(timing, ["backend", "mode", "ms", "peak_extra_mib"])
    report["timing"] = timing
    failures = sum(not r.get("ok", True) for r in rows + timing)
    report["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
