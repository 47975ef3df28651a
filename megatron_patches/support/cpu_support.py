"""Opt-in CPU/gloo support for megatron-core 0.19.2 (tests, demo and benchmarks on CPU).

Nothing here runs unless asked for: tests, the demo, the benchmarks and the examples' `--cpu`
call `megatron_patches.enable_cpu_support()` (a training process never gets it by importing or
installing anything, so a GPU node whose driver fails fails loudly instead of training on CPU).
It is refused when the default process group is NCCL, and does nothing when CUDA is available.
Without CUDA it replaces only things that would raise on this machine anyway:

* `import megatron.core` imports triton for an MoE paged-stash kernel module: a stub module with the
  same public names is installed first when triton is missing (calling a stub kernel raises).
  `stub_missing_triton()` does only this (the tiny-model builders call it at import).
* `torch.cuda.current_device()` -> the CPU device (RoPE tables, GlobalMemoryBuffer, TP layers,
  p2p receive buffers); `torch.cuda.synchronize()` -> no-op (p2p with variable sequence lengths);
  `torch.cuda.current_stream()` / `torch.cuda.Stream()` -> a stream stand-in (DDP grad buckets,
  the alltoall MoE token dispatcher's side stream); `torch.cuda.stream(s)` -> a no-op context;
  the dispatcher's host copies of its split sizes are numpy arrays, as on a GPU.
* The model-parallel RNG tracker keeps CPU generator states instead of CUDA ones
  (`model_parallel_cuda_manual_seed` is mandatory even with dropout 0: attention forks it).
* `device="cuda"` factories inside Megatron functions: the default causal mask, the token
  counter in every schedule, and the optimizer's flags / grad-norm buffers are created on the CPU.
* `get_pos_emb_on_this_cp_rank` (RoPE table of a CP rank) sends a pinned host index to the GPU:
  a CPU version selects the same zigzag chunks.
* Gathers and reduce-scatters of uneven first-dim splits (the alltoall MoE dispatcher over
  expert-tensor-parallel ranks, EP x ETP > 1): gloo's all_gather takes equal sizes only and has
  no list reduce_scatter, so `tensor_parallel.mappings` pads to the largest split and gathers,
  or all-reduces and keeps the own split (the same sums).
* The distributed optimizer sorts parameters by `param.type() == 'torch.cuda.FloatTensor'`
  (distrib_optimizer.py:401-481, 758): while it is built, CPU tensors report CUDA type names.
* Gated DeltaNet takes its short conv, l2norm and chunked delta rule from fla (Triton): torch
  stand-ins with fla's semantics (megatron_patches/support/gdn_cpu.py), and its torch.compile'd helpers
  run eagerly.
* Mamba layers take their conv, chunked scan and gated norm from mamba-ssm / causal-conv1d
  (Triton / CUDA): torch stand-ins with the libraries' reference semantics
  (megatron_patches/support/mamba_cpu.py).
See ../shared/notes/megatron-on-cpu.md for where each was measured.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types

import torch

__all__ = ["enable_cpu_support", "cpu_support_enabled", "stub_missing_triton"]

_ENABLED = False
_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def cpu_support_enabled() -> bool:
    """True once `enable_cpu_support()` has patched this process."""
    return _ENABLED


def enable_cpu_support() -> bool:
    """Patch this process for Megatron on CPU; returns True if anything was patched.

    Call it before `import megatron.core` where triton is missing. Idempotent. A no-op with
    CUDA; a ValueError when the default process group is NCCL (a GPU job must not run here).
    """
    global _ENABLED
    refuse_with_nccl()
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    stub_missing_triton()
    _patch_torch_cuda()
    _patch_megatron_modules()
    _ENABLED = True
    return True


def refuse_with_nccl() -> None:
    """ValueError if the CPU layer is on (or being turned on) in an NCCL job."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        raise ValueError(
            "the CPU/gloo support layer (megatron_patches.enable_cpu_support) is for CPU runs on "
            "gloo, but the default process group is NCCL: do not enable it in a GPU job (drop "
            "the call, or the example's --cpu flag)")


def stub_missing_triton() -> None:
    """Install the paged-stash stub if triton is missing (needed before `import megatron.core`
    on a machine without triton; changes nothing where triton exists)."""
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH in sys.modules:
        return
    stub = types.ModuleType(_PAGED_STASH)

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError("paged-stash MoE kernels need triton and CUDA")

    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _unavailable
    stub.paged_stash_pop_kernel = _unavailable
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = stub


class _CpuStream:
    """Stands in for a CUDA stream: every operation is already ordered on the CPU."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, _event=None) -> "_CpuEvent":
        return _CpuEvent()


class _CpuEvent:
    """Stands in for a CUDA event (the alltoall MoE dispatcher waits on one)."""

    def synchronize(self) -> None:
        pass

    def wait(self, _stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *_args, **_kwargs: None
    torch.cuda.current_stream = lambda *_args, **_kwargs: _CpuStream()
    # the alltoall MoE token dispatcher builds a side stream and copies on it
    torch.cuda.Stream = _CpuStream  # a class: annotations such as `torch.cuda.Stream | None`
    torch.cuda.stream = lambda _stream=None: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *_args, **_kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """transformer/utils.py get_sliding_window_causal_mask (True = masked), on the CPU."""
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0])
    return ~keep.tril(skv - sq + window_size[1])


def _on_cpu(factory):
    def make(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):  # "cuda", "cuda:0", a device
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


class _CpuFactoryTorch(types.ModuleType):
    """`torch` as seen from one Megatron module: `device="cuda"` in factories becomes the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    full = staticmethod(_on_cpu(torch.full))
    tensor = staticmethod(_on_cpu(torch.tensor))


def _cuda_type_names(init):
    """Run `init` with CPU tensors answering `type()` with their CUDA name: Megatron's
    distributed optimizer sorts parameters by `param.type() == 'torch.cuda.FloatTensor'`."""

    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def cuda_named(tensor, dtype=None, non_blocking=False, **more):
            if dtype is None and not more and tensor.device.type == "cpu":
                return original(tensor).replace("torch.", "torch.cuda.", 1)
            return original(tensor, dtype, non_blocking, **more)

        torch.Tensor.type = cuda_named
        try:
            return init(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapped


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu for CPU tensors."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """rope_utils.get_pos_emb_on_this_cp_rank without its pinned host index sent to the GPU:
    rank r's zigzag chunks r and 2*CP-1-r of the table (stock dense forwards at CP > 1 build
    it before the reuse RoPE hook replaces it)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1]))
    return chunks.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def _uneven_splits_on_gloo(stock, uneven):
    """Megatron's first-dim gather / reduce-scatter, with `uneven` for given split sizes."""

    @functools.wraps(stock)
    def call(input_, group, split_sizes=None, use_global_buffer=False):
        if split_sizes is None or group.size() == 1:
            return stock(input_, group, split_sizes, use_global_buffer)
        return uneven(input_, group, [int(n) for n in split_sizes])

    return call


def _gather_uneven(input_, group, sizes):
    padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _reduce_scatter_uneven(input_, group, sizes):
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    start = sum(sizes[:group.rank()])
    return total[start:start + sizes[group.rank()]].clone()


def _patch_megatron_modules() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils

    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    rope_utils.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    for module in (schedules, megatron_optimizer, clip_grads, core_utils, distrib_optimizer):
        module.torch = _CpuFactoryTorch()
    optimizer_class = distrib_optimizer.DistributedOptimizer
    optimizer_class.__init__ = _cuda_type_names(optimizer_class.__init__)

    def _get_rng_state(*_args, clone: bool = False, **_kwargs):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    from megatron.core.transformer.moe import token_dispatcher

    # The alltoall MoE dispatcher moves its split sizes to the host as numpy arrays; on a CPU
    # tensor the stock helper returns the tensor itself, which all_to_all_single refuses.
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy

    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _uneven_splits_on_gloo(
        mappings._gather_along_first_dim, _gather_uneven)
    mappings._reduce_scatter_along_first_dim = _uneven_splits_on_gloo(
        mappings._reduce_scatter_along_first_dim, _reduce_scatter_uneven)

    from megatron_patches.support import gdn_cpu

    gdn_cpu.install()  # torch stand-ins for fla's conv, l2norm and delta rule (GDN layers)
    from megatron_patches.support import mamba_cpu

    mamba_cpu.install()  # torch stand-ins for mamba-ssm / causal-conv1d (Mamba layers)

    mp_random._get_cuda_rng_state = _get_rng_state
    mp_random._set_cuda_rng_state = lambda state, *_args, **_kwargs: torch.set_rng_state(state)
    mp_random.device_ctx_manager = lambda *_args, **_kwargs: contextlib.nullcontext()
