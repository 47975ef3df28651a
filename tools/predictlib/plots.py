"""Plots of the predictor's checks (matplotlib, Agg backend)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["plot_paper", "plot_validation"]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_validation(result: dict, out_dir) -> str:
    """Predicted vs measured speedup, one marker per source, the 10% band shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = max(max(r["predicted_speedup"], r["measured_speedup"]) for r in result["rows"]) * 1.08
    xs = [0.9, top]
    ax.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="0.9", label="±10%")
    ax.plot(xs, xs, color="0.5", lw=1)
    for source, marker in (("sweep", "o"), ("bench", "s")):
        rows = [r for r in result["rows"] if r["source"] == source]
        if rows:
            ax.scatter([r["measured_speedup"] for r in rows],
                       [r["predicted_speedup"] for r in rows], marker=marker, label=source)
    ax.set(xlabel="measured speedup (CPU time)", ylabel="predicted speedup", xlim=xs, ylim=xs,
           title=f"{result['points']} points: median |err| {result['median_abs_error']:.1%}, "
                 f"worst {result['max_abs_error']:.1%}")
    ax.legend()
    path = Path(out_dir) / "validate.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def plot_paper(result: dict, out_dir) -> list:
    """Speedup vs prefix share per N (paper points marked), and the N=16 memory change."""
    plt = _pyplot()
    rows = [r for r in result["points"] if r.get("speedup")]
    sizes = sorted({r["group_size"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for n in sizes:
        pts = sorted((r["prefix_share"], r["speedup"]) for r in rows if r["group_size"] == n)
        ax.plot(*zip(*pts), marker="o", ms=3, label=f"N={n}")
    known = [r for r in rows if "paper_speedup" in r]
    if known:
        ax.scatter([r["prefix_share"] for r in known], [r["paper_speedup"] for r in known],
                   marker="*", s=140, color="k", zorder=5, label="paper (eager)")
    ax.set(xlabel="prefix share of 12,288 tokens", ylabel="predicted speedup (best layouts)",
           title=f"Qwen3-8B, 16 x {result['device']['name']}")
    ax.legend(fontsize=7, ncol=2)
    paths = [str(Path(out_dir) / "paper-speedup.png")]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fig.savefig(paths[0], dpi=110, bbox_inches="tight")
    plt.close(fig)
    mem = sorted((r["prefix_share"], r["suffix_phase_one_per_microbatch"]["no_offload"],
                  r["suffix_phase_one_per_microbatch"]["offload"]) for r in rows
                 if r["group_size"] == 16 and "suffix_phase_one_per_microbatch" in r)
    if mem:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [m[0] for m in mem]
        ax.plot(xs, [100 * m[1] for m in mem], marker="o", label="prefix activations on device")
        ax.plot(xs, [100 * m[2] for m in mem], marker="s", label="prefix activations offloaded")
        ax.scatter([2048 / 12288, 10240 / 12288], [-20.3, -59.1], marker="*", s=140, color="k",
                   label="paper")
        ax.set(xlabel="prefix share", ylabel="suffix-phase activation peak vs dense (%)",
               title="N=16, one trajectory per microbatch, TP=2")
        ax.legend(fontsize=8)
        paths.append(str(Path(out_dir) / "paper-memory.png"))
        fig.savefig(paths[1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths
