"""Shared-prefix attention: the public entry points (core.py) and their kernels (backends/)."""

from prefix_schedule.attention.core import (MODES, PackedMeta, causal_attention,
                                            reference_attention, shared_prefix_attention)

__all__ = ["MODES", "PackedMeta", "causal_attention", "reference_attention",
           "shared_prefix_attention"]
