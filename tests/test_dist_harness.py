"""The multi-process test harness and launcher (megatron_patches/support/launch.py) itself: values back in
rank order, a failed rank's traceback and output in the error, a hang killed at the timeout with
the hung rank's stack, and a headline that names the rank that failed first -- not the peer whose
collective then broke -- whether it raised, was killed by SIGKILL or stalled."""

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
    # the deadline counts from the launch, start-up included: leave room for a loaded machine
    with pytest.raises(DistributedRunError, match="timed out after 10 s: rank 1 stalled") as info:
        run_distributed(harness_rank, world_size=2, args=("hang",), timeout_s=10)
    assert "in harness_rank" in str(info.value)  # the stack of the hung rank, from faulthandler


def test_harness_refuses_a_nested_function():
    def nested():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        run_distributed(nested, world_size=1)


def stall_rank(mode: str):
    """Rank 1 stalls (sleeps) or is killed (SIGKILL) or raises; rank 0 waits for it in a
    collective, as a peer would."""
    import signal
    import time

    rank = torch.distributed.get_rank()
    if rank == 1:
        if mode == "sleep":
            time.sleep(3600)
        if mode == "sigkill":
            time.sleep(0.5)  # rank 0 is in its all_reduce by now
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            time.sleep(0.5)
            raise ValueError("rank 1 raised on purpose")
    value = torch.ones(1)
    torch.distributed.all_reduce(value)
    return float(value)


def _headline(mode: str, **timeouts) -> str:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(stall_rank, world_size=2, args=(mode,), **timeouts)
    return str(info.value).splitlines()[0]


def test_a_stalled_rank_is_named_once_its_peers_collective_times_out():
    """Rank 1 sleeps forever; rank 0's all_reduce fails at the 3 s collective timeout, long
    before the run's 120 s: the headline names rank 1 (stalled), not rank 0 (whose collective
    failed)."""
    headline = _headline("sleep", timeout_s=120, collective_timeout_s=3)
    assert "rank 1 stalled" in headline and "timed out" not in headline, headline


def test_a_rank_killed_by_sigkill_is_named_not_the_survivor():
    headline = _headline("sigkill", timeout_s=60)
    assert "rank 1 failed first (killed by SIGKILL" in headline, headline


def test_a_rank_that_raised_is_named_not_the_peer_whose_collective_broke():
    headline = _headline("raise", timeout_s=60)
    assert "rank 1 failed first (ValueError: rank 1 raised on purpose)" in headline, headline
