"""Pipeline schedules as data: the IR, its generator, validator, lowering passes and simulator.

Layers, each importing only those above it:
    support.py     IR-free helpers: argument checks, the grid printer, GC pause
    ir.py          Action, ActionKind, Schedule (text/CSV forms, exchanges, virtual stages),
                   format_grid
    units.py       prefix units: a group's prefix as one or more chunks
    orders.py      suffix orders of one rank: 1F1B, Megatron's interleaved 1F1B
    validate.py    validate_schedule: the dependency rules, one place
    generate.py    build_schedule: (interleaved) 1F1B with prefix work slotted in
    lowering.py    compute-only plan -> + grouped p2p exchanges -> + grad reduce
    sim_common.py  dry-run results, protocol checks, memory
    nccl.py        the dry run under NCCL p2p semantics
    simulate.py    simulate(): NCCL / blocking / buffered p2p, deadlock, bubble, memory
    baselines.py   token costs, dense 1F1B and interleaved baselines, compare_with_dense
Nothing here imports torch or Megatron.
"""

from prefix_schedule.pipeline.baselines import (TokenCostModel, build_dense_1f1b,
                                                build_dense_interleaved, compare_with_dense)
from prefix_schedule.pipeline.generate import build_schedule
from prefix_schedule.pipeline.ir import (Action, ActionKind, Schedule, ScheduleError, format_grid,
                                         parse_action, peer_dependency, peer_stage, unit_cost)
from prefix_schedule.pipeline.lowering import flatten_exchanges, forward_only, lower
from prefix_schedule.pipeline.simulate import DeadlockError, SimResult, chrome_trace, simulate
from prefix_schedule.pipeline.units import StepShape, chunk_spans, number_units
from prefix_schedule.pipeline.validate import validate_schedule

__all__ = ["Action", "ActionKind", "DeadlockError", "Schedule", "ScheduleError", "SimResult",
           "StepShape", "TokenCostModel", "build_dense_1f1b", "build_dense_interleaved",
           "build_schedule", "chrome_trace", "chunk_spans", "compare_with_dense",
           "flatten_exchanges", "format_grid", "forward_only", "lower", "number_units",
           "parse_action", "peer_dependency", "peer_stage", "simulate", "unit_cost",
           "validate_schedule"]
