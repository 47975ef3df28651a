"""The bench at equal memory: `--memory-budget-mib`, and `memory.capacity_ratio`.

Both use the accounting model's predictions (prefix_schedule/planning/memory_model.py) for the
bench's model in fp32 (its parameters' dtype):
- `--memory-budget-mib M`: the reuse plan is `plan_microbatches(..., memory_budget_bytes=M MiB)`
  (packing, prefix chunks and, with `--recompute none`, offload; the models' recompute is
  `--recompute` for every path), the dense path the most [prefix; suffix] rows per microbatch
  whose predicted peak fits (timed as `dense_batched`, or `dense` at one row). The JSON's
  `memory_budget` has both choices and `speedup_at_equal_memory` = that dense time / reuse time.
- `memory.capacity_ratio`: with the dense step's device bytes (saved-tensor accounting,
  tools/memory_probe.py; not an allocator) as the budget, the
  longest trajectory reuse fits over the longest dense fits, at the bench's prefix share and
  group size, one trajectory per microbatch for both (tools/capacity.py's `--pack trajectory`),
  recompute as `--recompute` (reuse: with or without offload, prefix chunks as fit best).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from prefix_schedule.planning.memory_model import ActivationModel, MemoryOptions
from prefix_schedule.planning.memory_plan import dense_rows_within_budget
from prefix_schedule.planning.planner import StepPlan, plan_microbatches

__all__ = ["activation_model", "budget_plan", "budget_report", "capacity_ratio",
           "check_budget_config", "dense_rows", "CAPACITY_BASIS"]

MIB = 2 ** 20
CAPACITY_BASIS = ("longest trajectory reuse / dense within the dense step's device bytes "
                  "(saved-tensor accounting, not an allocator), predicted by prefix_schedule/planning/memory_model.py at the bench's "
                  "prefix share and group size, one trajectory per microbatch, same recompute "
                  "(reuse: offload and prefix chunks as fit best); tools/capacity.py --pack "
                  "trajectory")


def activation_model(config) -> ActivationModel:
    # the GDN bench model's attention layers rotate a quarter of each head (benchlib/hybrid.py)
    rotary = 0.25 if config.linear_attention_freq is not None else 1.0
    return ActivationModel(dims=config.model_dims(), act_bytes=4, rotary_percent=rotary)


def _options(config) -> List[MemoryOptions]:
    if config.recompute == "full":
        return [MemoryOptions(recompute="full")]
    if config.offload_prefix_activations:
        return [MemoryOptions(offload=True)]
    return [MemoryOptions(), MemoryOptions(offload=True)]


def check_budget_config(config) -> None:
    """ValueError for what --memory-budget-mib cannot model."""
    if config.memory_budget_mib is None:
        return
    if not config.memory_budget_mib > 0:
        raise ValueError(f"--memory-budget-mib={config.memory_budget_mib}; give MiB > 0")
    if config.recompute == "selective" or config.tree or config.num_experts \
            or config.world_size > 1:
        raise ValueError("--memory-budget-mib models one process, one shared prompt per group, "
                         "dense MLPs and --recompute none or full; drop --recompute selective, "
                         "--tree, --num-experts and parallel layouts")


def dense_rows(config) -> int:
    """Rows per dense microbatch within the budget (ValueError if one row does not fit)."""
    rows = config.num_groups * config.group_size
    return dense_rows_within_budget(activation_model(config), config.row_len, rows,
                                    config.memory_budget_mib * MIB, config.recompute)


def budget_plan(config, batch) -> StepPlan:
    from benchlib.hybrid import is_hybrid

    return plan_microbatches(batch, token_budget=config.token_budget,
                             max_seq_len=config.max_seq_len,
                             prefix_chunk_tokens=config.prefix_chunk_tokens,
                             memory_budget_bytes=int(config.memory_budget_mib * MIB),
                             memory_model=activation_model(config),
                             memory_options=_options(config),
                             state_reads=is_hybrid(config))


def budget_report(config, plan: StepPlan, median: Dict[str, float]) -> Optional[dict]:
    """The JSON's `memory_budget` (None without --memory-budget-mib)."""
    if config.memory_budget_mib is None:
        return None
    from prefix_schedule.planning.memory_model import dense_peak_bytes

    rows = config.dense_rows_per_microbatch
    dense_path = "dense_batched" if rows > 1 else "dense"
    choice = plan.memory
    return {"budget_mib": config.memory_budget_mib,
            "reuse": {"offload_prefix_activations": choice.options.offload,
                      "recompute": choice.options.recompute,
                      "token_budget": choice.token_budget,
                      "prefix_chunk_tokens": choice.prefix_chunk_tokens,
                      "predicted_peak_bytes": choice.peaks, "explanation": choice.describe()},
            "dense": {"micro_batch_size": rows, "path": dense_path,
                      "predicted_peak_bytes": dense_peak_bytes(
                          activation_model(config), [rows * config.row_len], config.recompute)},
            "speedup_at_equal_memory": median[dense_path] / median["reuse"]}


def capacity_ratio(config, budget_bytes: float) -> Optional[float]:
    """memory.capacity_ratio (module docstring); None when dense fits nothing."""
    import capacity  # tools/capacity.py

    if config.recompute == "selective" or config.tree or config.num_experts:
        return None  # not modelled (memory_model.py: recompute none or full, dense MLPs)
    models = [activation_model(config)]
    share = config.prefix_len / (config.prefix_len + config.suffix_len)
    G = config.group_size
    recompute = config.recompute
    dense = capacity.longest(
        lambda T: capacity.dense_peak(models, T, G, "trajectory", recompute, 1) <= budget_bytes)
    options = [MemoryOptions(recompute="full")] if recompute == "full" \
        else [MemoryOptions(), MemoryOptions(offload=True)]
    reuse = max(capacity.longest(lambda T: capacity.reuse_peak(
        models, T, G, "trajectory", option, share, 1)[0] <= budget_bytes) for option in options)
    return reuse / dense if dense else None
