"""One workload on a layout (or every candidate layout): predicted time and memory per path."""
from __future__ import annotations

import dataclasses
from typing import Optional

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.predict.devices import DeviceSpec
from prefix_schedule.predict.roofline import Layout
from prefix_schedule.predict.step import predict_step

from predictlib.workload import dense_rows, memory_per_rank, plan_for, rank_share

__all__ = ["Workload", "candidate_layouts", "format_result", "predict_layout", "search",
           "static_bytes_for"]

RESERVE_GIB = 4.0  # CUDA context, NCCL buffers, fragmentation (tools/capacity.py's default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What is predicted besides the layout."""

    batch: object
    """The whole step's GroupBatch (all DP ranks)."""
    policy: bool = True
    """Plan reuse with the FLOP-model policy (planning/policy.py); False: plain reuse."""
    token_budget: Optional[int] = None
    """Suffix microbatch tokens (None: the policy's default, or one group's suffixes)."""
    dense_rows_per_microbatch: int = 1
    """Full rows per dense microbatch (1: one [prefix; suffix] row each, the bench's default)."""
    optimizer: bool = True
    """Add the DP gradient reduce and the optimizer update (both paths) to the step."""


def static_bytes_for(dims: ModelDims, lay: Layout, spec=None) -> float:
    """Weights (bf16), fp32 main grads and the distributed optimizer's shard on the heaviest
    stage: tools/capacity.py's static_bytes for a named model, the same formula otherwise."""
    if spec is not None:
        import capacity
        return sum(capacity.static_bytes(spec, capacity.Layout(tp=lay.tp, pp=lay.pp, dp=lay.dp,
                                                              cp=lay.cp, ep=lay.ep)).values())
    from prefix_schedule.predict.step import params_per_rank
    params = params_per_rank(dims, lay)
    return params * (2 + 4 + 12 / (lay.dp * lay.cp))


def predict_layout(dev: DeviceSpec, dims: ModelDims, lay: Layout, work: Workload,
                   spec=None) -> dict:
    """Both paths on one layout: seconds, breakdown, memory per rank, whether each fits. With
    no token budget given and a reuse plan over the device's memory, smaller suffix microbatches
    are tried (one dense row's tokens, then halves) before reporting that it does not fit."""
    lay.check_model(dims)
    share = rank_share(work.batch, lay.dp)
    rows = dense_rows(share, work.dense_rows_per_microbatch)
    limit = dev.memory_gib - RESERVE_GIB if dev.memory_gib else float("inf")
    longest = max(max(r) for r in rows)
    shortest = max(t.num_tokens for g in share.groups for t in g.trajectories)
    budgets = [work.token_budget] if work.token_budget or not dev.memory_gib else \
        [None] + sorted({max(shortest, longest >> k) for k in range(5)}, reverse=True)
    static = static_bytes_for(dims, lay, spec)
    for budget in budgets:  # memory first (cheap); the step is predicted once, on the last tried
        try:
            plan = plan_for(share, dims, policy=work.policy, token_budget=budget,
                            row_multiple=lay.tp)
        except ValueError:
            if budget is None or budget == work.token_budget:
                raise
            continue  # a budget the policy's dense rows do not fit in: try the next
        memory = memory_per_rank(dims, lay, plan, rows, static_bytes=static,
                                 act_bytes=dev.dtype_bytes, qk_norm=bool(spec and spec.qk_norm))
        if memory["reuse_gib"] <= limit:
            break
    pred = predict_step(dev, dims, lay, plan, rows, optimizer=work.optimizer)
    return {"layout": dataclasses.asdict(lay), "speedup": pred.speedup,
            "dense": dict(pred.dense.as_dict(), peak_gib=memory["dense_gib"],
                          fits=memory["dense_gib"] <= limit),
            "reuse": dict(pred.reuse.as_dict(), peak_gib=memory["reuse_gib"],
                          fits=memory["reuse_gib"] <= limit),
            "memory": memory, "token_budget": plan.token_budget,
            "microbatches": {"dense": len(rows), "reuse": len(plan.microbatches)}}


def candidate_layouts(dims: ModelDims, gpus: int, cps=(1, 2, 4)) -> list:
    """TP (<= 8, dividing the heads) x PP x CP (`cps`: those the engine runs for this model and
    trainer, tools/predict.py allowed_cps) x DP = gpus; MoE: EP dividing the experts and DP x CP."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            for cp in cps:
                if gpus % (tp * pp * cp) or dims.num_layers % pp or dims.num_query_groups % tp:
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in ((1, 2, 4, 8) if dims.num_experts else (1,)):
                    if (dp * cp) % ep == 0 and (ep == 1 or dims.num_experts % ep == 0):
                        out.append(Layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep))
    if not out:
        raise ValueError(f"no layout of {gpus} GPUs splits this model; give --gpus as a multiple "
                         "of the layer count's and head count's divisors")
    return out


def search(dev: DeviceSpec, dims: ModelDims, gpus: int, work: Workload, spec=None,
           cps=(1, 2, 4)) -> dict:
    """Every candidate layout (CP sizes `cps`), and the fastest one that fits memory per path
    (they may differ)."""
    rows = [predict_layout(dev, dims, lay, work, spec)
            for lay in candidate_layouts(dims, gpus, cps)]
    best = {}
    for path in ("dense", "reuse"):
        fits = [r for r in rows if r[path]["fits"]]
        best[path] = min(fits, key=lambda r: r[path]["step_s"]) if fits else None
    speedup = (best["dense"]["dense"]["step_s"] / best["reuse"]["reuse"]["step_s"]
               if best["dense"] and best["reuse"] else None)
    return {"best_dense": best["dense"], "best_reuse": best["reuse"], "speedup_best": speedup,
            "layouts": rows}


def format_result(r: dict) -> str:
    lay = r["layout"]
    lines = [f"layout TP={lay['tp']} PP={lay['pp']} VPP={lay['vpp']} CP={lay['cp']} EP={lay['ep']} "
             f"DP={lay['dp']}: speedup {r['speedup']:.2f}x (reuse: {r['microbatches']['reuse']} "
             f"suffix microbatches of <= {r['token_budget']} tokens; dense: "
             f"{r['microbatches']['dense']} microbatches)"]
    for path in ("dense", "reuse"):
        p = r[path]
        phases = ", ".join(f"{k} {v:.3g}" for k, v in p["phases"].items())
        lines.append(f"  {path:5s} {p['step_s']:9.4g} s/step  (busiest rank: {phases}); bubble "
                     f"{p['bubble_fraction']:.1%}, communication {p['comm_share']:.1%}; peak "
                     f"{p['peak_gib']:.1f} GiB/rank{'' if p['fits'] else ' (does NOT fit)'}")
    m = r["memory"]
    lines.append(f"  memory: static {m['static_gib']:.1f} GiB; activations dense "
                 f"{m['dense_activations_gib']:.2f}, reuse {m['reuse_activations_gib']:.2f} "
                 f"(suffix phase {m['reuse_suffix_phase_gib']:.2f}: {-m['suffix_phase_reduction']:+.1%} "
                 "vs dense)")
    return "\n".join(lines)

