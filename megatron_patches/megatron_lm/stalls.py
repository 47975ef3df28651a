"""A stalled or dead rank ends the entry point's job within the collective timeout, named.

The timeout: Megatron's `--distributed-timeout-minutes` when given on the command line, else
`$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S` (which examples/megatron_lm/torchrun_multinode.sh and
train_grpo.sbatch export), else Megatron's default (10 minutes). Megatron gives it to the default
process group (its rendezvous at start-up included) and to every group of parallel_state, so a
rank waiting that long for a peer raises. Under torchrun every rank records how it ended in the
job's store (megatron_patches/support/failures.py `report_first_failure`); the rank whose wait
failed prints "[rank R] rank S stalled (...)" naming the rank that recorded nothing, and torchrun
stops the others (SIGTERM; a stopped process gets SIGKILL after torchrun's 30 s grace). So a stall
ends the job within timeout + 5 s, timeout + 35 s at worst -- as examples/train_grpo_megatron.py.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Sequence

import torch

from megatron_patches.support.failures import (COLLECTIVE_TIMEOUT_ENV, collective_timeout_s,
                                               report_first_failure)

__all__ = ["apply_collective_timeout", "failure_report", "FLAG"]

FLAG = "--distributed-timeout-minutes"


def _flag_given(argv: Sequence[str]) -> bool:
    return any(a == FLAG or a.startswith(FLAG + "=") for a in argv)


def apply_collective_timeout(args, argv: Sequence[str]) -> str:
    """Set `args.distributed_timeout_minutes` (see the module docstring); ValueError for a
    timeout that is not > 0. Returns where the timeout came from, for the log."""
    if _flag_given(argv):
        source = FLAG
    elif os.environ.get(COLLECTIVE_TIMEOUT_ENV) is not None:
        args.distributed_timeout_minutes = collective_timeout_s(0) / 60  # ValueError if bad
        source = f"${COLLECTIVE_TIMEOUT_ENV}"
    else:
        source = f"Megatron's default {FLAG}"
    minutes = args.distributed_timeout_minutes
    if minutes is None or not minutes > 0:
        raise ValueError(f"{FLAG} {minutes}: a collective waiting for a stalled peer must end; "
                         "give minutes > 0")
    return source


@contextlib.contextmanager
def failure_report(args):
    """Around everything after argument parsing: under torchrun, a failing rank names the rank
    that failed first (or stalled) and raises `RankFailure`; outside torchrun, nothing."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "MASTER_PORT" not in os.environ:
        yield
        return
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=timeout)
    key = f"prefix_reuse/end/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with report_first_failure(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                              key=key):
        yield
