"""Everything that can only be checked on a GPU, in one run (< 8 minutes on an H100/H200), one JSON.

1. Attention: each GPU backend (transformer_engine, flash_attn, torch_cuda) x mode (two_part,
   copy) against the float64 oracle in bf16 and fp16 -- output, dq, dk, dv, prefix gK/gV -- on
   packed rows of 3 groups with GQA (H=32/8, D=128): with a slot without a prefix, with only
   1-token suffixes, and one over 1024 query rows (TE's bucketed softmax stats: 1300 rows -> 2048).
   Context parallelism: every CP rank's zigzag pieces (attention/cp.py all_ranks_attention, the
   CP=2 / CP=4 layouts of the same rows) on each backend against the same oracle: the non-CP
   kernel calls a CP reuse step makes on each rank (TE's own CP attention is never used: it
   disables every backend for bottom-right masks; docs/DESIGN.md "Context parallelism"), with
   CP layouts that hold whole sequences too. And TE's own CP backend filter, asked for a reuse
   row under each cp_comm_type (tools/gpu_check_te_cp.py): every backend must be disabled.
2. Attention timings (CUDA events, warm-up first) and peak memory (torch.cuda.max_memory_allocated,
   reset per phase) for every backend x mode: prefix 4096, 16 suffixes x 512, bf16.
3. End to end (tools/gpu_check_e2e.py): one training step, dense vs prefix reuse, bf16, with
   Megatron's TE layer spec (get_gpt_layer_with_transformer_engine_spec), dense on the same
   cuDNN kernels (attention_backend=fused), reuse through the hooks on the
   transformer_engine backend; both against an fp32 dense reference of the same weights;
   time and peak memory per phase (reference, dense, reuse, reuse with offloaded prefix
   activations).
4. MoE end to end (tools/gpu_check_moe.py): the same with MoE layers and grouped experts
   (TEGroupedMLP, moe_grouped_gemm=True), dense over the plan's packing, aux losses compared.
5. The predictor's microbenchmark (tools/predict_bench.py: GEMM, flash-attention, memory
   bandwidth, per-op cost; bf16): `predict_device` in the JSON, a device file for
   `tools/predict.py --device-file gpu_check.json` (measured costs replace the roofline's
   assumed efficiencies; docs/PREDICT.md).
6. Gated DeltaNet (tools/gpu_check_gdn.py): fla's varlen rule with per-sequence initial states
   against the torch rule (outputs, final states, dq/dk/dv/dg/dbeta/dh0), and a bf16 dense vs
   reuse step of a GDN model against an fp32 reference.
7. Mamba-2 (tools/gpu_check_mamba.py): causal-conv1d's conv over [cached tail; segment] and
   mamba-ssm's chunk scan from a cached state, chained over a prefix/suffix split, against one
   whole-sequence call (outputs, final state, every input's gradient) and against the CPU
   layer's torch stand-ins; and a bf16 dense vs reuse step of a HybridModel `M*M-` against an
   fp32 reference.
The JSON's `claims` says what the run proved, what failed and what did not run (and why).

    python tools/gpu_check.py --json gpu_check.json
    python tools/gpu_check.py --dry-run --json dry.json   # CPU: torch/math backends, local spec
    python tools/gpu_check.py --quick --json quick.json   # bare GPU machine: tools/gpu_quick.py

`--dry-run` runs the same code on CPU at small sizes (CPU backends stand in for the GPU ones,
Megatron's local spec for the TE spec, perf_counter for events, no allocator peaks) and writes
the same JSON schema; tests/test_gpu_check.py runs it so the script cannot rot.

Exit status: 1 on any failure; 4 when a requested phase did not run (a backend not installed,
the --budget-s time budget used up, TE missing for its CP filter check; the JSON's `not_run`
lists them, --skip-e2e phases are not requested) unless --allow-partial; 2 without CUDA and
without --dry-run; else 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, gpu_check_e2e
import gpu_check_te_cp  # noqa: E402
from gpu_check_report import claims, exit_status, library_versions, not_run  # noqa: E402,F401
from benchlib.timing import PhaseMemory, RegionTimer  # noqa: E402
from prefix_schedule.attention import PackedMeta, reference_attention, shared_prefix_attention  # noqa: E402
from prefix_schedule.attention.backends import availability  # noqa: E402
from prefix_schedule.attention.cp import all_ranks_attention  # noqa: E402

SCHEMA = 1
GRADS = ("out", "dq", "dk", "dv", "dprefix_k", "dprefix_v")
# max |error| / max |oracle| per tensor; fp32 (dry run) allows 1e-4: a length-1 suffix's dK is a
# small difference of large terms (fp32 SDPA in copy mode is as far off).
TOL = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-4, "float64": 1e-10}
GPU_BACKENDS = ("transformer_engine", "flash_attn", "torch_cuda")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Shapes of one run (GPU or dry run)."""

    heads: tuple[int, int]
    head_dim: int
    layouts: dict  # name -> (suffix lengths, group slot per suffix, prefix length per slot)
    timing: tuple  # (prefix, suffixes, suffix length)
    dtypes: tuple[str, ...]
    backends: tuple[str, ...]
    cp_sizes: tuple[int, ...] = (2,)


GPU = Sizes(heads=(32, 8), head_dim=128, timing=(4096, 16, 512), dtypes=("bfloat16", "float16"),
            backends=GPU_BACKENDS, cp_sizes=(2, 4), layouts={
                "3groups": ([37, 1, 64, 1, 129, 90, 1], [0, 0, 1, 1, 1, 2, 2], [300, 129, 257]),
                "empty_slot": ([37, 1, 64, 1, 129, 90, 1], [0, 0, 1, 1, 1, 2, 2], [300, 0, 257]),
                # every query entry has one token: flash-attn's max_seqlen_q == 1 GQA path
                "len1_only": ([1, 1, 1], [0, 1, 2], [300, 0, 257]),
                # > 1024 query rows, not a power of two: TE 2.2-2.10 return 2048 stats rows
                "over_1024_rows": ([700, 1, 599], [0, 0, 1], [1100, 77]),
            })
DRY = Sizes(heads=(4, 2), head_dim=16, timing=(256, 4, 32), dtypes=("float32", "bfloat16"),
            backends=("torch", "math"), layouts={
                "3groups": ([5, 1, 7, 1, 3], [0, 0, 1, 1, 2], [9, 4, 6]),
                "empty_slot": ([5, 1, 7, 1, 3], [0, 0, 1, 1, 2], [9, 0, 6]),
            })


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--dry-run", action="store_true", help="CPU stand-ins at small sizes, same JSON")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per path (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per path first")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip the remaining phases once this many seconds have passed")
    p.add_argument("--skip-e2e", action="store_true", help="attention only")
    p.add_argument("--quick", action="store_true",
                   help="the short check for a bare GPU machine (tools/gpu_quick.py: torch_cuda "
                        "attention, a Qwen3-8B-shaped dense vs reuse step at three shares, GDN on "
                        "fla, the predictor's microbenchmark); docs/GPU.md")
    p.add_argument("--allow-partial", action="store_true",
                   help="exit 0 even when requested phases did not run (they stay listed as "
                        "'not run' in the output and the JSON's not_run)")
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
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")  # NaN/inf on either side fails every tolerance
    ref = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() / max(ref, 1e-30)


def check_correctness(device, sizes: Sizes, names):
    rows = []
    for layout_name, layout in sizes.layouts.items():
        base, meta, grad_out = make_case(layout, *sizes.heads, sizes.head_dim, device)
        for dtype_name in sizes.dtypes:
            dtype = getattr(torch, dtype_name)
            rounded = leaves(base, dtype)  # the oracle sees exactly the rounded inputs
            want = out_and_grads(reference_attention, leaves(rounded, torch.float64), meta,
                                 grad_out.to(dtype).double())
            for name in names:
                for mode in ("two_part", "copy"):
                    row = dict(backend=name, mode=mode, dtype=dtype_name, layout=layout_name,
                               tol=TOL[dtype_name])
                    try:
                        got = out_and_grads(shared_prefix_attention, leaves(rounded, dtype), meta,
                                            grad_out, mode=mode, backend=name)
                        row.update({g: rel_err(a, b) for g, a, b in zip(GRADS, got, want)})
                        row["ok"] = all(row[g] <= TOL[dtype_name] for g in GRADS)
                    except Exception as e:  # noqa: BLE001 -- report and go on to the next backend
                        row.update(ok=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
            del rounded, want
    return rows


def check_cp_correctness(device, sizes: Sizes, names):
    """Every CP rank's zigzag pieces through `name`'s kernels == the float64 oracle."""
    rows = []
    for layout_name, layout in sizes.layouts.items():
        base, meta, grad_out = make_case(layout, *sizes.heads, sizes.head_dim, device)
        dtype_name = sizes.dtypes[0]
        dtype = getattr(torch, dtype_name)
        rounded = leaves(base, dtype)
        want = out_and_grads(reference_attention, leaves(rounded, torch.float64), meta,
                             grad_out.to(dtype).double())
        n = meta.num_seqs
        for name in names:
            for cp, (kind, owners) in ((cp, o) for cp in sizes.cp_sizes for o in (
                    ("zigzag", ()), ("whole", tuple(i % cp for i in range(n))),
                    ("mixed", (-1,) + tuple(i % cp for i in range(1, n))))):
                row = dict(backend=name, cp=cp, owners=kind, dtype=dtype_name,
                           layout=layout_name, tol=TOL[dtype_name])
                try:
                    got = out_and_grads(all_ranks_attention, leaves(rounded, dtype), meta,
                                        grad_out, cp=cp, backend=name, owners=owners)
                    row.update({g: rel_err(a, b) for g, a, b in zip(GRADS, got, want)})
                    row["ok"] = all(row[g] <= TOL[dtype_name] for g in GRADS)
                except Exception as e:  # noqa: BLE001 -- report and go on
                    row.update(ok=False, error=f"{type(e).__name__}: {e}")
                rows.append(row)
    return rows


def time_attention(name, mode, device, sizes: Sizes, repeats, warmup):
    prefix, count, length = sizes.timing
    base, meta, grad_out = make_case(([length] * count, [0] * count, [prefix]), *sizes.heads,
                                     sizes.head_dim, device, seed=1)
    dtype = torch.bfloat16
    tensors, g = leaves(base, dtype), grad_out.to(dtype)
    del base, grad_out
    inputs = [tensors[0], tensors[1], tensors[2], *tensors[3], *tensors[4]]
    times = []
    with PhaseMemory(device) as memory:
        for i in range(warmup + repeats):
            with RegionTimer(device) as timer:
                out = shared_prefix_attention(*tensors, meta, mode=mode, backend=name)
                torch.autograd.grad(out, inputs, g)
                del out
            if i >= warmup:
                times.append(timer.seconds * 1e3)
    return dict(backend=name, mode=mode, dtype="bfloat16", ms=statistics.median(times),
                peak_extra_mib=_mib(memory.peak_extra_bytes), timing_basis=timer.basis,
                warmup=warmup, repeats=repeats, ok=True)


def _mib(value):
    return None if value is None else value / 2**20


def _moe_e2e(args, device, cuda, started, report) -> dict:
    """Phase 4 (tools/gpu_check_moe.py): MoE with grouped experts (TEGroupedMLP)."""
    if args.skip_e2e:
        return {"skipped": "--skip-e2e"}
    if time.monotonic() - started > args.budget_s:
        return {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
    _save(args.json, report)
    try:
        import gpu_check_moe

        return gpu_check_moe.run(device, dry_run=not cuda)
    except Exception:  # noqa: BLE001 -- the other results still count
        return dict(ok=False, claim="MoE end-to-end step", error=traceback.format_exc())


def _predict_device(args, cuda, started, report) -> dict:
    """Phase 5 (tools/predict_bench.py): the predictor's op throughputs on this device."""
    if time.monotonic() - started > args.budget_s:
        return {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
    _save(args.json, report)
    claim = ("predictor microbenchmark: GEMM / attention throughput curves, memory bandwidth and "
             "per-op cost measured and fitted into a device file")
    try:
        import predict_bench

        result = predict_bench.measure_device("cuda" if cuda else "cpu", repeats=3 if cuda else 1,
                                              quick=not cuda)
        return dict(ok=True, claim=claim, device=result["device"], raw=result["raw"])
    except Exception:  # noqa: BLE001 -- the other results still count
        return dict(ok=False, claim=claim, error=traceback.format_exc())


def _recurrent_e2e(module: str, claim: str, args, device, cuda, started, report) -> dict:
    """Phases 6 and 7 (tools/gpu_check_gdn.py, tools/gpu_check_mamba.py): a recurrent layer's
    kernels with prefix state reuse, and its end-to-end step."""
    if args.skip_e2e:
        return {"skipped": "--skip-e2e"}
    if time.monotonic() - started > args.budget_s:
        return {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
    _save(args.json, report)
    try:
        return __import__(module).run(device, dry_run=not cuda)
    except Exception:  # noqa: BLE001 -- the other results still count
        return dict(ok=False, claim=claim, error=traceback.format_exc())


def _save(path, report) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_check.py: no CUDA device; run on a GPU, or use --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        import gpu_quick

        return gpu_quick.run(args, device, dry_run=not cuda, full=sys.modules[__name__])
    sizes = GPU if cuda else DRY
    report = dict(schema=SCHEMA, mode="gpu" if cuda else "dry-run",
                  device=torch.cuda.get_device_name(device) if cuda else "cpu",
                  capability=list(torch.cuda.get_device_capability(device)) if cuda else None,
                  libraries=library_versions(),
                  sizes=dict(heads=list(sizes.heads), head_dim=sizes.head_dim,
                             layouts={k: [list(x) for x in v] for k, v in sizes.layouts.items()},
                             timing=list(sizes.timing), dtypes=list(sizes.dtypes)))
    avail = availability(device, getattr(torch, sizes.dtypes[0]), sizes.head_dim)
    report["availability"] = {n: a.reason or "available" for n, a in avail.items()}
    names = [n for n in sizes.backends if avail[n]]
    report["correctness"] = check_correctness(device, sizes, names)
    report["cp_correctness"] = check_cp_correctness(device, sizes, names)
    report["te_cp_filter"] = gpu_check_te_cp.te_cp_filter(device)
    _save(args.json, report)
    report["timing"] = []
    for name in names:
        for mode in ("two_part", "copy"):
            if time.monotonic() - started > args.budget_s:
                break
            try:
                report["timing"].append(time_attention(name, mode, device, sizes, args.repeats,
                                                       args.warmup))
            except Exception as e:  # noqa: BLE001
                report["timing"].append(dict(backend=name, mode=mode, ok=False,
                                             error=f"{type(e).__name__}: {e}"))
    if args.skip_e2e:
        report["e2e"] = {"skipped": "--skip-e2e"}
    elif time.monotonic() - started > args.budget_s:
        report["e2e"] = {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
    else:
        _save(args.json, report)  # what is known so far, should the end-to-end step crash the process
        try:
            import gpu_check_e2e

            report["e2e"] = gpu_check_e2e.run(device, dry_run=not cuda, warmup=1,
                                              repeats=max(1, args.repeats // 2))
        except Exception:  # noqa: BLE001 -- the attention results still count
            report["e2e"] = dict(ok=False, claim="end-to-end step", error=traceback.format_exc())
    report["moe_e2e"] = _moe_e2e(args, device, cuda, started, report)
    report["predict_device"] = _predict_device(args, cuda, started, report)
    report["gdn_e2e"] = _recurrent_e2e("gpu_check_gdn", "Gated DeltaNet end-to-end step", args,
                                       device, cuda, started, report)
    report["mamba_e2e"] = _recurrent_e2e("gpu_check_mamba", "Mamba-2 end-to-end step", args,
                                         device, cuda, started, report)
    report["env"] = {k: os.environ.get(k) for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN",
                                                     "NVTE_UNFUSED_ATTN")}  # as the run left them
    report["claims"] = claims(report, names, GPU_BACKENDS if cuda else DRY.backends,
                                dry_run=not cuda)
    failures = sum(not r.get("ok", True) for r in report["correctness"] + report["timing"]
                   + report["cp_correctness"])
    failures += sum(int(bool(report[k]) and report[k].get("ok") is False)
                    for k in ("e2e", "moe_e2e", "predict_device", "gdn_e2e", "mamba_e2e"))
    failures += int(report["te_cp_filter"].get("ok") is False)
    report["failures"], report["elapsed_s"] = failures, time.monotonic() - started
    report["not_run"] = not_run(report)
    _save(args.json, report)
    for claim in report["claims"]:
        print(f"[{claim['status']}] {claim['claim']}")
    for row in report["correctness"] + report["cp_correctness"] + report["timing"]:
        if not row.get("ok", True):
            print(f"FAILED {row}")
    print(f"{failures} failure(s) in {report['elapsed_s']:.0f} s")
    status = exit_status(report, args.allow_partial)
    if report["not_run"]:
        print(f"{len(report['not_run'])} requested phase(s) did not run (listed 'not run' above): "
              + ("accepted (--allow-partial)" if args.allow_partial else
                 "the check is incomplete; install what is missing or raise --budget-s, or "
                 "pass --allow-partial to accept a partial run"),
              file=sys.stdout if status == 0 else sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
