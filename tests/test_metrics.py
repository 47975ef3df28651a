"""The suite's equality metrics fail on a non-finite value on either side.

`max_relative_diff` / `max_elementwise_error` are what about 70 equivalence checks, the bench's
`max_grad_rel_diff` and the demo compare with: a NaN gradient on either side must never read as
"equal" ([Note: non-finite comparisons] in megatron_patches/training.py)."""
import math

import pytest
import torch

from megatron_patches.training import (max_elementwise_error, max_relative_diff, missing_grads,
                                       worst_of)

METRICS = [max_relative_diff, max_elementwise_error]


def _pair():
    a = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}
    return a, {k: v.clone() for k, v in a.items()}


@pytest.mark.parametrize("metric", METRICS)
def test_equal_tensors_are_zero_and_a_difference_is_seen(metric):
    a, b = _pair()
    assert metric(a, b) == 0.0
    b["w"][1] += 0.02
    assert metric(a, b) == pytest.approx(0.01 if metric is max_elementwise_error else 0.02 / 3)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("side", ["reference", "other", "both"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "all-nan"])
def test_a_non_finite_entry_on_either_side_is_infinitely_different(metric, side, bad):
    a, b = _pair()
    targets = {"reference": [a], "other": [b], "both": [a, b]}[side]
    for t in targets:
        if bad == "all-nan":
            t["w"].fill_(math.nan)
        else:
            t["w"][2] = bad
    d = metric(a, b)
    assert d == math.inf
    assert not d <= 1e-5
    assert max(0.0, d) == math.inf  # survives the folds callers do


@pytest.mark.parametrize("metric", METRICS)
def test_missing_extra_or_misshaped_tensors_are_refused(metric):
    a, b = _pair()
    del b["b"]
    with pytest.raises(ValueError, match="only in the reference"):
        metric(a, b)
    a, b = _pair()
    b["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="only in the other side"):
        metric(a, b)
    a, b = _pair()
    b["w"] = torch.zeros(4)
    with pytest.raises(ValueError, match="shapes"):
        metric(a, b)


@pytest.mark.parametrize("metric", METRICS)
def test_zero_reference_tensor_uses_absolute_difference(metric):
    a = {"z": torch.zeros(3)}
    assert metric(a, {"z": torch.tensor([0.0, 0.25, 0.0])}) == 0.25


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
@pytest.mark.parametrize("side", ["dense", "reuse"])
def test_missing_grads_sees_zero_or_non_finite_on_either_side(side, bad):
    good = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    sides = {"dense": dict(good), "reuse": dict(good)}
    assert missing_grads(**sides) == []
    sides[side]["b"] = torch.tensor([bad]) if bad else torch.zeros(1)
    assert missing_grads(**sides) == [f"{side}: b"]


def test_worst_of_keeps_nan_and_inf():
    assert max(0.0, math.nan) == 0.0  # the fold this helper exists for
    assert worst_of(1e-7, None, 3e-6) == 3e-6
    assert worst_of() == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        assert worst_of(0.0, bad, 1e-7) == math.inf
        assert worst_of(bad) == math.inf


def _dump(directory, iteration, tensors):
    from safetensors.torch import save_file

    (directory / f"iter_{iteration}").mkdir(parents=True)
    save_file(tensors, str(directory / f"iter_{iteration}" / "rank_0.safetensors"))


@pytest.mark.parametrize("broken", [None, "nan grad", "zero grad", "weight"])
def test_entry_point_dump_comparison_fails_on_either_side(tmp_path, broken):
    """megatron_lm_runs.assert_dumps_equal, what the entry-point tests compare with."""
    from megatron_lm_runs import assert_dumps_equal

    dense = {"0.w": torch.tensor([1.0, 2.0]), "grad.0.w": torch.tensor([0.5, -0.25])}
    reuse = {k: v.clone() for k, v in dense.items()}
    if broken == "nan grad":
        reuse["grad.0.w"][0] = math.nan
    elif broken == "zero grad":
        dense["grad.0.w"].zero_()
        reuse["grad.0.w"].zero_()  # equal, and still wrong: no gradient reached the weight
    elif broken == "weight":
        reuse["0.w"][1] += 1e-3
    _dump(tmp_path / "d", 1, dense)
    _dump(tmp_path / "r", 1, reuse)
    if broken is None:
        assert_dumps_equal(tmp_path / "d", tmp_path / "r", 1)
        return
    with pytest.raises(AssertionError):
        assert_dumps_equal(tmp_path / "d", tmp_path / "r", 1)
    if broken == "zero grad":  # unless the caller allows that parameter no gradient
        assert_dumps_equal(tmp_path / "d", tmp_path / "r", 1, may_be_zero=lambda n: n == "grad.0.w")
