"""Multi-latent attention (MLA, `MLASelfAttention`) in reuse steps: the mla-reuse-hook.

[Note: MLA prefix cache]
MLA builds each head's key as [k_nope (from the latent's up-projection) ; k_pe (one RoPE'd
64-dim head shared by all query heads)] and a value of another width (DeepSeek-V3: Q/K head
dim 192, V 128). The reuse cache keeps what the core attention receives: the per-head post-RoPE
K [P, 1, heads, 192] and V [P, 1, heads, 128], with their graph, exactly as for GQA layers
(hooks.core_attention_hook runs unchanged). The alternative -- caching the latent and k_pe
(512 + 64 values per token) and re-running `linear_kv_up_proj` per suffix microbatch -- is
~35x smaller for DeepSeek-V3 but repeats the up-projection (and its weight-gradient pass) for
every microbatch; docs/DESIGN.md "MLA" has the numbers and why the simple choice is kept.

RoPE: MLA applies RoPE inside `get_query_key_value_tensors` with its own rotary module (rope or
yarn); the hook hands it the table at the row's own positions (hooks.positions_table), so a
suffix continues at its prefix length. Yarn's mscale (applied to cos/sin) does not depend on
positions and stays the stock call's; the softmax scale mscale^2/sqrt(192) is the core
attention's `softmax_scale`, which the reuse attention reads. The attention kernels take the
unequal V width by zero-padding V (prefix_schedule/attention/core.py, [Note: unequal V head
dim]).
"""

from __future__ import annotations

import functools

from prefix_schedule.runtime.context import current_context
from megatron_patches.runtime.hooks import core_attention_hook, positions_table

__all__ = ["mla_reuse_hook"]


def mla_reuse_hook(module, site: str):
    """`_mla_reuse_hook(self, site)` in Megatron's MultiLatentAttention: None outside reuse
    steps (stock path); in a reuse step a stand-in for the RoPE table ('rope') or for the core
    attention ('core')."""
    context = current_context()
    if context is None:
        return None
    if site == "rope":
        return functools.partial(positions_table, module.rotary_pos_emb)
    if site == "core":
        return functools.partial(core_attention_hook, module)
    raise AssertionError(f"unknown MLA hook site {site!r}")
