"""Kernel backends for shared-prefix attention: registry, selection and the process default.

Backends, in "auto" order: "transformer_engine" (cuDNN fused, THD; sm90+), "flash_attn"
(flash-attn >= 2.6 varlen; sm80+), "torch_cuda" (PyTorch's own varlen flash attention, torch
2.10 - 2.13 CUDA builds; sm80+; nothing to compile), "torch" (PyTorch's fused CPU kernel; CPU
only), "math" (plain torch, any device). Each one's `available(device, dtype, head_dim)` says why it cannot run.

Selection (`select_backend`): an explicit name must be available, else ValueError with the reason
and what to install. "auto" -- the default, changed with `set_default_backend` (the
`--attention-backend` flag) -- is overridden by the environment variable
PREFIX_REUSE_ATTENTION_BACKEND when that is set, and otherwise takes the first available backend.
Each distinct choice is logged once per process on logger "prefix_schedule.attention". On a GPU,
"auto" never lands on "math" silently: that kernel materialises the scores (O(L_q x L_k) memory per
layer, ~8 GB for an 8k prefix), so the fallback raises a `MathFallbackWarning` once per
combination with every skipped backend's reason; request "math" by name to accept it quietly.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Optional

import torch

from prefix_schedule.attention.backends._base import Availability, Backend
from prefix_schedule.attention.backends.flash_attn import FlashAttnBackend
from prefix_schedule.attention.backends.math import MathBackend
from prefix_schedule.attention.backends.torch_cpu import TorchCpuBackend
from prefix_schedule.attention.backends.torch_cuda import TorchCudaBackend
from prefix_schedule.attention.backends.transformer_engine import TransformerEngineBackend
from prefix_schedule.attention.backends.two_part import two_part_attention

__all__ = [
    "AUTO",
    "Availability",
    "MathFallbackWarning",
    "BACKEND_NAMES",
    "Backend",
    "ENV_VAR",
    "availability",
    "get_backend",
    "get_default_backend",
    "select_backend",
    "set_default_backend",
    "two_part_attention",
]

AUTO = "auto"
ENV_VAR = "PREFIX_REUSE_ATTENTION_BACKEND"
_BACKENDS: dict[str, Backend] = {b.name: b for b in (
    TransformerEngineBackend(), FlashAttnBackend(), TorchCudaBackend(), TorchCpuBackend(),
    MathBackend())}
BACKEND_NAMES = tuple(_BACKENDS)
"""Every backend name, in "auto" preference order."""

_log = logging.getLogger("prefix_schedule.attention")
_default = [AUTO]
_selected: dict[tuple, Backend] = {}  # (requested, device, dtype, head_dim) -> backend
_logged: set[str] = set()


class MathFallbackWarning(RuntimeWarning):
    """"auto" chose the score-materialising math kernel on a GPU."""


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        _log.info(message)


def _check_name(name, where: str) -> str:
    if name != AUTO and name not in _BACKENDS:
        raise ValueError(f"{where}: unknown attention backend {name!r}; choose one of "
                         f"{(AUTO,) + BACKEND_NAMES}")
    return name


def get_backend(name: str) -> Backend:
    """The backend object registered under `name` (no availability check)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    return _BACKENDS[name]


def set_default_backend(name: str) -> None:
    """Process-wide backend for calls that pass no `backend=` (the Megatron hook's calls):
    "auto" or a name of BACKEND_NAMES. Validated now; availability is checked at the first call."""
    _default[0] = _check_name(name, "set_default_backend")
    _selected.clear()


def get_default_backend() -> str:
    return _default[0]


def select_backend(name: Optional[str] = None, *, device, dtype: torch.dtype,
                   head_dim: Optional[int] = None) -> Backend:
    """The backend for tensors of this device/dtype/head_dim (see the module docstring)."""
    requested = _check_name(get_default_backend() if name is None else name, "backend")
    source = "requested" if name is not None else "default"
    env = os.environ.get(ENV_VAR, "").strip()
    if requested == AUTO and env:
        requested, source = _check_name(env, ENV_VAR), ENV_VAR
    device = torch.device(device)
    key = (requested, str(device), dtype, head_dim)
    if key not in _selected:
        _selected[key] = _choose(requested, source, device, dtype, head_dim)
    return _selected[key]


def _choose(requested, source, device, dtype, head_dim) -> Backend:
    what = f"{device.type} {dtype} head_dim={head_dim}"
    if requested != AUTO:
        backend = _BACKENDS[requested]
        status = backend.available(device, dtype, head_dim)
        if not status:
            raise ValueError(f"attention backend {requested!r} ({source}) cannot run {what}: "
                             f"{status.reason}. Pick another with --attention-backend / {ENV_VAR}, "
                             f"or 'auto'")
        _log_once(f"prefix_schedule attention backend: {requested} ({source}) for {what}")
        return backend
    skipped = []
    for backend in _BACKENDS.values():
        status = backend.available(device, dtype, head_dim)
        if status:
            skips = "".join(f"; skipped {n}: {r}" for n, r in skipped)
            _log_once(f"prefix_schedule attention backend: {backend.name} (auto) for {what}{skips}")
            if backend.name == "math" and device.type != "cpu":
                warnings.warn(
                    f"prefix_schedule attention: 'auto' fell back to the math kernel for {what}: it "
                    "materialises the attention scores, O(L_q x L_k) memory per layer (an 8k prefix "
                    f"is ~8 GB per layer){skips}. Use bf16/fp16 with transformer_engine, "
                    f"flash_attn or torch_cuda, or request 'math' explicitly (--attention-backend / {ENV_VAR}) "
                    "to accept it", MathFallbackWarning, stacklevel=4)
            return backend
        skipped.append((backend.name, status.reason))
    raise AssertionError(f"the math backend runs everywhere, yet none was available: {skipped}")


def availability(device, dtype: torch.dtype, head_dim: Optional[int] = None) -> dict[str, Availability]:
    """Every backend's availability for this device/dtype/head_dim (for reports)."""
    return {name: b.available(device, dtype, head_dim) for name, b in _BACKENDS.items()}


def _reset() -> None:
    """Forget selections, the default and imported libraries (tests inject fake libraries)."""
    _default[0] = AUTO
    _selected.clear()
    _logged.clear()
    for backend in _BACKENDS.values():
        backend.reset()
