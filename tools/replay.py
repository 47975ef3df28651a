"""Replay an RL trace: train the same model from the same weights dense and with prefix reuse.

    python tools/replay.py --trace T --steps 100 [--json J] [--png P] [--precision fp32|bf16]
                           [--checkpoint-dir D --checkpoint-every 10] [--resume]
    python tools/replay.py --replot J P     # the PNG of a saved --json result, no training

Three runs step through the trace's optimizer steps with AdamW (fp32 master weights, Megatron
DDP with fp32 gradient accumulation, token-mean loss over each step; tools/replay_runs.py):

- fp32: `dense` (stock Megatron schedule and local attention: the reference), `reuse` (prefix
  reuse, same model), `control` (dense with the other attention kernel, fused SDPA:
  `build_model(fused_attention=True)`). The control is the yardstick: two dense runs that
  differ only in their attention kernel drift apart by rounding; reuse should not drift more.
- bf16: `dense` fp32 is the reference; `reuse` and `control` (dense) run a bf16 model. Reuse
  should be about as far from fp32 dense as bf16 dense is (tests/test_replay_sweep.py: at most
  1.5x, max and RMSE).

Per step: each run's loss and gradient norm (before clipping), and the max, mean and RMSE of the
relative parameter difference of `reuse` and of `control` against `dense` ([Note: relative
parameter difference] in tools/replay_runs.py: per-entry |a - r| / max|r| of its tensor, fp32
master weights after the update). The JSON's `max_param_diff`, `mean_param_diff` and
`rmse_param_diff` are reuse's after the last step (the paper's table), `control_*` the
control's; `rows` has every step. The whole trace is validated before any compute (the
model's length and the default token budget come from it). With --checkpoint-dir the runs' weights and AdamW state (safetensors) and the rows so
far are saved every --checkpoint-every steps, as one verified unit ([Note: replay checkpoint as
one unit] in tools/replay_checkpoint.py); --resume continues from there bit for bit, and refuses
a partial, corrupt or foreign checkpoint, or a trace whose content changed. A step whose
gradients are not finite stops the replay before any optimizer step of it (ValueError naming
the step, the run and the parameter); differences with a NaN or inf on either side are inf.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_schedule.losses import PolicyLossConfig  # noqa: E402
from prefix_schedule.planning.planner import plan_microbatches  # noqa: E402
from prefix_schedule.traces import read_header, read_steps, validate_trace  # noqa: E402
from argtypes import non_negative_float, positive_float, positive_int  # noqa: E402
from benchlib.progress import Progress  # noqa: E402
from outputs import check_output, check_output_dir  # noqa: E402
from replay_checkpoint import (load_checkpoint, load_runs, save_checkpoint,  # noqa: E402
                               trace_digest)
from replay_runs import ModelShape, Run, initial_weights, param_diff  # noqa: E402

__all__ = ["main", "replay", "parse_args", "format_summary", "check_output_paths"]

COMPARED = ("reuse", "control")
MAX_SEQ_LEN = 1 << 16
"""The longest [prompt; response] row replayed (refused before any allocation beyond it)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps to replay (from step 0)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--lr", type=positive_float, default=1e-4)
    p.add_argument("--adam-eps", type=positive_float, default=1e-8)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.01)
    p.add_argument("--clip-grad", type=non_negative_float, default=1.0,
                   help="global-norm clip; 0 = off")
    p.add_argument("--kl-coef", type=float, default=None,
                   help="KL weight (default 0.01 with ref log-probs in the trace, else 0)")
    p.add_argument("--token-budget", type=positive_int, default=None,
                   help="tokens per reuse suffix microbatch (default max(512, longest response))")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--threads", type=int, default=2)
    for field, default in ModelShape().__dict__.items():
        p.add_argument("--" + field.replace("_", "-"), type=positive_int, default=default)
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    args = p.parse_args(argv)
    for name in ("steps", "checkpoint_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.resume and args.checkpoint_dir is None:
        p.error("--resume needs --checkpoint-dir")
    return args


def _settings(args, stats) -> dict:
    """Everything that determines the replay's numbers (a resumed replay must match it)."""
    vocab = max(stats.vocab_size or 0, stats.max_token_id + 1)
    kl = args.kl_coef if args.kl_coef is not None else (0.01 if stats.has_ref_logprobs else 0.0)
    return {"trace": str(args.trace), "trace_sha256": trace_digest(args.trace),
            "steps": args.steps, "precision": args.precision,
            "model": {**ModelShape(**{f: getattr(args, f) for f in ModelShape().__dict__}).__dict__,
                      "vocab_size": -(-vocab // 128) * 128, "max_seq_len": stats.max_seq_len},
            "optimizer": {"name": "AdamW", "lr": args.lr, "eps": args.adam_eps,
                          "weight_decay": args.weight_decay, "clip_grad": args.clip_grad},
            "loss": {"clip_eps": 0.2, "kl_coef": kl},
            "token_budget": args.token_budget or max(512, stats.max_response_len),
            "seed": args.seed, "threads": args.threads}


def _build_runs(settings: dict) -> dict:
    from megatron_patches.support.cpu_support import enable_cpu_support

    enable_cpu_support()  # no-op with CUDA; the CPU/gloo layer is opt-in
    import megatron_patches
    from megatron_patches.models.tiny import initialize_single_process

    megatron_patches.install()
    initialize_single_process(seed=settings["seed"])
    m = dict(settings["model"])
    vocab, max_len = m.pop("vocab_size"), m.pop("max_seq_len")
    shape = ModelShape(**m)
    fp32 = shape.config(vocab_size=vocab, max_seq_len=max_len, dtype=torch.float32)
    low = settings["precision"] == "bf16"
    other = shape.config(vocab_size=vocab, max_seq_len=max_len,
                         dtype=torch.bfloat16 if low else torch.float32)
    weights = initial_weights(fp32, settings["seed"], torch.bfloat16 if low else None)
    opt = settings["optimizer"]
    kw = dict(lr=opt["lr"], eps=opt["eps"], weight_decay=opt["weight_decay"],
              clip_grad=opt["clip_grad"])
    return {"dense": Run("dense", "dense", fp32, weights, fused_attention=False, **kw),
            "reuse": Run("reuse", "reuse", other, weights, fused_attention=False, **kw),
            "control": Run("control", "dense", other, weights, fused_attention=not low, **kw)}


def replay(args, *, log=print, progress=None) -> dict:
    """Run the replay described by `args` (parse_args); returns the JSON result. Each step's
    line goes to `log`, or with `progress` (benchlib.progress.Progress or alike) to its bar."""
    # The whole trace: the model's length and the default budget must not depend on --steps
    # (a resumed replay may go further than the first).
    stats = validate_trace(args.trace, models={})
    if stats.max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"{args.trace}: a row of {stats.max_seq_len:,} tokens; this CPU replay "
                         f"runs rows of up to {MAX_SEQ_LEN:,} (its dense control would allocate "
                         "far more than this machine has); cut the trace's prompts or responses")
    if stats.num_steps < args.steps:
        raise ValueError(f"{args.trace} has {stats.num_steps} steps; use --steps <= {stats.num_steps}")
    settings = _settings(args, stats)
    if settings["loss"]["kl_coef"] > 0 and not stats.has_ref_logprobs:
        raise ValueError("--kl-coef > 0 needs ref_logprobs in the trace; use --kl-coef 0")
    rows, saved = (load_checkpoint(args.checkpoint_dir, settings, steps=args.steps)
                   if args.resume else ([], None))
    torch.set_num_threads(args.threads)
    runs = _build_runs(settings)
    if saved is not None:
        load_runs(saved, runs, len(rows))
        log(f"resumed from {saved} after step {len(rows) - 1}")
    loss = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=settings["loss"]["kl_coef"])
    max_len = settings["model"]["max_seq_len"]
    bar = progress(args.steps, name="replay", start=len(rows)) if progress else None
    for step, batch in enumerate(read_steps(args.trace, start=len(rows), stop=args.steps),
                                 start=len(rows)):
        plan = plan_microbatches(batch, token_budget=settings["token_budget"], max_seq_len=max_len)
        try:  # each run checks its gradients before its optimizer step
            results = {name: run.train_step(batch, plan, loss) for name, run in runs.items()}
        except ValueError as exc:
            raise ValueError(f"step {step}: {exc}; the replay stops here (saved checkpoints are "
                             "from earlier steps)") from None
        reference = runs["dense"].weights()
        rows.append({"step": step, **{k: {n: r[k] for n, r in results.items()}
                                      for k in ("loss", "grad_norm", "seconds")},
                     "param_diff": {**{n: param_diff(reference, runs[n].weights()) for n in COMPARED},
                                    "reuse_vs_control": param_diff(runs["control"].weights(),
                                                                   runs["reuse"].weights())}})
        if bar:
            bar.step(_row_line(rows[-1]))
        else:
            log(_row_line(rows[-1]))
        if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            save_checkpoint(args.checkpoint_dir, settings, runs, rows)
    if bar:
        bar.close()
    return _result(settings, stats, rows)


def _row_line(row: dict) -> str:
    d = row["param_diff"]
    return (f"step {row['step']:>4}  loss dense {row['loss']['dense']:+.6f} reuse "
            f"{row['loss']['reuse']:+.6f}  grad norm {row['grad_norm']['dense']:.4f}  param diff "
            f"reuse max {d['reuse']['max']:.2e} rmse {d['reuse']['rmse']:.2e} | control max "
            f"{d['control']['max']:.2e}")


def _result(settings: dict, stats, rows: list) -> dict:
    last = rows[-1]["param_diff"]
    low = settings["precision"] == "bf16"
    return {
        **settings, "steps": len(rows),
        "max_param_diff": last["reuse"]["max"], "mean_param_diff": last["reuse"]["mean"],
        "rmse_param_diff": last["reuse"]["rmse"],
        "control_max_param_diff": last["control"]["max"],
        "control_mean_param_diff": last["control"]["mean"],
        "control_rmse_param_diff": last["control"]["rmse"],
        **{f"reuse_vs_control_{k}_param_diff": last["reuse_vs_control"][k] for k in ("max", "mean", "rmse")},
        "worst_step_max_param_diff": _worst(r["param_diff"]["reuse"]["max"] for r in rows),
        "runs": {"dense": "reference: fp32, stock Megatron dense schedule, local attention",
                 "reuse": f"{'bf16' if low else 'fp32'}, prefix reuse",
                 "control": ("bf16, stock dense" if low else
                             "fp32, dense with fused-SDPA attention (the other kernel)")},
        "param_diff_basis": "per entry |a - r| / max|r| of its tensor, fp32 master weights after "
                            "the last update (tools/replay_runs.py [Note: relative parameter "
                            "difference])",
        "trace_stats": {k: v for k, v in stats.summary().items() if k != "ideal_speedup"},
        "trace_stats_basis": "the whole trace",
        "rows": rows,
    }


def _worst(values) -> float:
    """max, but inf if any value is NaN or inf (Python's max drops a NaN that comes second)."""
    values = list(values)
    return math.inf if not all(math.isfinite(v) for v in values) else max(values)


def format_summary(result: dict) -> str:
    """The paper's table: max / mean / RMSE parameter difference after the last update."""
    head = (f"{result['steps']} AdamW steps of {result['trace']} ({result['precision']}); "
            "relative parameter difference vs fp32 dense after the last update")
    low = result["precision"] == "bf16"
    rows = [("reuse vs dense" + (" (bf16 reuse)" if low else ""), ""),
            ("bf16 dense vs dense" if low else "dense, fused-SDPA kernel vs dense", "control_"),
            ("reuse vs bf16 dense" if low else "reuse vs dense with fused-SDPA kernel",
             "reuse_vs_control_")]
    lines = [head, "| comparison | max | mean | RMSE |", "|---|---|---|---|"]
    for label, prefix in rows:
        k = lambda stat: f"{prefix}{stat}_param_diff"  # noqa: E731
        lines.append(f"| {label} | {result[k('max')]:.3e} | {result[k('mean')]:.3e} | "
                     f"{result[k('rmse')]:.3e} |")
    return "\n".join(lines)


def write_png(result: dict, path: Path) -> None:
    """Loss, gradient norm and parameter difference per step of a replay result (its JSON)."""
    from benchlib.plotting import line_chart, panels, save

    steps = [r["step"] for r in result["rows"]]
    fig, axes = panels(3)
    col = lambda key, run: [r[key][run] for r in result["rows"]]  # noqa: E731
    runs = ("dense", "reuse", "control")
    line_chart(axes[0], title="loss", xlabel="step", styles={"reuse": "dashed"},
               series={n: (steps, col("loss", n)) for n in runs})
    line_chart(axes[1], title="grad norm (before clipping)", xlabel="step",
               series={n: (steps, col("grad_norm", n)) for n in runs}, styles={"reuse": "dashed"})
    diff = lambda run, k: [r["param_diff"][run][k] for r in result["rows"]]  # noqa: E731
    line_chart(axes[2], title="parameter difference vs fp32 dense (relative)", xlabel="step",
               log_y=True, series={
                   "reuse max": (steps, diff("reuse", "max")),
                   "reuse rmse": (steps, diff("reuse", "rmse")),
                   "control max": (steps, diff("control", "max")),
                   "control rmse": (steps, diff("control", "rmse"))},
               styles={"control max": "dashed", "control rmse": "dashed"})
    fig.suptitle(f"{result['steps']} AdamW steps of {Path(result['trace']).name} "
                 f"({result['precision']}); control: {result['runs']['control']}", fontsize=10)
    save(fig, path)


def replot(argv) -> int:
    """`--replot JSON PNG`: the PNG of a saved --json result, without running anything."""
    if len(argv) != 3:
        print("replay.py: error: --replot takes a result JSON and a PNG path", file=sys.stderr)
        return 2
    try:
        result = json.loads(Path(argv[1]).read_text())
    except (OSError, ValueError) as exc:
        print(f"replay.py: error: {argv[1]}: not a replay --json result ({exc})", file=sys.stderr)
        return 1
    try:
        check_output(argv[2], "--replot PNG")
        if not isinstance(result, dict):
            raise TypeError(f"a JSON {type(result).__name__}, not an object")
        write_png(result, Path(argv[2]))
    except ValueError as exc:
        print(f"replay.py: error: {exc}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, IndexError) as exc:
        print(f"replay.py: error: {argv[1]}: not a replay --json result (no {exc}); give a "
              "file that replay.py --json wrote", file=sys.stderr)
        return 1
    print(f"wrote {argv[2]}")
    return 0


def check_output_paths(args) -> None:
    """ValueError before any work for an output that could not be written after it (a write
    probe: read-only and full disks too, tools/outputs.py)."""
    check_output(args.json, "--json", inputs=[args.trace])
    check_output(args.png, "--png", inputs=[args.trace])
    check_output_dir(args.checkpoint_dir, "--checkpoint-dir")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--replot"]:
        return replot(argv)
    args = parse_args(argv)
    try:
        check_output_paths(args)
        read_header(args.trace)
        start = time.perf_counter()
        result = replay(args, progress=Progress)
    except ValueError as exc:
        print(f"replay.py: error: {exc}", file=sys.stderr)
        return 1
    result["wall_seconds"] = time.perf_counter() - start
    print(format_summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        write_png(result, args.png)
    diffs = [v for k, v in result.items() if k.endswith("param_diff")]
    if not all(math.isfinite(v) for v in diffs):
        print("replay.py: error: a parameter difference is not finite (NaN or inf weights)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
