"""Rollout traces for Megatron-LM RL's `train_rl.py` replayed by
examples/megatron_lm/train_rl_prefix_reuse.py `--replay-trace` (docs/FRAMEWORKS.md).

    python tools/train_rl_trace.py synth --out trace.json --collections 2 --groups 2 \\
        --group-size 4 --vocab-size 256 --eod 255 [--prompt-len 30] [--max-response-len 15]
    python tools/train_rl_trace.py check trace.json

The format (prefix_schedule/traces/train_rl_replay.py, TRACE_FORMAT): per collection
(one per `--grpo-iterations` RL iterations), per group (`--grpo-prompts-per-step` of them),
the prompt tokens and per member (`--grpo-group-size`) the response tokens ending in the
tokenizer's eod (NullTokenizer: `--vocab-size` - 1), their inference log-probs and the reward.
`synth` writes random ones (seeded); `check` prints the group count or exits 1 naming the fault.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout first

from prefix_schedule.traces.train_rl_replay import (  # noqa: E402
    TRACE_FORMAT, check_trace, synth_trace)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/train_rl_trace.py",
                                     description=__doc__.split("\n\n")[0],
                                     epilog=f"Format: {TRACE_FORMAT}")
    sub = parser.add_subparsers(dest="command", required=True)
    synth = sub.add_parser("synth", help="write a random trace",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--collections", type=int, required=True,
                       help="rollout collections: ceil(--train-iters / --grpo-iterations)")
    synth.add_argument("--groups", type=int, required=True, help="--grpo-prompts-per-step")
    synth.add_argument("--group-size", type=int, required=True, help="--grpo-group-size")
    synth.add_argument("--vocab-size", type=int, required=True)
    synth.add_argument("--eod", type=int, required=True,
                       help="the tokenizer's end-of-document id (NullTokenizer: vocab size - 1)")
    synth.add_argument("--prompt-len", type=int, default=30,
                       help="group g's prompt has prompt-len + 4 g tokens")
    synth.add_argument("--max-response-len", type=int, default=15,
                       help="responses of 6 to this many tokens, eod included")
    synth.add_argument("--seed", type=int, default=7)
    check = sub.add_parser("check", help="count the groups of a trace")
    check.add_argument("trace", type=Path)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "synth":
            if min(args.collections, args.groups, args.group_size, args.prompt_len) < 1:
                raise ValueError("--collections, --groups, --group-size and --prompt-len must "
                                 "be >= 1")
            synth_trace(str(args.out), collections=args.collections, groups=args.groups,
                        group_size=args.group_size, eod=args.eod, vocab_size=args.vocab_size,
                        prompt_len=args.prompt_len, max_response_len=args.max_response_len,
                        seed=args.seed)
            print(f"wrote {args.out}: {args.collections * args.groups} groups of "
                  f"{args.group_size}")
        else:
            print(f"{args.trace}: {check_trace(str(args.trace))} groups")
    except ValueError as error:
        print(f"train_rl_trace.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
