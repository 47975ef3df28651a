"""Multi-latent attention (MLA) models on Megatron's local (non-TE) layer spec.

Megatron's MLA passes `k_channels` / `v_channels` to its core attention, which only Transformer
Engine's `TEDotProductAttention` accepts; the local `DotProductAttention` computes MLA's math
unchanged (scores from q/k of any head dim, output from v) once it is built with
`kv_channels = v_head_dim` (its output width) and MLA's softmax scale. `MLALocalCoreAttention`
is that stock module with the two extra arguments checked and dropped: the dense reference of
tests/test_mla.py is Megatron's own attention math, and reuse steps replace it by the hook
(megatron_patches/runtime/mla_hooks.py).
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["MLALocalCoreAttention", "check_mla_config", "use_local_mla_core_attention"]


class MLALocalCoreAttention(DotProductAttention):
    """Megatron's local DotProductAttention for MLA (see the module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, k_channels=None, v_channels=None):
        check_mla_config(config)
        if v_channels is not None and v_channels != config.kv_channels:
            raise AssertionError(f"v_channels {v_channels} != kv_channels {config.kv_channels}")
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)


def check_mla_config(config) -> None:
    """ValueError unless the local core attention can run this MLA config."""
    if config.kv_channels != config.v_head_dim:
        raise ValueError(f"an MLA model on the local spec needs kv_channels = v_head_dim "
                         f"({config.v_head_dim}), got kv_channels={config.kv_channels}: the local "
                         "DotProductAttention sizes its output by kv_channels")


def use_local_mla_core_attention(spec) -> None:
    """Swap the core attention of a (block or layer) spec's MLA layers, in place."""
    for layer_spec in getattr(spec, "layer_specs", [spec]):
        layer_spec.submodules.self_attention.submodules.core_attention = MLALocalCoreAttention
