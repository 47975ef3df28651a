"""The bench on hybrid models: `--linear-attention-freq N` and `--hybrid-pattern PATTERN`.

- `--linear-attention-freq N`: a GPTModel with Gated DeltaNet layers, every N-th layer softmax
  attention (Qwen3.5's layout at N = 4: attention_output_gate, rotary_percent 0.25), built by
  megatron_patches.models.gdn.build_gdn_model;
- `--hybrid-pattern P`: a HybridModel with one layer per symbol of P (`*` attention, `-` MLP,
  `G` GDN, `M` Mamba-2), built by megatron_patches.models.hybrid.build_hybrid_model.

Mixer shapes follow the published layouts' ratios at the bench's width h with a attention
heads: GDN (Qwen3-Next / Qwen3.5) a/2 key heads and a value heads of width 2h/a (keys h wide,
values 2h), conv window 4; Mamba-2 (Nemotron-H) head width 64, 2h/64 heads, state 128, 8
groups (fewer when there are fewer heads), conv window 4, SSD chunk 128. Decay rates are a
trained model's (GDN A in [0.02, 0.3], dt_bias in [-4, -2]; Mamba A in [0.05, 0.5], dt_bias in
[-3, -1]), as the exactness tests set them: with Megatron's init the state is forgotten within a
few tokens and the decay parameters' gradients are fp32 rounding noise (docs/HYBRID.md).

The dense paths swap the attention layers' core attention for the fused SDPA one (no parameters,
so the weights stay the local model's); the stock dense path and the reuse path run the local
spec. One process only: parallel layouts, --cp, --vpp, --tree, MoE, full recompute, the memory
budget and the adapter are refused before any compute.
"""
from __future__ import annotations

import torch

__all__ = ["BENCH_SYMBOLS", "build_hybrid_models", "check_hybrid", "hybrid_dims",
           "hybrid_overrides", "is_hybrid"]

BENCH_SYMBOLS = "*-GM"
"""HybridModel symbols the bench builds (`E` needs the MoE paths' packing: not benchmarked)."""
MAMBA_HEAD_DIM, MAMBA_STATE_DIM, MAMBA_GROUPS, CONV = 64, 128, 8, 4


def is_hybrid(config) -> bool:
    return config.linear_attention_freq is not None or config.hybrid_pattern is not None


def check_hybrid(config) -> None:
    """ValueError, before any compute, for what the hybrid bench does not run."""
    if not is_hybrid(config):
        return
    freq, pattern = config.linear_attention_freq, config.hybrid_pattern
    if freq is not None and pattern is not None:
        raise ValueError("give --linear-attention-freq (a GPTModel) or --hybrid-pattern (a "
                         "HybridModel), not both")
    if freq is not None and freq < 1:
        raise ValueError(f"--linear-attention-freq={freq}; give an int >= 1 (every N-th layer "
                         "is softmax attention, the others Gated DeltaNet)")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"--hybrid-pattern={pattern!r}; give one symbol per layer out of "
                             f"{BENCH_SYMBOLS!r}, e.g. G*M-")
        bad = sorted(set(pattern) - set(BENCH_SYMBOLS))
        if bad:
            raise ValueError(f"--hybrid-pattern={pattern!r}: the bench builds the symbols "
                             f"{BENCH_SYMBOLS!r} (attention, MLP, Gated DeltaNet, Mamba-2), not "
                             f"{bad}")
        if not set(pattern) & set("*GM"):
            raise ValueError(f"--hybrid-pattern={pattern!r} has no `*`, `G` or `M` layer: "
                             "nothing of a prefix would be cached")
        if len(pattern) != config.num_layers:
            raise ValueError(f"--hybrid-pattern={pattern!r} has {len(pattern)} layers; give "
                             f"--num-layers {len(pattern)}")
    if config.num_attention_heads % 2:
        raise ValueError(f"--num-attention-heads={config.num_attention_heads}: the GDN shape has "
                         "a/2 key heads; give an even number")
    others = [flag for flag, on in (
        ("--pp/--tp/--dp/--cp > 1", config.world_size > 1), ("--vpp", config.vpp > 1),
        ("--tree", config.tree is not None), ("--num-experts", config.num_experts is not None),
        ("--recompute full", config.recompute == "full"),
        ("--memory-budget-mib", config.memory_budget_mib is not None),
        ("--production", config.production), ("--adapter", config.adapter is not None)) if on]
    if others:
        raise ValueError(f"the hybrid bench runs one process with the plain paths, not with "
                         f"{', '.join(others)}; drop them")


def _gdn_shape(config) -> dict:
    a, h = config.num_attention_heads, config.hidden_size
    return dict(linear_num_key_heads=a // 2, linear_num_value_heads=a,
                linear_key_head_dim=2 * h // a, linear_value_head_dim=2 * h // a,
                linear_conv_kernel_dim=CONV)


def _mamba_shape(config) -> dict:
    heads = max(1, 2 * config.hidden_size // MAMBA_HEAD_DIM)
    groups = next(g for g in (MAMBA_GROUPS, 4, 2, 1) if heads % g == 0)
    return dict(mamba_num_heads=heads, mamba_head_dim=MAMBA_HEAD_DIM,
                mamba_state_dim=MAMBA_STATE_DIM, mamba_num_groups=groups)


def hybrid_overrides(config) -> dict:
    """TransformerConfig fields of the hybrid layers ({} without the hybrid flags)."""
    if config.linear_attention_freq is not None:
        return {**_gdn_shape(config), "attention_output_gate": True}
    if config.hybrid_pattern is None:
        return {}
    out = _gdn_shape(config) if "G" in config.hybrid_pattern else {}
    return {**out, **(_mamba_shape(config) if "M" in config.hybrid_pattern else {})}


def hybrid_dims(config) -> dict:
    """ModelDims fields of the hybrid layers (the FLOP model's view)."""
    if not is_hybrid(config):
        return {}
    fields = dict(hybrid_overrides(config), linear_attention_freq=config.linear_attention_freq,
                  hybrid_pattern=config.hybrid_pattern, mamba_conv_kernel_dim=CONV,
                  mamba_chunk_size=128)
    return fields


def _trained_decay(config, model, seed: int) -> None:
    """A trained model's decay rates on every GDN and Mamba mixer (module docstring)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    gen = torch.Generator().manual_seed(seed)
    ranges = {GatedDeltaNet: ((0.02, 0.3), (-4.0, -2.0))}
    if config.hybrid_pattern is not None and "M" in config.hybrid_pattern:
        # imported only for Mamba models: Megatron-LM main's mamba_mixer needs Triton
        from megatron.core.ssm.mamba_mixer import MambaMixer
        ranges[MambaMixer] = ((0.05, 0.5), (-3.0, -1.0))
    with torch.no_grad():
        for module in model.modules():
            for kind, (a_range, dt_range) in ranges.items():
                if isinstance(module, kind):
                    a = torch.empty(module.A_log.shape).uniform_(*a_range, generator=gen)
                    module.A_log.copy_(a.log())
                    module.dt_bias.copy_(torch.empty(module.dt_bias.shape).uniform_(
                        *dt_range, generator=gen))


def _fuse_core_attention(model) -> int:
    """Swap every attention layer's core attention for FusedSDPACoreAttention (no parameters);
    returns how many were swapped."""
    from megatron.core.transformer.attention import Attention
    from megatron_patches.models.tiny import FusedSDPACoreAttention

    FusedSDPACoreAttention.check_config(model.config)
    swapped = 0
    for module in model.modules():
        if isinstance(module, Attention):
            old = module.core_attention
            module.core_attention = FusedSDPACoreAttention(
                model.config, old.layer_number, None, None,
                softmax_scale=getattr(old, "softmax_scale", None)).to(
                    next(module.parameters()).device)
            swapped += 1
    return swapped


def _build(config, shape, seed: int):
    overrides = hybrid_overrides(config)
    if config.linear_attention_freq is not None:
        from megatron_patches.models.gdn import build_gdn_model

        return build_gdn_model(shape, linear_attention_freq=config.linear_attention_freq,
                               seed=seed, rotary_percent=0.25, **overrides,
                               **config.recompute_options())
    from megatron_patches.models.hybrid import build_hybrid_model

    return build_hybrid_model(shape, config.hybrid_pattern, seed=seed, **overrides,
                              **config.recompute_options())


def build_hybrid_models(config, shape):
    """(local-spec model, fused-SDPA model with the same weights), one process."""
    from megatron_patches.training import prepare_for_training

    local = _build(config, shape, config.seed)
    _trained_decay(config, local, config.seed + 7)
    fused = _build(config, shape, config.seed + 1)  # equal weights only via load_state_dict
    _fuse_core_attention(fused)
    fused.load_state_dict(local.state_dict())
    return prepare_for_training(local, ddp=False), prepare_for_training(fused, ddp=False)

