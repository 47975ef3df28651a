"""The rollout traces that examples/megatron_lm/train_rl_prefix_reuse.py `--replay-trace` replays
into Megatron-LM RL's `train_rl.py` (megatron_patches/megatron_lm/rl_replay.py's agent):
the format, a check and a random generator (tools/train_rl_trace.py). No Megatron import.
"""
from __future__ import annotations

import json
from pathlib import Path

TRACE_FORMAT = """JSON: [[{"prompt": [ids], "members": [{"response": [ids ending in eod],
"logprobs": [float per response token], "reward": float}, ...G]}, ...groups] ...collections]"""
__all__ = ["TRACE_FORMAT", "check_trace", "synth_trace"]


def check_trace(path: str) -> int:
    """The number of groups of the trace at `path`; ValueError naming what to fix (before any
    compute) when it is not TRACE_FORMAT."""
    try:
        collections = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--replay-trace {path}: not a readable JSON trace ({error}); "
                         f"expected {TRACE_FORMAT}") from None
    ok = isinstance(collections, list) and all(
        isinstance(c, list) and all(isinstance(g, dict) and isinstance(g.get("prompt"), list)
                                    and isinstance(g.get("members"), list) and g["members"]
                                    for g in c) for c in collections)
    groups = sum(len(c) for c in collections) if ok else 0
    if not groups:
        raise ValueError(f"--replay-trace {path}: no groups in the expected layout {TRACE_FORMAT}")
    return groups


def synth_trace(path: str, *, collections: int, groups: int, group_size: int, eod: int,
                vocab_size: int, prompt_len: int = 30, max_response_len: int = 15,
                seed: int = 7) -> None:
    """A random trace (TRACE_FORMAT) at `path`: per collection `groups` prompts of
    `prompt_len + 4 * g` tokens, `group_size` responses of 6..`max_response_len` tokens ending in
    `eod` each, inference log-probs and rewards. Token ids in [3, vocab_size - 6)."""
    import torch

    if not (6 <= max_response_len and vocab_size > 9 and 0 <= eod < vocab_size):
        raise ValueError("synth_trace: give --max-response-len >= 6, --vocab-size > 9 and "
                         "0 <= --eod < --vocab-size")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(collections):
        batch = []
        for g in range(groups):
            prompt = torch.randint(3, vocab_size - 6, (prompt_len + 4 * g,), generator=gen)
            members = []
            for _ in range(group_size):
                n = int(torch.randint(6, max_response_len + 1, (1,), generator=gen))
                response = torch.randint(3, vocab_size - 6, (n - 1,), generator=gen).tolist()
                members.append(dict(response=response + [eod],
                                    reward=float(torch.rand(1, generator=gen)),
                                    logprobs=(-torch.rand(n, generator=gen)).tolist()))
            batch.append(dict(prompt=prompt.tolist(), members=members))
        out.append(batch)
    Path(path).write_text(json.dumps(out))
