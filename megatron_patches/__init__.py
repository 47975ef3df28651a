"""Everything of megatron-prefix-reuse that touches Megatron.

Importing this package imports nothing from Megatron (the patch command must work on a tree that
does not import yet). Use:

    import megatron_patches
    megatron_patches.install()                  # hooks into the patched Megatron
    with megatron_patches.use_prefix_reuse_schedule():
        fb = get_forward_backward_func()        # -> forward_backward_prefix_reuse
        fb(forward_step_func=..., data_iterator=ReuseStep(batch, plan), model=..., ...)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["install", "uninstall", "use_prefix_reuse_schedule", "prefix_reuse_schedule_enabled",
           "enable_cpu_support"]

_SCHEDULE_ENABLED = False


def enable_cpu_support() -> bool:
    """Turn on the CPU/gloo layer (tests, demo, benchmarks, the examples' --cpu): see
    megatron_patches/support/cpu_support.py. Call it first, before anything imports megatron.core.
    Refused under an NCCL process group; a no-op where CUDA is available."""
    from megatron_patches.support.cpu_support import enable_cpu_support as enable

    return enable()


def install() -> None:
    """Register the reuse hooks in the (source-patched) Megatron of this process.

    Refuses, with the command that fixes it, if the source patches are not applied. Changes
    nothing else: on CPU, call `enable_cpu_support()` first. Idempotent.
    """
    from megatron_patches.patching.registry import require_patched

    require_patched()
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import gpt_model
    from megatron.core.models.hybrid import hybrid_model
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.ssm.gated_delta_net import gdn
    from megatron.core.transformer import attention

    from megatron_patches.runtime import gdn_hooks
    from megatron_patches.runtime import hooks
    from megatron_patches.runtime import mamba_hooks
    from megatron_patches.runtime import moe

    attention._core_attention_hook = hooks.core_attention_hook
    gdn._gdn_state_hook = gdn_hooks.gdn_state_hook
    mamba_mixer = _mamba_mixer()
    if mamba_mixer is not None:
        mamba_mixer._mamba_state_hook = mamba_hooks.mamba_state_hook
    moe.install()  # TopKRouter.routing: logical prefix-token accounting in reuse contexts
    gpt_model._rotary_pos_emb_hook = hooks.rotary_pos_emb_hook
    hybrid_model._rotary_pos_emb_hook = hooks.rotary_pos_emb_hook
    schedules._forward_backward_func_hook = _select_schedule
    from megatron.core.transformer import multi_latent_attention
    from megatron_patches.runtime import mla_hooks

    multi_latent_attention._mla_reuse_hook = mla_hooks.mla_reuse_hook
    from megatron_patches.runtime.tp_grads import tp_grad_sum_hook

    _finalize_module(finalize_model_grads)._tp_grad_sum_hook = tp_grad_sum_hook


def _finalize_module(finalize_model_grads):
    """The module finalize_model_grads.py (megatron.core.distributed re-exports a function of
    the same name, which shadows the submodule attribute)."""
    import sys

    return sys.modules[finalize_model_grads.__module__]


def _mamba_mixer():
    """Megatron's mamba_mixer module, or None where it cannot be imported: Megatron-LM main
    (0.20.0) imports Triton kernels there at import time, so without triton (a CPU machine) no
    Mamba layer can be built and there is nothing to hook."""
    try:
        from megatron.core.ssm import mamba_mixer
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        return None
    return mamba_mixer


def uninstall() -> None:
    """Remove the hooks (Megatron behaves exactly as stock again)."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.models.hybrid import hybrid_model
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import attention

    attention._core_attention_hook = None
    from megatron.core.ssm.gated_delta_net import gdn

    gdn._gdn_state_hook = None
    mamba_mixer = _mamba_mixer()
    if mamba_mixer is not None:
        mamba_mixer._mamba_state_hook = None
    gpt_model._rotary_pos_emb_hook = None
    hybrid_model._rotary_pos_emb_hook = None
    schedules._forward_backward_func_hook = None
    from megatron.core.distributed import finalize_model_grads

    _finalize_module(finalize_model_grads)._tp_grad_sum_hook = None
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention._mla_reuse_hook = None
    from megatron_patches.runtime import moe

    moe.uninstall()


def prefix_reuse_schedule_enabled() -> bool:
    """Whether `get_forward_backward_func()` currently returns the prefix-reuse schedule."""
    return _SCHEDULE_ENABLED


@contextlib.contextmanager
def use_prefix_reuse_schedule(enabled: bool = True) -> Iterator[None]:
    """Make Megatron's `get_forward_backward_func()` select the prefix-reuse schedule."""
    global _SCHEDULE_ENABLED
    previous, _SCHEDULE_ENABLED = _SCHEDULE_ENABLED, enabled
    try:
        yield
    finally:
        _SCHEDULE_ENABLED = previous


def _select_schedule(*, pp_size=None, vp_size=None):
    if not _SCHEDULE_ENABLED:
        return None
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse

    return forward_backward_prefix_reuse
