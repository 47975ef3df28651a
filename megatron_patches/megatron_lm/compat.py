"""The smallest shims that let `megatron.training` import and run on this project's CPU machines.

Two independent, opt-in pieces (the entry point calls both; nothing else does):

* `enable_python311_support()` -- Megatron-LM declares Python >= 3.12 and
  `megatron/training/models/{gpt,hybrid}.py` import `typing.override` (new in 3.12). On 3.11
  this sets `typing.override = typing_extensions.override` (the same decorator: it only marks
  the function). On 3.12+ `typing.override` exists and nothing is touched.
* `enable_megatron_lm_cpu_support()` -- only without CUDA (a no-op where CUDA exists): first the
  core CPU layer (`megatron_patches.support.cpu_support`), then
  - modules of Megatron that import triton at their top (Megatron-LM main's Mamba/GDN kernels,
    imported by `megatron.training` through the hybrid layer specs) load as stubs whose kernels
    raise when called; only while triton is not installed;
  - in `megatron.training`'s own modules, `torch` is seen through a stand-in that creates
    `device="cuda"` tensors on the CPU and whose `torch.cuda` reports one device with no-op
    streams / cache / memory queries (Megatron initialises model parallelism and its RNG tracker
    only when `torch.cuda.device_count() > 0`);
  - `nn.Module.cuda()` and `Tensor.cuda()` return their object unchanged (Megatron's `get_model`
    moves every model chunk to the current CUDA device; `LanguageModule` moves the tied output
    weight of the last pipeline stage there).
  Each replaces only something that would raise on a machine without CUDA, so nothing that ran
  changes. Measured on megatron-core 0.19.1 (Megatron-LM core_r0.19.0) and 0.20.0 (main).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import typing

import torch

from megatron_patches.support.cpu_support import _CpuFactoryTorch, _on_cpu

__all__ = ["enable_python311_support", "enable_megatron_lm_cpu_support", "TRAINING_MODULES",
           "see_cpu_torch"]

TRAINING_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.utils.common_utils",
    "megatron.training.inprocess_restart",
    "megatron.core.rerun_state_machine",
)
"""Modules (`megatron.training`'s, and the rerun state machine it drives) that see `torch`
through the CPU stand-in."""

_ENABLED = False


def enable_python311_support() -> bool:
    """`typing.override` on Python 3.11 (from typing_extensions); True if it was added."""
    if hasattr(typing, "override"):
        return False
    import typing_extensions

    typing.override = typing_extensions.override
    return True


def enable_megatron_lm_cpu_support() -> bool:
    """Patch this process so `megatron.training` runs without CUDA; True if anything was patched.

    Call before importing `megatron.core` / `megatron.training`. Idempotent; a no-op with CUDA."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from megatron_patches.support.cpu_support import enable_cpu_support

    if importlib.util.find_spec("triton") is None:
        sys.meta_path.insert(0, _TritonKernelStubFinder())
    enable_cpu_support()
    enable_python311_support()  # the modules patched below import typing.override
    torch.nn.Module.cuda = _stays_on_cpu
    torch.Tensor.cuda = _stays_on_cpu
    stand_in = _CpuTrainingTorch()
    have_training = importlib.util.find_spec("megatron.training") is not None
    for name in TRAINING_MODULES:
        if name.startswith("megatron.training") and not have_training:
            continue  # megatron.core alone: nothing of megatron.training to patch
        importlib.import_module(name).torch = stand_in
    _ENABLED = True
    return True


def see_cpu_torch(*module_names: str) -> None:
    """Without CUDA, these further modules see `torch` as TRAINING_MODULES do (Megatron-LM RL's
    `device="cuda"` factories: examples/megatron_lm/train_rl_prefix_reuse.py). With CUDA: none."""
    if torch.cuda.is_available():
        return
    stand_in = _CpuTrainingTorch()
    for name in module_names:
        importlib.import_module(name).torch = stand_in


def _stays_on_cpu(self, *_args, **_kwargs):
    return self


class _TritonKernelLoader(importlib.abc.Loader):
    """Runs a Megatron module; if it stops at `import triton`, what it defined so far stays and
    every other name it would have defined becomes a kernel that raises when called."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self.inner.exec_module(module)
        except ModuleNotFoundError as error:
            if error.name != "triton":
                raise
            module.__getattr__ = _missing_kernel_factory(module.__name__)


def _missing_kernel_factory(module_name: str):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _kernel_needs_triton(*_args, **_kwargs):
            raise RuntimeError(f"{module_name}.{name} needs triton and CUDA")

        return _kernel_needs_triton

    return __getattr__


class _TritonKernelStubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _TritonKernelLoader(spec.loader)
        return spec


class _CpuStream:
    def wait_stream(self, _stream) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as `megatron.training` sees it on a CPU machine."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(_device) -> None:
        pass

    @staticmethod
    def Stream(*_args, **_kwargs):  # noqa: N802 (torch's name)
        return _CpuStream()

    @staticmethod
    def stream(_stream):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*_args, **_kwargs):
        return _CpuStream()

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def get_device_properties(*_args, **_kwargs):
        """Compute capability 0.0: pre-Blackwell code paths (Megatron's argument checks)."""
        return types.SimpleNamespace(major=0, minor=0, name="cpu", total_memory=0)

    @staticmethod
    def memory_allocated(*_args, **_kwargs) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated


class _CpuTrainingTorch(_CpuFactoryTorch):
    """`torch` as `megatron.training` sees it on a CPU machine: the CPU layer's factory stand-in
    plus `torch.cuda` queries answered for the CPU."""

    def __init__(self):
        super().__init__()
        self.cuda = _CpuCuda()

    rand = staticmethod(_on_cpu(torch.rand))
