"""The paper's setting beside its figures (../shared/notes/paper-scale.md): Qwen3-8B on 16 H20,
12,288 tokens per trajectory, prefix/suffix 2k/10k .. 10k/2k, N = 2 .. 128."""
from __future__ import annotations

import sys

from prefix_schedule.planning.memory_model import (ActivationModel, MemoryOptions,
                                                   dense_peak_bytes, reuse_phase_peaks)
from prefix_schedule.predict.devices import DeviceSpec
from prefix_schedule.predict.roofline import Layout

from predictlib.report import Workload, predict_layout, search
from predictlib.workload import plan_for, synthetic_batch

__all__ = ["KNOWN_SPEEDUPS", "KNOWN_MEMORY", "KNOWN_CAPACITY", "paper_grid", "SPLITS",
           "suffix_phase_change"]

TOTAL = 12288
SPLITS = ((2048, 10240), (4096, 8192), (6144, 6144), (8192, 4096), (10240, 2048))
GROUP_SIZES = (2, 4, 8, 16, 32, 64, 128)
# (prefix, suffix, N) -> the published eager speedup; arXiv 2606.01143 as summarised in
# paper-scale.md (second-hand: "treat the details as unverified"). The 1.17x at 2k/10k is read
# as N=128 (the grid's best-N column); the note does not say.
KNOWN_SPEEDUPS = {(10240, 2048, 128): 4.395, (2048, 10240, 128): 1.17, (2048, 10240, 2): 1.10}
KNOWN_MEMORY = {(2048, 10240, 16): -0.203, (10240, 2048, 16): -0.591}  # suffix-phase peak change
KNOWN_CAPACITY = {"group_size": 2, "ratio": 29696 / 17920}  # 17,920 -> 29,696 tokens
MEMORY_N = 16
MEMORY_LAYOUT = Layout(tp=2, pp=1, dp=8)  # the dense path's best layout on 16 H20 (predicted)


def suffix_phase_change(dims, spec, prefix: int, suffix: int, n: int, act_bytes: int) -> dict:
    """Suffix-phase activation peak of reuse / dense's step peak - 1, one trajectory per
    microbatch both ways (dense: one full row; reuse: one suffix over the group's cache), on
    MEMORY_LAYOUT's first stage; reuse without and with offloaded prefix activations
    (planning/memory_model.py). Static memory (weights, grads, optimizer) not included."""
    model = ActivationModel(dims=dims, act_bytes=act_bytes, qk_norm=bool(spec and spec.qk_norm),
                            tp=MEMORY_LAYOUT.tp, head=True, in_flight=1)
    batch = synthetic_batch(prefix_len=prefix, suffix_len=suffix, group_size=n, num_groups=1)
    plan = plan_for(batch, dims, policy=False, token_budget=suffix + (-suffix % MEMORY_LAYOUT.tp),
                    row_multiple=MEMORY_LAYOUT.tp)
    dense = dense_peak_bytes(model, [prefix + suffix - 1])
    out = {"layout": "TP=2 first stage, one trajectory per microbatch"}
    for name, options in (("no_offload", MemoryOptions()), ("offload", MemoryOptions(offload=True))):
        out[name] = reuse_phase_peaks(model, plan, options)["suffix"] / dense - 1
    return out


def paper_grid(dev: DeviceSpec, dims, spec, *, gpus: int = 16, groups: int = 16,
               group_sizes=GROUP_SIZES, layout=None) -> list:
    """One row per (split, N): the best layout per path (or `layout`), speedup, memory, and the
    error against the published figure where there is one. Plain reuse at every point (no FLOP
    policy: the paper's figures are reuse's, even where the policy would run a group dense)."""
    rows = []
    for n in group_sizes:
        for prefix, suffix in SPLITS:
            batch = synthetic_batch(prefix_len=prefix, suffix_len=suffix, group_size=n,
                                    num_groups=groups)
            work = Workload(batch=batch, policy=False)  # the paper runs reuse at every point
            if layout is None:
                found = search(dev, dims, gpus, work, spec)
                dense, reuse = found["best_dense"], found["best_reuse"]
            else:
                dense = reuse = predict_layout(dev, dims, layout, work, spec)
            rows.append(_row(prefix, suffix, n, dense, reuse))
            if (prefix, suffix, n) in KNOWN_MEMORY or n == MEMORY_N:
                rows[-1]["suffix_phase_one_per_microbatch"] = suffix_phase_change(
                    dims, spec, prefix, suffix, n, dev.dtype_bytes)
            print(f"  {prefix}/{suffix} N={n}: {rows[-1].get('speedup') or 0:.2f}x", file=sys.stderr,
                  flush=True)
    return rows


def _row(prefix, suffix, n, dense, reuse) -> dict:
    row = {"prefix": prefix, "suffix": suffix, "group_size": n, "prefix_share": prefix / TOTAL}
    if dense is None or reuse is None:
        return dict(row, speedup=None, note="no layout fits memory")
    speedup = dense["dense"]["step_s"] / reuse["reuse"]["step_s"]
    memory = reuse["memory"]
    row.update(speedup=speedup, speedup_same_layout=reuse["speedup"],
               dense_layout=dense["layout"], reuse_layout=reuse["layout"],
               dense_step_s=dense["dense"]["step_s"], reuse_step_s=reuse["reuse"]["step_s"],
               dense_phases=dense["dense"]["phases"], reuse_phases=reuse["reuse"]["phases"],
               reuse_bubble=reuse["reuse"]["bubble_fraction"],
               reuse_comm_share=reuse["reuse"]["comm_share"],
               dense_peak_gib=dense["dense"]["peak_gib"], reuse_peak_gib=reuse["reuse"]["peak_gib"],
               suffix_phase_activation_change=-memory["suffix_phase_reduction"],
               suffix_phase_total_change=_total_change(reuse))
    known = KNOWN_SPEEDUPS.get((prefix, suffix, n))
    if known is not None:
        row.update(paper_speedup=known, error=speedup / known - 1)
    mem = KNOWN_MEMORY.get((prefix, suffix, n))
    if mem is not None:
        row.update(paper_suffix_phase_change=mem)
    return row


def _total_change(r: dict) -> float:
    """Suffix-phase peak with static memory included, vs dense's step peak (same layout)."""
    m = r["memory"]
    dense = m["static_gib"] + m["dense_activations_gib"]
    return (m["static_gib"] + m["reuse_suffix_phase_gib"]) / dense - 1
