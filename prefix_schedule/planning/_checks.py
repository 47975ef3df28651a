"""Input checks shared by the data model (data.py) and detection (detect.py): each turns a value
into a 1-D CPU tensor or raises a ValueError that names the field and what to fix."""
from __future__ import annotations

from typing import Any

import torch


def _as_1d(value: Any, *, name: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name}: cannot be converted to a tensor ({exc}); give a list or 1-D tensor") from None
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {tuple(tensor.shape)}; flatten it")
    return tensor


def _as_tokens(value: Any, *, name: str) -> torch.Tensor:
    tokens = _as_1d(value, name=name)
    if tokens.numel() == 0:  # an empty list converts as float; the caller reports the emptiness
        return tokens.to(torch.int64)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"{name}: token ids must be integers, got dtype {tokens.dtype}; pass int token ids")
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError(f"{name}: token id {int(tokens.min())} is negative; token ids must be >= 0")
    return tokens.to(torch.int64).clone()


def _float_tensor(value: Any, *, name: str) -> torch.Tensor:
    """`value` as float64, or a ValueError naming what was given (None, a string, a dict...)."""
    if value is None or isinstance(value, (str, bytes, dict)):
        got = "None" if value is None else f"a {type(value).__name__} ({str(value)[:30]!r})"
        raise ValueError(f"{name} is {got}; give a number or a sequence of numbers, one per "
                         "suffix token")
    try:
        return torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"{name}: {type(value).__name__} {str(value)[:40]!r} is not numbers "
                         f"({exc}); give a number or a sequence of numbers, one per suffix "
                         "token") from None


def _as_floats(value: Any, *, name: str, length: int, allow_scalar: bool = False) -> torch.Tensor:
    tensor = value.detach().cpu() if torch.is_tensor(value) else _float_tensor(value, name=name)
    if allow_scalar and tensor.dim() == 0:
        tensor = tensor.reshape(1).expand(length)
    tensor = _as_1d(tensor, name=name)
    if tensor.numel() != length:
        raise ValueError(
            f"{name} has {tensor.numel()} entries but the suffix has {length} tokens; "
            "give one entry per suffix token"
        )
    bad = ~torch.isfinite(tensor.to(torch.float64))
    if bad.any():
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}[{index}] is {float(tensor[index])}; every entry must be finite "
            "(put any finite value, e.g. 0, at positions the loss mask excludes)"
        )
    stored = tensor.to(torch.float32)
    overflow = ~torch.isfinite(stored)
    if overflow.any():
        index = int(overflow.nonzero()[0, 0])
        raise ValueError(f"{name}[{index}] is {float(tensor[index])}, beyond float32's range "
                         "(the loss is computed in float32); give values within +-3.4e38")
    return stored.clone()


def _check_range(values: torch.Tensor, *, name: str, low: float, high: float, hint: str) -> None:
    bad = (values < low) | (values > high)
    if bad.any():
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}[{index}] is {float(values[index])}, outside [{low}, {high}]; {hint}")


def _prefixed(where: str, exc: ValueError) -> ValueError:
    return ValueError(f"{where}: {exc}")
