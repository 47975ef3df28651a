"""megatron_patches/support/failures.py: which rank a launcher's headline names (no processes here; the
launchers themselves are tested in test_dist_harness.py and test_train_example.py)."""

import pytest
import torch

from megatron_patches.support.failures import (COLLECTIVE_TIMEOUT_ENV, RankEnd, RankFailure, classify,
                                       collective_timeout_s, first_failures, headline,
                                       report_first_failure)

GLOO_TIMEOUT = RuntimeError("[/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                            "3000ms for recv operation to complete")
GLOO_RESET = RuntimeError("[/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset "
                          "by peer")


def test_collective_failures_are_told_from_a_ranks_own_errors():
    assert classify(GLOO_TIMEOUT) == classify(GLOO_RESET) == "collective"
    assert classify(torch.distributed.DistBackendError("NCCL watchdog timeout")) == "collective"
    assert classify(ValueError("bad batch")) == classify(RuntimeError("shape mismatch")) == "error"


def test_blame_order_died_error_stalled_collective():
    collective = RankEnd(0, "collective", 1.0, "RuntimeError: Connection reset by peer")
    error = RankEnd(1, "error", 2.0, "ValueError: bad")
    stalled = RankEnd(2, "stalled", 3.0, "still running")
    died = RankEnd(3, "died", 4.0, "killed by SIGKILL")
    ok = RankEnd(4, "ok", 0.5)
    ends = [collective, error, stalled, died, ok]
    assert first_failures(ends) == [died]  # although its death was seen last
    assert first_failures(ends[:3] + [ok]) == [error]
    assert first_failures([collective, stalled, RankEnd(5, "stalled", 3.5, "")]) == [
        stalled, RankEnd(5, "stalled", 3.5, "")]
    assert first_failures([RankEnd(6, "collective", 9.0), collective]) == [collective]
    assert headline(ends) == "rank 3 failed first (killed by SIGKILL)"
    assert headline([collective, stalled]) == "rank 2 stalled (still running)"
    assert headline([ok]) == "no rank failed"


def _rank_fails(store, rank, world_size, exc):
    with pytest.raises(RankFailure) as info:
        with report_first_failure(store, rank, world_size, wait_s=0.3):
            raise exc
    assert info.value.__cause__ is exc
    return str(info.value)


def test_report_names_a_silent_rank_not_the_one_whose_collective_timed_out():
    store = torch.distributed.HashStore()
    with report_first_failure(store, 2, 3, wait_s=0.3):
        pass  # rank 2 finished; rank 1 never reports (stalled or killed)
    line = _rank_fails(store, 0, 3, GLOO_TIMEOUT)
    assert line.startswith("[rank 0] rank 1 stalled"), line


def test_report_names_the_rank_that_raised_before_its_peers():
    store = torch.distributed.HashStore()
    _rank_fails(store, 1, 2, ValueError("rank 1's own bug"))
    line = _rank_fails(store, 0, 2, GLOO_RESET)
    assert line == "[rank 0] rank 1 failed first (ValueError: rank 1's own bug)", line


def test_collective_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert collective_timeout_s(600) == 600.0
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "7.5")
    assert collective_timeout_s(600) == 7.5
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=COLLECTIVE_TIMEOUT_ENV):
        collective_timeout_s(600)
