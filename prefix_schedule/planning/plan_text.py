"""The text form of a StepPlan (`StepPlan.describe`)."""
from __future__ import annotations

__all__ = ["describe_plan"]


def describe_plan(self) -> str:
    """StepPlan.describe: prefixes (and prefix units: chunks, tree nodes), then each
    microbatch's segments."""
    prefixes = ", ".join(f"g{w.group}[{w.length}]" for w in self.prefixes) or "none"
    lines = [f"StepPlan: {len(self.microbatches)} microbatches, token budget {self.token_budget}, "
             f"cached prefixes: {prefixes}"]
    if self.row_multiple > 1:
        lines.append(f"  rows padded to a multiple of {self.row_multiple}")
    trees = any(w.nodes is not None for w in self.prefixes)
    if self.prefix_chunk_tokens is not None or trees:
        size = (f"chunks of <= {self.prefix_chunk_tokens} tokens"
                if self.prefix_chunk_tokens is not None else "one per tree node")
        if trees and self.state_reads:
            size += ", cut where a reader stops inside a node (state_reads)"
        lines.append(f"  prefix units ({size}): " + " ".join(
            f"u{u}=g{c.group}c{c.chunk}[{c.start}:{c.start + c.length}]"
            + (f"n{c.node}<c{c.parent_chunk}" if trees and c.parent_chunk is not None else "")
            + (f"+pad{c.padding}" if c.padding else "")
            for u, c in self.prefix_units().items()))
    dense = set()
    for mb in self.microbatches:
        parts = []
        for s in mb.segments:
            mode = f"+{s.cached_len} cached" if s.cached_len else "dense"
            parts.append(f"g{s.group}t{s.trajectory}[{s.length} {mode}]")
            if s.cached_len == 0:
                dense.add(s.group)
        if mb.padding:
            parts.append(f"pad[{mb.padding}]")
        lines.append(f"  mb{mb.index} ({mb.row_length}/{self.token_budget} tokens): " + " ".join(parts))
    lines.append("  groups without cache: " + (", ".join(f"g{g}" for g in sorted(dense)) or "none"))
    if self.memory is not None:
        lines.append(self.memory.describe())
    return "\n".join(lines)
