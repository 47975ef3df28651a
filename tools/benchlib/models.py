"""The bench's models, one pipeline rank's part: built, Megatron initialised, wrapped for training.

A "model" here is what Megatron's forward_backward_func takes: one module, or with virtual
pipeline stages (`--vpp`) the rank's list of model chunks. `--production` builds them with
Megatron-LM's production settings and wraps every chunk in Megatron's DDP as Megatron-LM's
train() does (training/training.py: the config hooks no_sync_func / grad_sync_func and
finalize_model_grads).
"""
from __future__ import annotations

from typing import Dict

import torch

from benchlib.config import BenchConfig
from benchlib.hybrid import build_hybrid_models, is_hybrid
from benchlib.steps import private_rendezvous

__all__ = ["build_models", "chunks", "first_param", "grads", "model_shape", "zero"]


def model_shape(config: BenchConfig):
    """The bench's tiny Llama shape (megatron_patches.models.tiny.TinyLlamaConfig)."""
    from megatron_patches.models.tiny import TinyLlamaConfig

    return TinyLlamaConfig(num_layers=config.num_layers, hidden_size=config.hidden_size,
                           ffn_hidden_size=config.ffn_hidden_size,
                           num_attention_heads=config.num_attention_heads,
                           num_query_groups=config.num_query_groups,
                           vocab_size=config.vocab_size, max_seq_len=config.max_seq_len)


def chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def first_param(model) -> torch.Tensor:
    return next(chunks(model)[0].parameters())


def zero(model) -> None:
    from megatron_patches.training import zero_grads

    for chunk in chunks(model):
        zero_grads(chunk)


def grads(model) -> Dict[str, torch.Tensor]:
    """name -> fp32 gradient (main_grad under DDP) of every chunk, prefixed by the chunk index."""
    from megatron_patches.training import param_grads

    return {f"chunk{v}.{name}": g for v, chunk in enumerate(chunks(model))
            for name, g in param_grads(chunk).items()}


def _production_overrides(config: BenchConfig) -> dict:
    """TransformerConfig fields Megatron-LM's parser sets (core_r0.19.0: training/
    argument_utils.py:305-307, arguments.py:966-983): outputs pseudo-freed after each send;
    batched p2p, or overlapped p2p with virtual stages."""
    if not config.production:
        return {}
    interleaved = config.vpp > 1
    return dict(deallocate_pipeline_outputs=True, batch_p2p_comm=not interleaved,
                overlap_p2p_comm=interleaved)


def _wrap(model_chunks: list, config: BenchConfig):
    """Loss-token normalisation; Megatron's DDP with --dp > 1 or --production, wired as
    Megatron-LM's train() does (training.py:3531-3550: one no_sync / grad_sync per chunk)."""
    from megatron_patches.training import prepare_for_training

    if not (config.production or config.dp > 1):
        wrapped = [prepare_for_training(m, ddp=False) for m in model_chunks]
        return wrapped if config.vpp > 1 else wrapped[0]
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    ddp_config = (DistributedDataParallelConfig(overlap_grad_reduce=True,
                                                use_distributed_optimizer=True)
                  if config.production else DistributedDataParallelConfig())
    wrapped = [DistributedDataParallel(m.config, ddp_config, m) for m in model_chunks]

    def per_chunk(name):
        hooks = [getattr(w, name) for w in wrapped]
        return hooks if len(hooks) > 1 else hooks[0]

    for m in wrapped:
        m.config.finalize_model_grads_func = finalize_model_grads
        m.config.no_sync_func = per_chunk("no_sync")
        if config.production:  # align_grad_reduce
            m.config.grad_sync_func = per_chunk("start_grad_sync")
    return wrapped if config.vpp > 1 else wrapped[0]


def build_models(config: BenchConfig, distributed: bool):
    """(local-spec model, fused-SDPA model with the same weights) of this pipeline rank."""
    import megatron_patches

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    from megatron_patches.models.tiny import (build_model, initialize_distributed,
                                         initialize_single_process)

    megatron_patches.install()
    if distributed:
        initialize_distributed(seed=config.seed, tp=config.tp, pp=config.pp, ep=config.ep,
                               vpp=config.vpp if config.vpp > 1 else None)
    else:
        private_rendezvous()
        initialize_single_process(seed=config.seed)
    shape = model_shape(config)
    if is_hybrid(config):  # GDN / Mamba layers (benchlib/hybrid.py), one chunk per rank
        local, fused = build_hybrid_models(config, shape, **_production_overrides(config))
        return _wrap([local], config), _wrap([fused], config)
    overrides = {**_production_overrides(config), **config.moe_overrides(),
                 **config.recompute_options()}
    stages = [None] if config.vpp == 1 else list(range(config.vpp))
    local = [build_model(shape, seed=config.seed, vp_stage=v, **overrides) for v in stages]
    # Another init seed, so that equal weights can only come from load_state_dict.
    fused = [build_model(shape, fused_attention=True, seed=config.seed + 1, vp_stage=v,
                         **overrides) for v in stages]
    for f, m in zip(fused, local):
        f.load_state_dict(m.state_dict())
    return _wrap(local, config), _wrap(fused, config)
