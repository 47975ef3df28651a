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
spec.

Parallel layouts (tools/bench.py --pp/--tp/--dp, --production) run as for attention-only models,
each rank building its own stage / TP shard (benchlib/models.py wraps both models the same way,
Megatron's DDP with --dp > 1 or --production):
- --tp N splits the attention heads, the GDN key and value heads (a/2 and a: N divides both)
  and the Mamba heads and groups (the bench picks the largest of 8, 4, 2, 1 groups that divides
  the heads and is a multiple of N);
- --pp N: a GPTModel splits its layers evenly (Megatron's offsets); a HybridModel pattern may
  mark its N stages with `|` (e.g. `G*|M-`: stage 0 `G*`, stage 1 `M-`), and without marks the
  bench splits it into N equal stages (the `|` Megatron wants with PP);
- --dp N places groups on the ranks (prefix_schedule.planning.placement) as for any model.
Refused before any compute, with the reason: --cp (the reuse hooks refuse GDN and Mamba layers
under context parallelism: their CP all-to-all splits heads, a zigzag shard has no prefix state),
--vpp (the hybrid builders build one model chunk per pipeline rank), --num-experts (MoE layers
beside GDN / Mamba are not benchmarked) and --adapter. --recompute full runs for both models
(Megatron's uniform full recompute; the reuse engine's Phase C re-run, [Note: prefix full
recompute]). --tree plans with StepPlan.state_reads (a state exists only at a prefix unit's
end); --memory-budget-mib plans with the accounting model, which counts GDN and Mamba-2 layers.
"""
from __future__ import annotations

import torch

__all__ = ["BENCH_SYMBOLS", "build_hybrid_models", "check_hybrid", "hybrid_dims",
           "hybrid_overrides", "is_hybrid", "stage_layers", "stage_pattern"]

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
        _check_pattern(config, pattern)
    if config.num_attention_heads % 2:
        raise ValueError(f"--num-attention-heads={config.num_attention_heads}: the GDN shape has "
                         "a/2 key heads; give an even number")
    _check_parallel(config)
    refused = [(flag, why) for flag, on, why in (
        ("--cp > 1", config.cp > 1, "the reuse hooks refuse GDN and Mamba layers under context "
         "parallelism (their CP all-to-all splits heads; a zigzag shard has no prefix state)"),
        ("--vpp > 1", config.vpp > 1, "the hybrid builders build one model chunk per pipeline "
         "rank"),
        ("--num-experts", config.num_experts is not None, "MoE layers beside GDN / Mamba layers "
         "are not benchmarked"),
        ("--adapter", config.adapter is not None, "the adapters run attention-only models")) if on]
    if refused:
        raise ValueError("the hybrid bench does not run " + "; ".join(
            f"{flag}: {why}" for flag, why in refused) + "; drop " + ", ".join(
                flag for flag, _ in refused))


def stage_pattern(config) -> str | None:
    """The HybridModel pattern the bench builds: --hybrid-pattern, with `|` between --pp equal
    stages when it has no stage marks (None for a GPTModel)."""
    pattern = config.hybrid_pattern
    if pattern is None or "|" in pattern or config.pp == 1:
        return pattern
    per = len(pattern) // config.pp
    return "|".join(pattern[i:i + per] for i in range(0, len(pattern), per))


def _check_pattern(config, pattern) -> None:
    if not isinstance(pattern, str) or not pattern.replace("|", ""):
        raise ValueError(f"--hybrid-pattern={pattern!r}; give one symbol per layer out of "
                         f"{BENCH_SYMBOLS!r}, e.g. G*M- (`|` between pipeline stages)")
    bad = sorted(set(pattern) - set(BENCH_SYMBOLS + "|"))
    if bad:
        raise ValueError(f"--hybrid-pattern={pattern!r}: the bench builds the symbols "
                         f"{BENCH_SYMBOLS!r} (attention, MLP, Gated DeltaNet, Mamba-2; `|` "
                         f"between pipeline stages), not {bad}")
    if not set(pattern) & set("*GM"):
        raise ValueError(f"--hybrid-pattern={pattern!r} has no `*`, `G` or `M` layer: "
                         "nothing of a prefix would be cached")
    layers = len(pattern.replace("|", ""))
    if layers != config.num_layers:
        raise ValueError(f"--hybrid-pattern={pattern!r} has {layers} layers; give "
                         f"--num-layers {layers}")
    if "|" in pattern:
        stages = pattern.split("|")
        if len(stages) != config.pp or not all(stages):
            raise ValueError(f"--hybrid-pattern={pattern!r} marks {len(stages)} pipeline "
                             f"stage(s) {stages}; give --pp {len(stages)} and at least one "
                             f"layer per stage, or no `|` (then --pp {config.pp} splits the "
                             "layers evenly)")


def _check_parallel(config) -> None:
    """The hybrid layers' head splits over --tp (Megatron asserts them at build time)."""
    tp, a = config.tp, config.num_attention_heads
    gdn = config.linear_attention_freq is not None or "G" in (config.hybrid_pattern or "")
    if gdn and (a // 2) % tp:
        raise ValueError(f"--tp={tp} does not divide the GDN key heads ({a // 2} = "
                         f"--num-attention-heads / 2); give --num-attention-heads a multiple "
                         f"of {2 * tp}")
    if "M" in (config.hybrid_pattern or ""):
        heads = _mamba_heads(config)
        if heads % tp or _mamba_groups(config) is None:
            raise ValueError(f"--tp={tp} does not divide the Mamba heads ({heads} = 2 x "
                             f"--hidden-size / {MAMBA_HEAD_DIM}) and a group count (8, 4, 2 or "
                             "1) dividing them; change --hidden-size or --tp")


def _mamba_heads(config) -> int:
    return max(1, 2 * config.hidden_size // MAMBA_HEAD_DIM)


def _mamba_groups(config) -> int | None:
    """Mamba groups: the most of 8, 4, 2, 1 that divide the heads and split over --tp."""
    heads = _mamba_heads(config)
    return next((g for g in (MAMBA_GROUPS, 4, 2, 1) if heads % g == 0 and g % config.tp == 0),
                None)


def _gdn_shape(config) -> dict:
    a, h = config.num_attention_heads, config.hidden_size
    return dict(linear_num_key_heads=a // 2, linear_num_value_heads=a,
                linear_key_head_dim=2 * h // a, linear_value_head_dim=2 * h // a,
                linear_conv_kernel_dim=CONV)


def _mamba_shape(config) -> dict:
    return dict(mamba_num_heads=_mamba_heads(config), mamba_head_dim=MAMBA_HEAD_DIM,
                mamba_state_dim=MAMBA_STATE_DIM, mamba_num_groups=_mamba_groups(config))


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
    pattern = config.hybrid_pattern  # the FLOP model's view: layers, no stage marks
    fields = dict(hybrid_overrides(config), linear_attention_freq=config.linear_attention_freq,
                  hybrid_pattern=None if pattern is None else pattern.replace("|", ""),
                  mamba_conv_kernel_dim=CONV,
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


def _build(config, shape, seed: int, extra: dict):
    overrides = {**hybrid_overrides(config), **extra}
    if config.linear_attention_freq is not None:
        from megatron_patches.models.gdn import build_gdn_model

        return build_gdn_model(shape, linear_attention_freq=config.linear_attention_freq,
                               seed=seed, rotary_percent=0.25, **overrides,
                               **config.recompute_options())
    from megatron_patches.models.hybrid import build_hybrid_model

    return build_hybrid_model(shape, stage_pattern(config), seed=seed, **overrides,
                              **config.recompute_options())


def build_hybrid_models(config, shape, **extra):
    """(local-spec model, fused-SDPA model with the same weights) of this rank (its pipeline
    stage and TP shard), unwrapped; `extra`: more TransformerConfig fields (--production's)."""
    local = _build(config, shape, config.seed, extra)
    _trained_decay(config, local, config.seed + 7)
    fused = _build(config, shape, config.seed + 1, extra)  # equal weights only via load_state_dict
    _fuse_core_attention(fused)
    fused.load_state_dict(local.state_dict())
    return local, fused


def stage_layers(model) -> str:
    """The layer symbols this rank's built model holds (`*` attention, `-` MLP, `G` GDN, `M`
    Mamba-2): a HybridModel's layer types as Megatron selected its stage, a GPTModel's layers
    as `G` (GatedDeltaNet self-attention) or `*`."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    while not hasattr(model, "decoder"):  # Megatron's DDP wrapper
        model = model.module
    decoder = model.decoder
    if hasattr(decoder, "layer_type_list"):
        return "".join(decoder.layer_type_list)
    return "".join("G" if isinstance(layer.self_attention, GatedDeltaNet) else "*"
                   for layer in decoder.layers)
