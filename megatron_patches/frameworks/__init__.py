"""Prefix reuse inside RL frameworks: one framework-neutral adapter (docs/FRAMEWORKS.md)."""
from megatron_patches.frameworks.adapter import (AdapterConfig, AdapterResult, LossFn,
                                                 PreparedStep, PrefixReuseAdapter,
                                                 detect_by_group, dims_of_model)
from megatron_patches.frameworks.dense import dense_forward_backward, dense_rows
from megatron_patches.frameworks.rollout import RolloutBatch, TokenBatch

__all__ = ["AdapterConfig", "AdapterResult", "LossFn", "PreparedStep", "PrefixReuseAdapter",
           "RolloutBatch", "TokenBatch", "detect_by_group", "dims_of_model",
           "dense_forward_backward", "dense_rows"]
