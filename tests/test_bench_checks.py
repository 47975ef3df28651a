"""tools/bench.py's checks and launcher.

A NaN or inf in the untimed numerical check fails the bench (exit 3), whichever side it is on.
Which process-group backend and device the launcher (tools/bench.py --pp/--tp/--dp/--cp)
gives each rank: gloo on CPU; on CUDA, NCCL with one GPU per local rank
(`torch.cuda.set_device(LOCAL_RANK)`), refused before any process starts when the machine has
fewer GPUs than ranks. The NCCL branch is checked through `rank_backend` and the bench's
up-front refusal (this machine has no GPU); the gloo branch end to end."""
import math

import pytest
import torch

from megatron_patches.support.launch import launch, rank_backend
from tools_import import tool


def test_rank_backend_gloo_on_cpu_nccl_one_device_per_local_rank():
    assert rank_backend("gloo", 3, 8) == ("gloo", None)
    assert rank_backend("auto", 1, 0) == ("gloo", None)
    assert [rank_backend("auto", r, 4) for r in range(4)] == [("nccl", r) for r in range(4)]
    assert rank_backend("nccl", 1, 2) == ("nccl", 1)
    with pytest.raises(ValueError, match="one CUDA device per rank: local rank 2 of a machine "
                                         "with 2 device"):
        rank_backend("auto", 2, 2)
    with pytest.raises(ValueError, match="with 0 device"):
        rank_backend("nccl", 0, 0)
    with pytest.raises(ValueError, match="'gloo', 'nccl' or 'auto'"):
        rank_backend("mpi", 0, 0)


def backend_of_rank() -> tuple:
    """A launched rank's view (module-level: ranks import it by name)."""
    import os

    tool("bench")  # tools/ on the path
    from benchlib.measure import _reduce_max, collective_tensor

    t = collective_tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(t)
    return (torch.distributed.get_backend(), os.environ["LOCAL_RANK"], t.device.type,
            float(t), _reduce_max(math.nan if torch.distributed.get_rank() else 1.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch (a GPU machine gets NCCL)")
def test_auto_starts_gloo_on_cpu_and_bench_collectives_stay_on_the_cpu():
    got = launch(backend_of_rank, world_size=2, timeout_s=120, backend="auto")
    # rank 1's NaN survives the MAX over ranks as inf
    assert got == [("gloo", "0", "cpu", 1.0, math.inf), ("gloo", "1", "cpu", 1.0, math.inf)]


def test_launch_refuses_more_nccl_ranks_than_gpus_before_starting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="local rank 1 of a machine with 1 device"):
        launch(backend_of_rank, world_size=2, timeout_s=5, backend="nccl")


def test_bench_refuses_a_layout_with_more_ranks_than_gpus(monkeypatch, capsys):
    bench = tool("bench")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.main(["--pp", "2", "--num-layers", "2"]) == 2
    assert "one CUDA device per rank" in capsys.readouterr().err


def test_bench_fails_on_a_non_finite_loss_or_gradient_difference():
    tool("bench")
    from benchlib.report import check_failures

    good = {"loss_dense": 1.5, "loss_reuse": 1.5, "max_grad_rel_diff": 2e-7,
            "dense_batched": {"max_grad_rel_diff_vs_stock_dense": 0.0}}
    assert check_failures(good) == []
    assert check_failures({**good, "dense_batched": None}) == []
    for key in ("loss_dense", "loss_reuse", "max_grad_rel_diff"):
        for bad in (math.nan, math.inf):
            assert [f.split(" ")[0] for f in check_failures({**good, key: bad})] == [key]
    batched = {**good, "dense_batched": {"max_grad_rel_diff_vs_stock_dense": math.nan}}
    assert len(check_failures(batched)) == 1
