"""A step's rank-local checks, refused by every rank together before any collective.

[Note: agreed refusal]
A check that reads this rank's own data (its batch, its plan, its lengths, its groups) can fail on
one rank only. Raised there, the other ranks would already wait in the step's first collective
(the expert-parallel schedule check, a pipeline p2p, an MoE token exchange, a context-parallel
K/V gather, the DDP gradient all-reduce) for a rank that never comes: on NCCL a hang until the
collective timeout (gloo often errors sooner, which hides it on CPU). So a step's checks never
raise on their own. Every rank runs them and keeps its ValueError (`StepChecks.run`); every rank
then reaches the step's one agreement point (`StepChecks.agree`):
1. with MoE and expert parallelism, the expert-parallel (x expert-TP) ranks all-gather what must
   be equal among them (the reuse schedule's compute actions, the dense step's microbatch count;
   a rank whose checks failed sends "failed") -- the check that existed before, now in place;
2. one MAX all-reduce over all ranks of the job (only the replica's own ranks when the
   data-parallel replicas share no collective in the step: no DDP wrapper, EP or CP; a device
   tensor on the model's device: NCCL reduces no host tensors) of a failure flag and, per data-parallel rank, the max and -min of
   the step fingerprints of that replica's ranks (its TP, PP and CP ranks run one step together,
   so they must hold one plan and one batch -- the fingerprint folds in a digest of the data:
   `Shared`). Every rank learns whether any rank failed, and if one
   did, every rank raises `StepRefused` (a ValueError) naming the failing rank(s) with their
   messages (all-gathered on this failure path only, as fixed-size byte tensors on the device),
   the failing rank chaining its own error; a replica whose ranks hold different steps is
   refused on every rank alike. Nothing was computed.
On the happy path that is one tiny all-reduce per step (1 + 2 x DP int64s; none in a one-rank
job). A rank that fails
before it reaches the executor (reading its data, placing, planning, building the `ReuseStep`)
joins the executor's agreement with `refuse_step(model, error)`: the same collectives in the same
order, so the ranks still waiting in the executor raise with it. Only ValueErrors (bad input) are
agreed; any other exception is a bug or a crash and ends its rank as before (the launchers name
the rank that failed first: megatron_patches/support/failures.py).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["StepRefused", "StepChecks", "Shared", "agree", "refuse_step", "model_device",
           "fingerprint"]

MESSAGE_BYTES = 2048
"""Bytes of each failing rank's message that its peers see (the rank itself keeps all of it)."""

_FAILED = -1
"""The expert-parallel value of a rank whose own checks failed (compared with nothing)."""
_NONE = -(2 ** 63)
"""An empty slot of the agreement all-reduce (MAX)."""


class StepRefused(ValueError):
    """Raised on every rank when any rank's checks refused the step ([Note: agreed refusal])."""

    def __init__(self, message: str, ranks: Sequence[int], messages: Dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        """Global ranks whose checks failed."""
        self.messages = dict(messages)
        """Global rank -> its message (peers' cut to MESSAGE_BYTES)."""


def model_device(model) -> torch.device:
    """The device of `model`'s parameters (a module or Megatron wrapper); the current CUDA device
    (or the CPU) for a model without parameters."""
    for p in model.parameters():
        return p.device
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def fingerprint(text: str) -> int:
    """An int >= 0 (56 bits) that differs, but for a crc32 collision, when `text` differs."""
    return (zlib.crc32(text.encode()) << 24) | (len(text) & 0xFFFFFF)


@dataclasses.dataclass(frozen=True)
class Shared:
    """A value that every rank of one set must hold alike (this rank is in set `index` of
    `count`; `value` None: this rank has none); `mismatch(sets)` names the sets that differ."""

    index: int
    count: int
    value: Optional[int]
    mismatch: Callable[[List[int]], str]


def agree(error: Optional[BaseException], *, device, group=None,
          shared: Optional[Shared] = None) -> None:
    """Called once at the same point by every rank of `group` (default: all ranks): returns if no
    rank's `error` is set (and every set of `shared` holds one value), else raises `StepRefused`
    on every rank. One MAX all-reduce of a flag (and two slots per set of `shared`: max and -min
    of its values); with a failure, one all-gather of the messages. Without peers, `error` itself
    is raised. Every rank must pass `shared` alike but for `index` and `value`."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        if error is not None:
            raise error
        return
    slots = torch.full((1 + 2 * (shared.count if shared else 0),), _NONE, dtype=torch.int64)
    slots[0] = 0 if error is None else 1
    if shared is not None and shared.value is not None and error is None:
        slots[1 + 2 * shared.index:3 + 2 * shared.index] = torch.tensor([shared.value,
                                                                         -shared.value])
    slots = slots.to(device)
    _all_max(slots, group)
    slots = slots.cpu().tolist()
    if slots[0]:
        messages = _gather_messages(None if error is None else str(error), device, group, world)
        refused = StepRefused(_describe(messages, dist.get_rank(), error), sorted(messages),
                              messages)
        raise refused from error
    differ = [i for i in range(shared.count if shared else 0)
              if slots[1 + 2 * i] != _NONE and slots[1 + 2 * i] != -slots[2 + 2 * i]]
    if differ:  # every rank saw every set: all raise alike
        raise StepRefused(shared.mismatch(differ), (), {})


def _all_max(slots: torch.Tensor, group) -> None:
    """MAX all-reduce over `group`; over all ranks (None) in two steps on Megatron's own groups
    when it is initialised -- data parallel (with context parallel), then model parallel (tensor
    x pipeline), which together span every rank -- so the wait for a stalled peer ends at the
    collective timeout those groups were built with, not at the default group's (often the
    long start-up timeout)."""
    from megatron.core import parallel_state as ps

    if group is not None or not ps.model_parallel_is_initialized():
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=group)
        return
    for part in (ps.get_data_parallel_group(with_context_parallel=True),
                 ps.get_model_parallel_group()):
        if dist.get_world_size(part) > 1:
            dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=part)


def _gather_messages(mine: Optional[str], device, group, world: int) -> Dict[int, str]:
    """Global rank -> message of every failing rank (a fixed-size byte row per rank: a device
    tensor, so NCCL gathers it too; the first byte says whether the rank failed)."""
    row = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
    if mine is not None:
        data = mine.encode()[:MESSAGE_BYTES]
        row[0] = 1
        row[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    out = {}
    for i, other in enumerate(rows):
        other = other.cpu()
        if int(other[0]):
            text = bytes(other[1:].tolist()).rstrip(b"\0").decode(errors="ignore")
            out[dist.get_global_rank(group, i) if group is not None else i] = text
    return out


def _describe(messages: Dict[int, str], me: int, error: Optional[BaseException]) -> str:
    """"rank 1 refused the step ...: <message>"; identical messages share one entry."""
    if error is not None:
        messages = {**messages, me: str(error)}  # this rank's in full
    by_text: Dict[str, List[int]] = {}
    for rank in sorted(messages):
        by_text.setdefault(messages[rank], []).append(rank)
    ranks = sorted(messages)
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    head = (f"{who} refused the step (every rank stops here, before any compute: [Note: agreed "
            "refusal] in megatron_patches/runtime/agreement.py)")
    if len(by_text) == 1:
        return f"{head}: {next(iter(by_text))}"
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
             for text, r in by_text.items()]
    return head + ":\n" + "\n".join(parts)


class StepChecks:
    """One step's checks on this rank ([Note: agreed refusal]): `run` them, then `agree` once."""

    def __init__(self, model) -> None:
        """`model`: this rank's model (a chunk; a Megatron wrapper is fine)."""
        self.model = model
        self.error: Optional[ValueError] = None
        """The first check that failed on this rank."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def run(self, check: Callable, *args, **kwargs):
        """`check(*args, **kwargs)`'s value, or None once a check has failed (then it is not
        run: later checks may need what an earlier one refused); a ValueError is kept."""
        if self.error is not None:
            return None
        try:
            return check(*args, **kwargs)
        except ValueError as error:
            self.error = error
            return None

    def fail(self, error: ValueError) -> "StepChecks":
        """Record a check that failed outside `run`."""
        if self.error is None:
            self.error = error
        return self

    def agree(self, expert_parallel: Optional[int] = None,
              mismatch: Optional[Callable[[List[int]], str]] = None,
              replica: Optional[int] = None) -> None:
        """The step's agreement point; raises `StepRefused` on every rank if any rank failed.
        `expert_parallel`: what must be equal on the expert-parallel (x expert-TP) ranks of an MoE
        model (`mismatch(values)` says what to fix when it is not); `replica`: what must be equal
        on the ranks of this rank's data-parallel replica (its TP, PP and CP ranks run one step
        together: the same plan, the same row lengths). Both are `fingerprint`s."""
        device = model_device(self.model)
        group = _expert_parallel_group(self.model)
        if group is not None:  # every rank joins, a failed one with "failed"
            values = _gather_values(group, None if self.error else expert_parallel, device)
            if self.error is None and _FAILED not in values and len(set(values)) > 1:
                self.error = ValueError(mismatch(values) if mismatch else
                                        f"the expert-parallel ranks differ: {values}")
        agree(self.error, device=device, **_scope(self.model, replica))


def _scope(model, replica: Optional[int]) -> dict:
    """The ranks whose step this one is ([Note: agreed refusal]): all ranks, unless the
    data-parallel replicas share no collective in it (no DDP wrapper, no expert or context
    parallelism): then only this replica's (tensor x pipeline) ranks, so that a replica may run
    a step of its own (a one-rank reference next to idle peers) without waiting for the rest."""
    from megatron.core import parallel_state as ps

    if (not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1
            or ps.get_expert_model_parallel_world_size() > 1
            or ps.get_context_parallel_world_size() > 1 or _data_parallel_wrapped(model)):
        return {"group": None, "shared": _replica(replica)}
    return {"group": ps.get_model_parallel_group(),
            "shared": Shared(0, 1, replica, _replica_mismatch)}


def _data_parallel_wrapped(model) -> bool:
    """A DDP-wrapped model (Megatron's, or torch's): its step all-reduces over data parallel."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return any(hasattr(m, "ddp_config") or isinstance(m, torch.nn.parallel.DistributedDataParallel)
               for m in chunks)


def _replica(value: Optional[int]) -> Optional[Shared]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return Shared(parallel_state.get_data_parallel_rank(),
                  parallel_state.get_data_parallel_world_size(), value, _replica_mismatch)


def _replica_mismatch(replicas: List[int]) -> str:
    return (f"the ranks of data-parallel rank{'s' if len(replicas) > 1 else ''} "
            f"{', '.join(map(str, replicas))} (the tensor-, pipeline- and context-parallel ranks "
            "that run one step together) were given different steps (plans, microbatch counts, "
            "row lengths, or data: token ids, masks, advantages, log-probs): their p2p and "
            "collectives would not pair up, or would train on mixed data. Give every rank of a "
            "replica the same batch and plan, e.g. place_groups(batch, dp_size=...).ranks["
            "parallel_state.get_data_parallel_rank()] of the same global batch")


def refuse_step(model, error: ValueError) -> None:
    """Raise `error` on every rank: this rank's data path refused the step before the executor
    (planning, building the ReuseStep), and its peers wait at the executor's agreement point."""
    StepChecks(model).fail(error).agree()
    raise error  # pragma: no cover - agree raised


def _expert_parallel_group(model):
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    if not get_model_config(model).num_moe_experts:
        return None
    # expert-parallel and expert-tensor-parallel ranks (expert TP = TP: moe.check_moe_supported)
    group = parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    return None if group is None or group.size() == 1 else group


def _gather_values(group, value: Optional[int], device) -> List[int]:
    mine = torch.tensor([_FAILED if value is None else value], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(everyone, mine, group=group)
    return [int(t.item()) for t in everyone]
