"""The multi-process test harness itself: values back in rank order, a failed rank's traceback
and output in the error, a hang killed at the timeout with the hung rank's stack."""

import os

import pytest
import torch

from dist_harness import DistributedRunError, run_distributed


def harness_rank(mode: str):
    rank = torch.distributed.get_rank()
    if mode == "allreduce":
        value = torch.tensor([float(rank + 1)])
        torch.distributed.all_reduce(value)
        return {"rank": rank, "env": os.environ["RANK"], "sum": float(value)}
    if mode == "raise" and rank == 1:
        print("rank 1 says goodbye", flush=True)
        raise RuntimeError("rank 1 failed on purpose")
    if mode == "hang":
        if rank == 1:
            import time
            time.sleep(600)
        return rank
    torch.distributed.barrier()  # the healthy rank waits in a collective for the failed one
    return rank


def test_harness_returns_values_in_rank_order():
    results = run_distributed(harness_rank, world_size=2, args=("allreduce",), timeout_s=60)
    assert results == [{"rank": 0, "env": "0", "sum": 3.0}, {"rank": 1, "env": "1", "sum": 3.0}]


def test_harness_reports_a_failed_rank_with_its_output():
    with pytest.raises(DistributedRunError) as info:
        run_distributed(harness_rank, world_size=2, args=("raise",), timeout_s=60)
    message = str(info.value)
    assert "rank 1 failed on purpose" in message and "rank 1 says goodbye" in message


def test_harness_kills_a_hang_at_the_timeout():
    with pytest.raises(DistributedRunError, match="timed out after 2 s") as info:
        run_distributed(harness_rank, world_size=2, args=("hang",), timeout_s=2)
    assert "in harness_rank" in str(info.value)  # the stack of the hung rank, from faulthandler


def test_harness_refuses_a_nested_function():
    def nested():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        run_distributed(nested, world_size=1)
