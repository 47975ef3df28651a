"""What a Gated DeltaNet or Mamba-2 layer's mixer half saves for backward, per token: the
interface between the kernel-derived formulas and the accounting model.

`memory_model.ActivationModel` counts an attention layer's saved tensors as Megatron's local GPT
layer saves them ([Note: predicted device memory]). A GDN or Mamba-2 layer saves what its GPU
kernels' autograd Functions save (fla's chunk_gated_delta_rule / causal_conv1d / l2norm;
mamba-ssm's chunk scan and causal-conv1d), which differs from what the CPU stand-ins save: the
formulas are derived from those kernels' source, version by version, and held on CPU to the
saved-tensor accounting of a layer run with fakes that save exactly what that source saves
(memory_model_gdn.py, memory_model_mamba.py say which source and which test).
"""
from __future__ import annotations

import dataclasses

__all__ = ["MixerBytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixerBytes:
    """Saved-for-backward bytes of one GDN / Mamba-2 mixer half (its input norm to its output
    projection), on one rank at TP = 1 (every term / TP under sequence parallelism)."""

    per_token: float
    """Per token of a row that runs the whole mixer half."""
    to_state_per_token: float
    """Per token of a prefix whose stage's last layer is this mixer and stops once its state
    and conv tail are made (Phase A keeps no output of that layer: docs/DESIGN.md)."""
    per_sequence: float = 0.0
    """Per sequence of a row, independent of its length (e.g. the initial state a kernel saves
    for each packed sequence)."""

    def __post_init__(self) -> None:
        for name in ("per_token", "to_state_per_token", "per_sequence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"MixerBytes.{name}={value!r}; give a number >= 0")
