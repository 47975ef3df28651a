"""Make, import, check and describe RL traces (prefix_schedule/traces: JSON lines, never pickle).

    python tools/trace.py synth --kind rag --steps 100 --seed 0 --out rag.jsonl [--max-seq-len 512]
    python tools/trace.py validate rag.jsonl [--vocab-size V]
    python tools/trace.py stats rag.jsonl [--json stats.json]
    python tools/trace.py import-generic rollouts.jsonl --out trace.jsonl [--vocab-size V]
    python tools/trace.py import-megatron LOGDIR_OR_FILES... --out trace.jsonl [--vocab-size V]

A name ending in .gz is read / written gzip-compressed. `validate` exits 1 with the first
malformed field (file:line, step, group, response, entry, and what to fix); `stats` validates
too and prints steps, group sizes, lengths, prefix shares and the FLOP model's ideal speedup
of prefix reuse for Llama3-8B / Qwen3-8B shapes. The generic layout (one JSON line per
trajectory, as verl / NeMo-RL keep a step) is described in prefix_schedule/traces/generic.py
and the README; import-megatron reads Megatron-LM's `--langrl-log-dir` rollout dumps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first

from prefix_schedule.traces import TraceHeader, TraceWriter, validate_trace  # noqa: E402
from prefix_schedule.traces.generic import import_generic  # noqa: E402
from prefix_schedule.traces.megatron_rl import import_megatron_rollouts  # noqa: E402
from prefix_schedule.traces.synth import KINDS, SynthConfig, synth_steps  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from argtypes import int_list  # noqa: E402
from outputs import check_output, write_text_atomic  # noqa: E402

__all__ = ["main", "synth", "format_stats"]


def synth(config: SynthConfig, out: Path) -> int:
    """Write the synthetic trace; returns the number of groups."""
    header = TraceHeader(vocab_size=config.vocab_size,
                         source=f"tools/trace.py synth --kind {config.kind} --seed {config.seed}",
                         metadata={"synth": {k: (list(v) if isinstance(v, tuple) else v)
                                             for k, v in config.__dict__.items()}})
    with TraceWriter(out, header) as writer:
        for step, (batch, rewards) in enumerate(synth_steps(config)):
            for group, group_rewards in zip(batch.groups, rewards):
                writer.write_group(group, step=step, rewards=group_rewards)
        return writer.num_groups


def format_stats(path: Path, summary: dict) -> str:
    share = summary["prefix_share"]
    sizes = ", ".join(f"{g}x{c}" for g, c in summary["group_sizes"].items())
    lines = [
        f"{path}: {summary['steps']} steps, {summary['groups']} groups, "
        f"{summary['trajectories']} trajectories (group size x count: {sizes})",
        f"prefix share per group: min {share['min']:.3f}  p10 {share['p10']:.3f}  median "
        f"{share['median']:.3f}  p90 {share['p90']:.3f}  max {share['max']:.3f}  "
        f"(token-weighted {share['token_weighted']:.3f})",
        f"tokens: dense {summary['dense_tokens']:,}  with reuse {summary['reuse_tokens']:,}  "
        f"(ratio {summary['token_ratio']:.2f}x); loss tokens {summary['loss_tokens']:,}",
        f"longest prompt+response {summary['max_seq_len']}, longest response "
        f"{summary['max_response_len']}; vocab_size {summary['vocab_size']} (max id "
        f"{summary['max_token_id']}); old log-probs {'yes' if summary['old_logprobs'] else 'no'}, "
        f"ref log-probs {'yes' if summary['ref_logprobs'] else 'no'}",
        "ideal speedup (FLOP model, prefix_schedule/planning/flops.py): " + ", ".join(
            f"{name} {value:.2f}x" for name, value in summary["ideal_speedup"].items()),
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="synthetic trace with realistic length distributions")
    s.add_argument("--kind", choices=sorted(KINDS), required=True,
                   help="rag: prefix share 80-98%%; math: 2-12%%")
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--groups-per-step", type=int, default=4)
    s.add_argument("--group-sizes", type=int_list, default="8,16,32,64",
                   help="comma list to draw from")
    s.add_argument("--max-seq-len", type=int, default=4096, help="longest prompt + response")
    s.add_argument("--vocab-size", type=int, default=32000)
    for name, helptext in (("validate", "check every field; exit 1 on the first bad one"),
                           ("stats", "validate and summarise")):
        v = sub.add_parser(name, help=helptext)
        v.add_argument("trace", type=Path)
        v.add_argument("--vocab-size", type=int, default=None, help="override the header's")
        if name == "stats":
            v.add_argument("--json", type=Path, default=None)
    g = sub.add_parser("import-generic", help="one JSON line per trajectory (verl / NeMo-RL)")
    g.add_argument("input", type=Path)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--vocab-size", type=int, default=None)
    m = sub.add_parser("import-megatron", help="Megatron-LM --langrl-log-dir rollout dumps")
    m.add_argument("inputs", type=Path, nargs="+", help="log dir(s) or rollouts_rank*_iteration*.json")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--vocab-size", type=int, default=None)
    m.add_argument("--old-logprobs", choices=("inference", "none"), default="inference",
                   help="old log-probs = the dump's inference log-probs, or none (ratio 1)")
    m.add_argument("--missing-logprobs", choices=("error", "mask"), default="error",
                   help="generated tokens without an inference log-prob: refuse, or give no loss")
    return p


def _check_outputs(args) -> None:
    """Every output path before any work: its directory exists and it is not an input."""
    inputs = {"import-generic": lambda: [args.input], "import-megatron": lambda: args.inputs,
              "stats": lambda: [args.trace]}.get(args.command, list)()
    if args.command == "stats":
        check_output(args.json, "--json", inputs=inputs)
    elif args.command != "validate":
        check_output(args.out, "--out", inputs=inputs)


def _run(args) -> int:
    _check_outputs(args)
    if args.command == "synth":
        sizes = args.group_sizes
        config = SynthConfig(kind=args.kind, steps=args.steps, seed=args.seed,
                             groups_per_step=args.groups_per_step, group_sizes=sizes,
                             max_seq_len=args.max_seq_len, vocab_size=args.vocab_size)
        print(f"wrote {args.out}: {args.steps} steps, {synth(config, args.out)} groups")
    elif args.command in ("validate", "stats"):
        summary = validate_trace(args.trace, vocab_size=args.vocab_size).summary()
        if args.command == "validate":
            print(f"{args.trace}: OK ({summary['steps']} steps, {summary['groups']} groups, "
                  f"{summary['trajectories']} trajectories)")
        else:
            print(format_stats(args.trace, summary))
            if args.json:
                write_text_atomic(args.json, json.dumps(summary, indent=2) + "\n")
    elif args.command == "import-generic":
        steps = import_generic(args.input, args.out, vocab_size=args.vocab_size)
        print(f"wrote {args.out}: {steps} steps")
    else:
        summary = import_megatron_rollouts(args.inputs, args.out, vocab_size=args.vocab_size,
                                           old_logprobs=args.old_logprobs,
                                           missing_logprobs=args.missing_logprobs)
        print(f"wrote {args.out}: {summary['steps']} steps, {summary['groups']} groups "
              f"({summary['dropped_groups']} all-placeholder groups dropped) from "
              f"{len(summary['files'])} file(s)")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"trace.py {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
