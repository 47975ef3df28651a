"""`python -m megatron_patches compare RUN_A RUN_B` (megatron_patches/compare.py) on runs written
here: Megatron-style console logs, tensorboard scalars, --prefix-reuse-dump-params dumps."""
from __future__ import annotations

import pytest
import torch

from megatron_patches.__main__ import main

LINE = (" [2026-12-07 21:00:00] iteration {i:8d}/       3 | consumed samples:            6 | "
        "elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-04 | "
        "policy loss: {loss:.6E} | loss scale: 1.0 | grad norm: {norm:.3f} | "
        "number of skipped iterations:   0 |")


def _run(root, *, loss_shift=0.0, weight_shift=0.0, nan=False, tb=True, iters=3):
    root.mkdir()
    lines = [LINE.format(i=i, ms=1000.0 * i + 7 * loss_shift, loss=0.5 / i + loss_shift,
                         norm=1.0 + i) for i in range(1, iters + 1)]
    (root / "train.log").write_text("noise line\n" + "\n".join(lines) + "\n")
    if tb:
        from torch.utils.tensorboard import SummaryWriter
        with SummaryWriter(str(root / "tb")) as writer:
            for i in range(1, iters + 1):
                writer.add_scalar("policy loss", 0.5 / i + loss_shift, i)
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(0)
    weights = {"decoder.w": torch.randn(4, 4, generator=gen), "grad.decoder.w": torch.randn(4, 4, generator=gen)}
    for i in (1, 2):
        (root / "dump" / f"iter_{i}").mkdir(parents=True)
        w = {k: v.clone() for k, v in weights.items()}
        w["decoder.w"][0, 0] += weight_shift * i
        if nan:
            w["grad.decoder.w"][1, 1] = float("nan")
        save_file(w, str(root / "dump" / f"iter_{i}" / "rank_0.safetensors"))
    return root


def test_equal_runs_agree(tmp_path, capsys):
    a, b = _run(tmp_path / "dense"), _run(tmp_path / "reuse")
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "within 1e-05 relative" in out
    assert "ok   log/policy loss: max rel diff 0.00e+00 over 3 iteration(s)" in out
    assert "ok   tb/policy loss" in out and "ok   iter 2 rank_0.safetensors" in out
    assert "elapsed time" not in out  # timings are not compared


@pytest.mark.parametrize("change, words", [
    (dict(loss_shift=1e-3), ["DIFF log/policy loss", "DIFF tb/policy loss"]),
    (dict(weight_shift=1e-2), ["DIFF iter 1 rank_0.safetensors", "(worst decoder.w)"]),
    (dict(nan=True), ["DIFF iter 1 rank_0.safetensors: max_relative_diff inf"]),
    (dict(iters=2), ["only on one side: [3]"]),
])
def test_differences_are_named(tmp_path, capsys, change, words):
    a, b = _run(tmp_path / "dense"), _run(tmp_path / "reuse", **change)
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "NOT within" in out and all(w in out for w in words), out


def test_nothing_to_compare_is_exit_2(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
