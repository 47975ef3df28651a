"""Dense vs AReaL's tree training vs prefix reuse on one workload, on the token measure
(benchlib/areal_peer.py says what each count is and what was emulated). Run it in the
frameworks environment (AReaL 1.0.4):

    .venv-frameworks/bin/python tools/peer_areal.py                      # prefix 4096, G=16, suffix 256
    .venv-frameworks/bin/python tools/peer_areal.py --workload multi-turn
    .venv-frameworks/bin/python tools/peer_areal.py --budgets 2048 8192 65536 --json out.json

Prints one table (budget, method, micro-batches, tokens fed, real tokens). Token counts are
deterministic; nothing is timed. Exit status 2 on bad arguments or without AReaL.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import areal_harness  # noqa: E402
from benchlib.areal_peer import (compare, format_rows, grpo_workload,  # noqa: E402
                                 multi_turn_workload)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("grpo", "multi-turn"), default="grpo")
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--suffix-len", type=int, default=256)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 8192, 65536])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.budgets) < 2 or min(args.prefix_len, args.group_size, args.suffix_len) < 1:
        print("peer_areal.py: error: budgets >= 2, lengths and group size >= 1", file=sys.stderr)
        return 2
    if not areal_harness.areal_available():
        print(f"peer_areal.py: error: {areal_harness.AREAL_MISSING}", file=sys.stderr)
        return 2
    areal_harness.install_import_stubs()
    if args.workload == "grpo":
        sequences = grpo_workload(args.prefix_len, args.group_size, args.suffix_len)
    else:
        sequences = multi_turn_workload()
    rows = compare(sequences, args.budgets)
    print(f"workload: {args.workload}, {len(sequences)} sequences, "
          f"{sum(s.numel() for s in sequences)} tokens")
    print(format_rows(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
