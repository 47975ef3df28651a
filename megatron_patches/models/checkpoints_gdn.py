"""Hugging Face Qwen3-Next / Qwen3.5 decoder layers <-> Megatron GPTModel GDN-hybrid layers, for
any TP split; checkpoints.py calls these for a ModelSpec with `is_gdn` (pure tensor code; the
shared pieces are checkpoints_base.py's).

Layouts (megatron-core 0.19 / 0.20 `GatedDeltaNet`, `SelfAttention` with
`attention_output_gate`; read against transformers 5.23 `Qwen3NextGatedDeltaNet`,
`Qwen3_5GatedDeltaNet`, `Qwen3NextAttention`):

* GDN `in_proj` (column parallel): TP rank r holds [q_r | k_r | v_r | z_r | beta_r | alpha_r],
  each the r-th contiguous block of heads (Megatron splits its local output in that order).
  HF Qwen3.5: `in_proj_qkv` = [q; k; v] (heads contiguous), `in_proj_z`, `in_proj_b`,
  `in_proj_a`. HF Qwen3-Next: `in_proj_qkvz` rows per key head h [q_h; k_h; v of h's value
  heads; z of h's value heads] and `in_proj_ba` per key head [b of its value heads; a of them]
  (value head j belongs to key head j // (HV / HK) on both sides).
* `conv1d` (depthwise over the q, k, v channels): rank r holds [q_r | k_r | v_r] channels;
  `A_log`, `dt_bias`: the r-th block of value heads; `out_norm` (plain w on both sides) is
  replicated; `out_proj` row parallel.
* Gated attention `linear_qkv`: per query group [its q heads; their gate heads; k; v]; HF
  `q_proj` rows per head [query_h; gate_h].
* Every other norm: HF computes (1 + w), Megatron's local / TE norms w (no zero-centred gamma
  on CPU): Megatron = HF + 1, HF = Megatron - 1. For bf16 checkpoint values the fp32 sums are
  exact, so a round trip returns the same bits (a float32 value with bits below 2^-23 would not).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_patches.models.checkpoints_base import (RankLayout, _cols, _megatron_layer_names,
                                                      _mlp_to_hf, _mlp_to_megatron, _rows,
                                                      local_experts, mlp_hf_names)

__all__ = ["NORM_OFFSET", "is_linear_layer", "gdn_hf_names", "gdn_layer_to_megatron",
           "gdn_layer_to_hf"]

NORM_OFFSET = 1.0
"""Megatron's norm weight minus HF's (1 + w) parameter (every norm but the GDN output norm)."""


def is_linear_layer(spec, layer: int) -> bool:
    """Global layer `layer` (0-based) is a GDN layer (else gated softmax attention)."""
    return (layer + 1) % spec.linear_attention_freq != 0


def gdn_hf_names(spec, layer: int, experts=None) -> Dict[str, str]:
    """Short name -> HF tensor name of one decoder layer of a GDN hybrid (MoE: of `experts`,
    default all)."""
    p = f"model.layers.{layer}"
    names = {"input_norm": f"{p}.input_layernorm.weight",
             "mlp_norm": f"{p}.post_attention_layernorm.weight",
             **mlp_hf_names(spec, p, experts)}
    if not is_linear_layer(spec, layer):
        a = f"{p}.self_attn"
        return {**names, "q": f"{a}.q_proj.weight", "k": f"{a}.k_proj.weight",
                "v": f"{a}.v_proj.weight", "o": f"{a}.o_proj.weight",
                "q_norm": f"{a}.q_norm.weight", "k_norm": f"{a}.k_norm.weight"}
    a = f"{p}.linear_attn"
    names.update(conv1d=f"{a}.conv1d.weight", A_log=f"{a}.A_log", dt_bias=f"{a}.dt_bias",
                 out_norm=f"{a}.norm.weight", out_proj=f"{a}.out_proj.weight")
    if spec.family == "qwen3_next":
        names.update(qkvz=f"{a}.in_proj_qkvz.weight", ba=f"{a}.in_proj_ba.weight")
    else:
        names.update(qkv=f"{a}.in_proj_qkv.weight", z=f"{a}.in_proj_z.weight",
                     b=f"{a}.in_proj_b.weight", a=f"{a}.in_proj_a.weight")
    return names


def _megatron_names(spec, local: int, layout: RankLayout, linear: bool) -> Dict[str, str]:
    """checkpoints.py's layer names (attention, MLP, norms) plus the GDN layer's."""
    a = f"decoder.layers.{local}.self_attention"
    names = _megatron_layer_names(local, layout, spec.is_moe)
    if linear and layout.te_names:  # TE fuses the input norm into the GDN in_proj
        names["input_norm"] = f"{a}.in_proj.layer_norm_weight"
    return {**names, "in_proj": f"{a}.in_proj.weight", "conv1d": f"{a}.conv1d.weight",
            "A_log": f"{a}.A_log", "dt_bias": f"{a}.dt_bias",
            "out_norm": f"{a}.out_norm.weight", "out_proj": f"{a}.out_proj.weight"}


def _gdn_sizes(spec) -> List[int]:
    """Rows of q, k, v, z, beta, alpha in a GDN in_proj."""
    qk = spec.linear_num_key_heads * spec.linear_key_head_dim
    v = spec.linear_num_value_heads * spec.linear_value_head_dim
    return [qk, qk, v, v, spec.linear_num_value_heads, spec.linear_num_value_heads]


def _hf_in_proj_parts(spec, hf, src) -> List[torch.Tensor]:
    """[q, k, v, z, b, a] (heads contiguous) from either HF layout."""
    sizes = _gdn_sizes(spec)
    if spec.family != "qwen3_next":
        return [*hf[src["qkv"]].split(sizes[:3]), hf[src["z"]], hf[src["b"]], hf[src["a"]]]
    hk, dk, dv = spec.linear_num_key_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    r = spec.linear_num_value_heads // hk
    q, k, v, z = hf[src["qkvz"]].reshape(hk, 2 * dk + 2 * r * dv, -1).split(
        [dk, dk, r * dv, r * dv], dim=1)
    b, a = hf[src["ba"]].reshape(hk, 2 * r, -1).split([r, r], dim=1)
    return [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]


def _hf_from_in_proj_parts(spec, parts, dst) -> Dict[str, torch.Tensor]:
    q, k, v, z, b, a = parts
    if spec.family != "qwen3_next":
        return {dst["qkv"]: torch.cat([q, k, v]), dst["z"]: z, dst["b"]: b, dst["a"]: a}
    hk = spec.linear_num_key_heads
    per = lambda t: t.reshape(hk, -1, t.shape[-1])  # noqa: E731 -- rows per key head
    qkvz = torch.cat([per(q), per(k), per(v), per(z)], dim=1)
    ba = torch.cat([per(b), per(a)], dim=1)
    return {dst["qkvz"]: qkvz.reshape(-1, qkvz.shape[-1]), dst["ba"]: ba.reshape(-1, ba.shape[-1])}


def _gated_qkv(spec, q_proj, k, v) -> torch.Tensor:
    """[G, rows per group, hidden]: per query group [its q heads; their gates; k; v]."""
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    query, gate = q_proj.reshape(spec.num_attention_heads, 2 * d, -1).split([d, d], dim=1)
    return torch.cat([query.reshape(g, per * d, -1), gate.reshape(g, per * d, -1),
                      k.reshape(g, d, -1), v.reshape(g, d, -1)], dim=1)


def _split_gated_qkv(spec, qkv: torch.Tensor):
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    query, gate, k, v = qkv.reshape(g, (2 * per + 2) * d, -1).split([per * d, per * d, d, d],
                                                                    dim=1)
    q_proj = torch.cat([query.reshape(-1, d, query.shape[-1]),
                        gate.reshape(-1, d, gate.shape[-1])], dim=1)
    return q_proj.reshape(-1, q_proj.shape[-1]), k.reshape(g * d, -1), v.reshape(g * d, -1)


def gdn_layer_to_megatron(spec, layout: RankLayout, hf, layer: int, local: int
                          ) -> Dict[str, torch.Tensor]:
    """This rank's Megatron tensors of global layer `layer` (local index `local`)."""
    linear = is_linear_layer(spec, layer)
    experts = _local_experts(spec, layout)
    src, dst = gdn_hf_names(spec, layer, experts), _megatron_names(spec, local, layout, linear)
    out = {dst["input_norm"]: hf[src["input_norm"]] + NORM_OFFSET,
           dst["mlp_norm"]: hf[src["mlp_norm"]] + NORM_OFFSET,
           **_mlp_to_megatron(spec, layout, hf, src, dst, local)}
    if not linear:
        qkv = _rows(_gated_qkv(spec, hf[src["q"]], hf[src["k"]], hf[src["v"]]), layout)
        out.update({dst["qkv"]: qkv.reshape(-1, spec.hidden_size),
                    dst["o"]: _cols(hf[src["o"]], layout),
                    dst["q_norm"]: hf[src["q_norm"]] + NORM_OFFSET,
                    dst["k_norm"]: hf[src["k_norm"]] + NORM_OFFSET})
        return out
    parts = _hf_in_proj_parts(spec, hf, src)
    conv = hf[src["conv1d"]].split(_gdn_sizes(spec)[:3])
    out.update({dst["in_proj"]: torch.cat([_rows(t, layout) for t in parts]),
                dst["conv1d"]: torch.cat([_rows(t, layout) for t in conv]),
                dst["A_log"]: _rows(hf[src["A_log"]], layout),
                dst["dt_bias"]: _rows(hf[src["dt_bias"]], layout),
                dst["out_norm"]: hf[src["out_norm"]],
                dst["out_proj"]: _cols(hf[src["out_proj"]], layout)})
    return out


def _local_experts(spec, layout: RankLayout):
    return local_experts(spec, layout) if spec.is_moe else None


def _unshard(spec, layout: RankLayout, tensors: List[torch.Tensor], sizes: List[int]):
    """The full [part_0, part_1, ...] rows from every TP rank's [part_0_r | part_1_r | ...]."""
    pieces = [t.split([s // layout.tp_size for s in sizes]) for t in tensors]
    return [torch.cat([p[i] for p in pieces]) for i in range(len(sizes))]


def gdn_layer_to_hf(spec, layouts, ranks, layer: int, local: int, experts=None
                    ) -> Dict[str, torch.Tensor]:
    """HF tensors of global layer `layer` from one stage's TP ranks (`ranks[tp]`; MoE experts
    from `experts[ep][expert_tp]`, checkpoints.to_hf's)."""
    linear = is_linear_layer(spec, layer)
    src = [_megatron_names(spec, local, lay, linear) for lay in layouts]
    dst = gdn_hf_names(spec, layer)
    get = lambda key: [r[s[key]] for r, s in zip(ranks, src)]  # noqa: E731
    out = {dst["input_norm"]: get("input_norm")[0] - NORM_OFFSET,
           dst["mlp_norm"]: get("mlp_norm")[0] - NORM_OFFSET,
           **_mlp_to_hf(spec, layouts, ranks, src, dst, local, experts)}
    if not linear:
        q, k, v = _split_gated_qkv(spec, torch.cat(get("qkv")))
        out.update({dst["q"]: q, dst["k"]: k, dst["v"]: v, dst["o"]: torch.cat(get("o"), dim=1),
                    dst["q_norm"]: get("q_norm")[0] - NORM_OFFSET,
                    dst["k_norm"]: get("k_norm")[0] - NORM_OFFSET})
        return out
    sizes = _gdn_sizes(spec)
    out.update(_hf_from_in_proj_parts(spec, _unshard(spec, layouts[0], get("in_proj"), sizes),
                                      dst))
    out.update({dst["conv1d"]: torch.cat(_unshard(spec, layouts[0], get("conv1d"), sizes[:3])),
                dst["A_log"]: torch.cat(get("A_log")), dst["dt_bias"]: torch.cat(get("dt_bias")),
                dst["out_norm"]: get("out_norm")[0],
                dst["out_proj"]: torch.cat(get("out_proj"), dim=1)})
    return out
