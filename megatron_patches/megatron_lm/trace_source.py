"""The project's own trace format (prefix_schedule/traces, written by `tools/trace.py`) as an
`--rl-trace` reader of the Megatron-LM entry point: registered as "prefix-reuse-trace", claiming
`.jsonl` / `.jsonl.gz` files by name and any file whose first line is this format's header by
content (megatron_patches/megatron_lm/data.py resolves readers).

    python tools/trace.py synth --kind rag --steps 4 --max-seq-len 64 --vocab-size 512 --out t.jsonl
    torchrun ... examples/megatron_lm/train_grpo.py ... --rl-trace t.jsonl

Step i of the trace is iteration i of training (a resumed run reads the step it stopped at).
Reading is streamed: sequential iterations continue one pass through the file; a jump (resume)
starts a new pass. The whole file is validated once when the reader opens (before any process
group exists): a corrupt or truncated `.gz`, a bad line, or a row longer than `--seq-length` is a
ValueError naming the file and line before iteration 1 (one streamed pass, linear in the file),
not after hours of training.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

from prefix_schedule import GroupBatch
from prefix_schedule.traces import FORMAT, read_header, read_steps, validate_trace
from prefix_schedule.traces.io import open_text

__all__ = ["TraceSteps", "is_trace_file", "READER_NAME", "EXTENSIONS"]

READER_NAME = FORMAT
EXTENSIONS = (".jsonl", ".jsonl.gz")


class TraceSteps:
    """`StepSource` over a prefix-reuse trace: `step(i)` is the trace's step i."""

    def __init__(self, path: str, args=None) -> None:
        self.path = str(path)
        self.header = read_header(self.path)  # ValueError unless it is this format
        vocab = getattr(args, "padded_vocab_size", None) if args is not None else None
        if vocab and self.header.vocab_size and self.header.vocab_size > vocab:
            raise ValueError(f"--rl-trace {self.path}: the trace's vocab_size "
                             f"{self.header.vocab_size} exceeds the model's {vocab}; give "
                             "Megatron a --vocab-size that covers the trace's token ids")
        stats = validate_trace(self.path, models={})  # the whole file, before iteration 1
        seq_length = getattr(args, "seq_length", None) if args is not None else None
        if seq_length and stats.max_seq_len > seq_length:
            raise ValueError(f"--rl-trace {self.path}: its longest [prompt; response] row has "
                             f"{stats.max_seq_len} tokens, over --seq-length {seq_length}; give "
                             f"--seq-length {stats.max_seq_len} (and --max-position-embeddings "
                             "at least that) or a trace of shorter rows")
        self.num_steps = stats.num_steps
        self._steps: Optional[Iterator[GroupBatch]] = None
        self._next = 0

    def step(self, iteration: int) -> GroupBatch:
        if iteration != self._next or self._steps is None:
            self._steps = read_steps(self.path, start=iteration)  # streamed from there on
        batch = next(self._steps, None)
        if batch is None:
            raise ValueError(f"--rl-trace {self.path} has no step {iteration} (its steps end "
                             f"before it): give --train-iters at most the trace's step count, "
                             "or a longer trace")
        self._next = iteration + 1
        return batch


def is_trace_file(path: str) -> bool:
    """True if the file's first line is this format's header (by content, any file name)."""
    try:
        with open_text(path) as f:
            first = f.readline(1 << 16)
        return isinstance(header := json.loads(first), dict) and header.get("format") == FORMAT
    except (OSError, ValueError, UnicodeDecodeError, EOFError):
        return False


def _register() -> None:
    from megatron_patches.megatron_lm.data import register_trace_reader

    register_trace_reader(READER_NAME, TraceSteps, EXTENSIONS, sniff=is_trace_file)


_register()
