"""Pipeline schedules as data: the IR, its generator, validator, lowering passes and simulator.

Layers, each importing only those above it:
    ir.py        Action, ActionKind, Schedule (text/CSV forms, exchanges, virtual stages),
                 format_grid
    units.py     prefix units: a group's prefix as one or more chunks
    validate.py  validate_schedule: the dependency rules, one place
    generate.py  build_schedule: 1F1B with prefix work slotted in
    lowering.py  compute-only plan -> + sends/receives -> + grad reduce
    simulate.py  dry run of a lowered plan: p2p matching, deadlock, bubble, memory
Nothing here imports torch or Megatron.
"""

from prefix_schedule.pipeline.generate import build_schedule
from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, ScheduleError, format_grid,
                                         parse_action, peer_dependency, peer_stage,
                                         unit_cost)
from prefix_schedule.pipeline.lowering import lower
from prefix_schedule.pipeline.simulate import (DeadlockError, SimResult, TokenCostModel,
                                               chrome_trace, compare_with_dense, simulate)
from prefix_schedule.pipeline.units import StepShape, chunk_spans, number_units
from prefix_schedule.pipeline.validate import validate_schedule

__all__ = ["Action", "ActionKind", "DeadlockError", "Schedule", "ScheduleError", "SimResult",
           "StepShape", "TokenCostModel", "build_schedule", "chrome_trace", "chunk_spans",
           "compare_with_dense", "format_grid", "lower", "number_units", "parse_action",
           "peer_dependency", "peer_stage", "simulate", "unit_cost", "validate_schedule"]
