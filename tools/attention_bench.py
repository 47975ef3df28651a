"""Microbenchmark: shared-prefix attention fwd+bwd, two_part vs copy vs one masked SDPA per group.

Reports the median fwd+bwd time and the bytes saved for backward (saved_tensors_hooks, each
storage counted once). `extra` leaves out the storages of the inputs (q, k, v and the cached
prefix K/V, which are alive anyway): it is the activation memory the method itself adds.

    python tools/attention_bench.py [--prefix-len 2048 --num-suffixes 8 --suffix-len 256 ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# This checkout's package first: an installed (editable) prefix_schedule may be another checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prefix_schedule.attention import PackedMeta, shared_prefix_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MiB = 2.0 ** 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--num-suffixes", type=int, default=8, help="suffixes per group")
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--groups", type=int, default=1, help="groups packed in the microbatch")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-masked", action="store_true", help="skip the masked-SDPA variant")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if min(args.prefix_len, args.num_suffixes, args.suffix_len, args.groups, args.repeats) < 1:
        p.error("lengths, counts and --repeats must be >= 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


def make_inputs(args):
    torch.manual_seed(0)
    dtype, hq, hkv, d = DTYPES[args.dtype], args.heads, args.kv_heads, args.head_dim
    meta = PackedMeta.from_lengths([args.suffix_len] * (args.groups * args.num_suffixes),
                                   [g for g in range(args.groups) for _ in range(args.num_suffixes)])
    T = meta.total_len

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    q, k, v = leaf(T, hq, d), leaf(T, hkv, d), leaf(T, hkv, d)
    prefix_k = [leaf(args.prefix_len, hkv, d) for _ in range(args.groups)]
    prefix_v = [leaf(args.prefix_len, hkv, d) for _ in range(args.groups)]
    return (q, k, v, prefix_k, prefix_v, meta), torch.randn(T, hq, d, dtype=dtype)


def group_masks(meta, prefix_lens, dtype):
    """Per group: [n_g, P_g + n_g] additive mask, prefix fully visible, suffixes block-causal."""
    masks = []
    for g, (a, b) in enumerate(meta.slot_ranges):
        mask = torch.zeros(b - a, prefix_lens[g] + b - a, dtype=torch.bool)
        mask[:, :prefix_lens[g]] = True
        for s, e, slot in zip(meta.cu_seqlens, meta.cu_seqlens[1:], meta.seq_slot):
            if slot == g:
                off = prefix_lens[g] - a
                mask[s - a:e - a, off + s:off + e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        # additive float mask: SDPA would expand a bool mask to a float one per head
        masks.append(torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf")))
    return masks


def masked_sdpa(q, k, v, prefix_k, prefix_v, meta, masks):
    """One public SDPA call per group over [prefix ; all the group's suffixes] with a dense mask."""
    outs = []
    for (a, b), pk, pv, mask in zip(meta.slot_ranges, prefix_k, prefix_v, masks):
        kk, vv = torch.cat([pk, k[a:b]]), torch.cat([pv, v[a:b]])
        bhld = [x.transpose(0, 1).unsqueeze(0) for x in (q[a:b], kk, vv)]
        o = F.scaled_dot_product_attention(*bhld, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def saved_bytes(fn, inputs):
    """(all, extra) bytes of the storages saved for backward by one forward of fn."""
    input_keys = {t.untyped_storage().data_ptr() for t in inputs}
    seen, totals = set(), {"all": 0, "extra": 0}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and storage.nbytes():
            seen.add(key)
            totals["all"] += storage.nbytes()
            totals["extra"] += 0 if key in input_keys else storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return totals["all"], totals["extra"]


def time_fwd_bwd(fn, inputs, grad_out, warmup, repeats):
    times = []
    for i in range(warmup + repeats):
        for t in inputs:
            t.grad = None
        start = time.perf_counter()
        fn().backward(grad_out)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def run(args):
    problem, grad_out = make_inputs(args)
    q, k, v, prefix_k, prefix_v, meta = problem
    inputs = [q, k, v, *prefix_k, *prefix_v]
    methods = {
        "two_part": lambda: shared_prefix_attention(*problem, mode="two_part"),
        "copy": lambda: shared_prefix_attention(*problem, mode="copy"),
    }
    if not args.skip_masked:
        masks = group_masks(meta, [p.shape[0] for p in prefix_k], q.dtype)  # built once, outside the timing
        methods["masked_sdpa"] = lambda: masked_sdpa(*problem, masks)
    with torch.no_grad():
        ref = methods["copy"]().float()
        max_diff = {name: (fn().float() - ref).abs().max().item() for name, fn in methods.items()}
    results = {}
    for name, fn in methods.items():
        all_b, extra_b = saved_bytes(fn, inputs)
        times = time_fwd_bwd(fn, inputs, grad_out, args.warmup, args.repeats)
        results[name] = {"ms_median": statistics.median(times), "ms_min": min(times),
                         "saved_bytes": all_b, "saved_bytes_extra": extra_b,
                         "max_abs_diff_vs_copy": max_diff[name]}
    return results


def report(args, results):
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"groups={args.groups} prefix={args.prefix_len} suffixes={args.num_suffixes}x{args.suffix_len} "
          f"heads={args.heads}/{args.kv_heads} head_dim={args.head_dim}, median of {args.repeats}")
    header = ["fwd+bwd ms", "min ms", "saved MiB", "extra MiB", "max|diff|"]
    print(f"{'method':<12} " + " ".join(f"{h:>10}" for h in header))
    for name, r in results.items():
        print(f"{name:<12} {r['ms_median']:>10.1f} {r['ms_min']:>10.1f} {r['saved_bytes'] / MiB:>10.2f} "
              f"{r['saved_bytes_extra'] / MiB:>10.2f} {r['max_abs_diff_vs_copy']:>10.2e}")
    base = results["two_part"]
    ratios = {}
    for name, r in results.items():
        if name == "two_part":
            continue
        ratios[name] = {"time": r["ms_median"] / base["ms_median"],
                        "saved": r["saved_bytes"] / max(base["saved_bytes"], 1),
                        "saved_extra": r["saved_bytes_extra"] / max(base["saved_bytes_extra"], 1)}
        print(f"{name} / two_part: time {ratios[name]['time']:.2f}x, saved {ratios[name]['saved']:.2f}x, "
              f"extra saved {ratios[name]['saved_extra']:.2f}x")
    print("targets (issue): copy/two_part time >= 1.2x and extra saved >= 10x")
    return ratios


def main(argv=None):
    args = parse_args(argv)
    results = run(args)
    ratios = report(args, results)
    if args.json is not None:
        payload = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "results": results, "ratios_vs_two_part": ratios}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
