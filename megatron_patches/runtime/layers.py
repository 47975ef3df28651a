"""Which layers of a model hold prefix K/V, and which layer kinds prefix reuse refuses.

`GPTModel`: every decoder layer is attention + MLP, so the last layer holds the last K/V.
`HybridModel`: one symbol per layer in `hybrid_layer_pattern` (Megatron's `Symbols`): attention
(`*`), gated delta net (`G`: its recurrent state and conv tail are cached instead of K/V,
[Note: recurrent prefix state]), MLP (`-`) and MoE (`E`, megatron_patches/runtime/moe.py) layers are
supported, and so are Mamba-2 layers (`M`: SSD state and conv tail cached,
megatron_patches/runtime/mamba_hooks.py): the last stage's prefix forward runs to the last `*`, `G` or
`M` (its K/V or state), or on to the router of a later `E` layer whose statistics count the
prefix (`prefix_stop`); DSA (`D`) and MLA (`+`) layers are refused in a pattern (MLA runs in GPTModel, runtime/mla_hooks.py). A GPTModel with `experimental_attention_variant="gated_delta_net"` holds GDN layers too. Every check reads the whole pattern, which every rank holds, so all pipeline ranks
refuse together, before any compute (no rank is left waiting on a peer that raised).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron_patches.config.config_support import is_gdn_variant
from megatron.core import parallel_state
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.utils import get_model_config, unwrap_model

__all__ = ["check_layers_supported", "check_recurrent_step", "has_recurrent_layers",
           "last_kv_layer_number",
           "prefix_stop", "stage_patterns"]

_REFUSED = {
    Symbols.DS_ATTENTION: ("DeepSeek sparse attention", "its indexer's top-k over the prefix "
                           "needs the prefix's index keys, which the reuse cache does not keep"),
    Symbols.MLA: ("multi-latent attention", "MLA is verified in GPTModel "
                  "(multi_latent_attention=True, tests/test_mla.py), not in a HybridModel pattern"),
}


_CACHING = (Symbols.ATTENTION, Symbols.GDN, Symbols.MAMBA)  # prefix leaves K/V or a state
_RECURRENT = (Symbols.GDN, Symbols.MAMBA)


def _hybrid(model) -> Optional[HybridModel]:
    inner = unwrap_model(model)
    return inner if isinstance(inner, HybridModel) else None


def stage_patterns(pattern: str, pp_size: int, config) -> List[str]:
    """The main-decoder layer symbols of each pipeline stage, as `HybridModel` splits them.

    Explicit `|` marks, else an even split (or `num_layers_in_first/last_pipeline_stage`).
    """
    main = parse_hybrid_pattern(pattern).main_pattern or ""
    if Symbols.PIPE in main:
        return main.split(Symbols.PIPE)
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    counts = [None] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    middle = [i for i, c in enumerate(counts) if c is None]
    rest = len(main) - sum(c for c in counts if c is not None)
    for i in middle:
        counts[i] = rest // len(middle)
    starts = [sum(counts[:i]) for i in range(pp_size)]
    return [main[s:s + c] for s, c in zip(starts, counts)]


def check_layers_supported(config, model) -> None:
    """ValueError, before any compute, for layers whose prefix state is not K/V (see module)."""
    if getattr(config, "mtp_num_layers", None):
        from megatron_patches.config.config_support import _MTP_WHY

        raise ValueError(f"mtp_num_layers={config.mtp_num_layers}: " + _MTP_WHY)
    hybrid = _hybrid(model)
    if hybrid is None:
        if is_gdn_variant(getattr(config, "experimental_attention_variant", None)):
            _check_gdn_supported(config)
        return
    pattern = hybrid.hybrid_layer_pattern
    parsed = parse_hybrid_pattern(pattern)
    if parsed.mtp_pattern is not None:
        raise ValueError(f"hybrid_layer_pattern {pattern!r} has multi-token prediction layers "
                         "(after '/'): not supported in prefix reuse steps yet")
    refused = [f"{symbol!r} ({name}): {why}" for symbol, (name, why) in _REFUSED.items()
               if symbol in (parsed.main_pattern or "")]
    if set(_RECURRENT) & set(parsed.main_pattern or ""):
        _check_gdn_supported(config)
    if refused:
        raise ValueError(f"hybrid_layer_pattern {pattern!r} has layers prefix reuse cannot run: "
                         + "; ".join(refused))
    stages = stage_patterns(pattern, parallel_state.get_pipeline_model_parallel_world_size(),
                            config)
    empty = [i for i, stage in enumerate(stages) if not set(_CACHING) & set(stage)]
    if empty:
        raise ValueError(
            f"hybrid_layer_pattern {pattern!r}: pipeline stage(s) {empty} hold no attention layer "
            f"('*'), no gated delta net ('G') and no Mamba ('M') layer, so they would cache no "
            f"prefix K/V or state (stages: {stages}); give every stage one ('|' marks the stage "
            "boundaries)")
    own = "".join(hybrid.decoder.layer_type_list)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    assert own == stages[rank], f"stage {rank} built {own!r}, not {stages[rank]!r}: split drifted"


def _check_gdn_supported(config) -> None:
    """Gated DeltaNet and Mamba layers cache a recurrent state ([Note: recurrent prefix state]);
    context parallelism would need it split, which is not implemented. (Full recompute runs:
    Phase C's re-run hands the states their gradients, [Note: prefix full recompute].)"""
    why = []
    if config.context_parallel_size > 1:
        why.append("context parallelism (GDN's CP all-to-all splits heads, and a zigzag shard "
                   "has no prefix state of its own): use context_parallel_size=1")
    if why:
        raise ValueError("Gated DeltaNet (experimental_attention_variant='gated_delta_net', "
                         "'G') and Mamba ('M') layers with prefix reuse do not support: "
                         + "; ".join(why))


def has_recurrent_layers(config, model) -> bool:
    """Whether the model holds Gated DeltaNet or Mamba-2 layers (their prefix is a state)."""
    hybrid = _hybrid(model)
    if hybrid is not None:
        main = parse_hybrid_pattern(hybrid.hybrid_layer_pattern).main_pattern or ""
        return bool(set(_RECURRENT) & set(main))
    return is_gdn_variant(getattr(config, "experimental_attention_variant", None))


def check_recurrent_step(config, model, step) -> None:
    """ValueError before compute: a prefix-tree step on a model with GDN or Mamba-2 layers
    whose reader stops inside a prefix unit (a recurrent layer's state exists only at a unit's
    end; StepPlan.state_reads cuts the units there)."""
    plan = step.plan
    trees = {w.group for w in plan.prefixes if w.nodes is not None}
    if not trees or not has_recurrent_layers(config, model):
        return
    units = {(c.group, c.chunk): c.length for c in plan.prefix_units().values()}
    for mb in plan.microbatches:
        for s in mb.segments:
            if s.group not in trees or not s.cached_len:
                continue
            chain = plan.chain_chunks(s.group, s.node)
            ends = {sum(units[s.group, c] for c in chain[:i + 1]) for i in range(len(chain))}
            if s.cached_len not in ends:
                raise ValueError(
                    f"group {s.group} trajectory {s.trajectory} reads {s.cached_len} cached "
                    "tokens, inside a prefix unit of its tree: Gated DeltaNet / Mamba layers keep "
                    "a state only at a unit's end; plan with plan_microbatches(..., "
                    "state_reads=True)")


def last_kv_layer_number(model) -> int:
    """Global number (1-based) of the model's last layer that stores prefix K/V.

    The last pipeline stage's prefix forward stops right after storing it: nothing after it
    (MLP layers, final norm, output layer) feeds a suffix.
    """
    hybrid = _hybrid(model)
    if hybrid is None:
        return get_model_config(model).num_layers
    main = (parse_hybrid_pattern(hybrid.hybrid_layer_pattern).main_pattern or "")
    layers = main.replace(Symbols.PIPE, "")
    return max(i for i, symbol in enumerate(layers, start=1) if symbol in _CACHING)


def prefix_stop(model) -> Tuple[int, bool]:
    """(layer number, in its router) where the last stage's prefix forward stops: after the last
    layer storing prefix K/V, or in the router of the last MoE layer whose statistics count the
    prefix (moe.needs_prefix_stats) when that comes later (GPTModel: the last layer's MoE half;
    HybridModel: an `E` layer after the last `*`). Nothing after it feeds a suffix or a router
    statistic."""
    from megatron_patches.runtime.moe import needs_prefix_stats, routers

    kv = last_kv_layer_number(model)
    counted = [r.layer_number for r in routers(model) if needs_prefix_stats(r)]
    stop = max([kv, *counted])
    return stop, stop in counted
