"""RL traces: a safe, streaming file format for the groups of each optimizer step (format.py),
its reader / writer (io.py), validation and statistics (stats.py), a synthetic generator
(synth.py) and importers (generic.py: one JSON line per trajectory, as verl / NeMo-RL hold
them; megatron_rl.py: Megatron-LM's rollout dumps). No Megatron import, no pickle.

    from prefix_schedule.traces import read_steps
    for batch in read_steps("trace.jsonl"):   # one GroupBatch per step, streamed
        ...
"""
from prefix_schedule.traces.format import FORMAT, FORMAT_VERSION, TraceHeader
from prefix_schedule.traces.io import TraceWriter, iter_groups, read_header, read_steps
from prefix_schedule.traces.stats import MODEL_PRESETS, TraceStats, validate_trace

__all__ = ["FORMAT", "FORMAT_VERSION", "TraceHeader", "TraceWriter", "iter_groups", "read_header",
           "read_steps", "validate_trace", "TraceStats", "MODEL_PRESETS"]
