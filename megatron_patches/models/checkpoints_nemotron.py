"""Hugging Face Nemotron-H (`NemotronHForCausalLM`) layers <-> Megatron `HybridModel` layers, for
any TP split; checkpoints.py calls these for a ModelSpec with `is_nemotron_h` (pure tensor code).

Layouts (megatron-core 0.19 `MambaLayer` / `MambaMixer`, the HybridModel's attention-only
`TransformerLayer` and `MLPLayer`; read against transformers 5.23 `NemotronHBlock`,
`NemotronHMamba2Mixer`, `NemotronHAttention`, `NemotronHMLP`):

* Names: HF `backbone.layers.{i}.norm.weight` + `backbone.layers.{i}.mixer.*` for every layer
  kind (the published checkpoints' and transformers' `save_pretrained` names), `backbone.
  embeddings.weight`, `backbone.norm_f.weight`, `lm_head.weight`; Megatron `decoder.layers.{i}.`
  `norm.weight` + `mixer.*` (Mamba), `input_layernorm.weight` + `self_attention.*` (attention),
  `pre_mlp_layernorm.weight` + `mlp.*` (MLP), `decoder.final_norm.weight`. With Transformer
  Engine specs the layer norm is fused: `mixer.in_proj.layer_norm_weight`,
  `self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`.
* Mamba `in_proj` (column parallel): HF rows [z; x; B; C; dt] (d_inner, d_inner, G*N, G*N, H);
  TP rank r holds [z_r | x_r | B_r | C_r | dt_r], each the r-th contiguous block (Megatron's
  `in_proj_partition_sizes`). `conv1d_weight` [x B C channels, 1, 4] and `conv1d_bias` the same
  way over [x_r | B_r | C_r] (HF `conv1d.weight` / `conv1d.bias`); `dt_bias`, `A_log`, `D` and the
  grouped gated norm's weight (`mixer.norm.weight`, whole groups per rank) the r-th block;
  `out_proj` row parallel (column blocks).
* Attention: `linear_qkv` per query group [q heads; k; v] (no positions, no q/k norm);
  MLP: `linear_fc1` = `up_proj` rows (relu^2, no gate), `linear_fc2` = `down_proj` columns.
* Every norm is plain w on both sides: tensors are copied, never offset, so a round trip returns
  the same bits.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_patches.models.checkpoints_base import (RankLayout, _cols, _qkv_groups, _rows,
                                                      _split_qkv)

__all__ = ["NEMOTRON_TOP_NAMES", "nemotron_hf_names", "nemotron_layer_to_megatron",
           "nemotron_layer_to_hf"]

NEMOTRON_TOP_NAMES = {"embed": "backbone.embeddings.weight", "norm": "backbone.norm_f.weight",
                      "head": "lm_head.weight", "final_norm": "decoder.final_norm.weight"}
"""HF embedding, final norm and head names; Megatron's HybridModel final norm name."""
_MAMBA = ("in_proj", "conv1d", "conv1d_bias", "dt_bias", "A_log", "D", "gated_norm", "out_proj")


def nemotron_hf_names(spec, layer: int) -> Dict[str, str]:
    """Short name -> HF tensor name of one Nemotron-H block (its kind from the pattern)."""
    p = f"backbone.layers.{layer}"
    m = f"{p}.mixer"
    kind = spec.hybrid_layer_pattern[layer]
    if kind == "M":
        mixer = dict(zip(_MAMBA, (f"{m}.in_proj.weight", f"{m}.conv1d.weight", f"{m}.conv1d.bias",
                                  f"{m}.dt_bias", f"{m}.A_log", f"{m}.D", f"{m}.norm.weight",
                                  f"{m}.out_proj.weight")))
    elif kind == "*":
        mixer = {k: f"{m}.{k}_proj.weight" for k in ("q", "k", "v", "o")}
    else:
        mixer = {"up": f"{m}.up_proj.weight", "down": f"{m}.down_proj.weight"}
    return {"norm": f"{p}.norm.weight", **mixer}


def _megatron_names(spec, layer: int, local: int, layout: RankLayout) -> Dict[str, str]:
    p = f"decoder.layers.{local}"
    kind, te = spec.hybrid_layer_pattern[layer], layout.te_names
    if kind == "M":
        m = f"{p}.mixer"
        return {"norm": f"{m}.in_proj.layer_norm_weight" if te else f"{p}.norm.weight",
                **dict(zip(_MAMBA, (f"{m}.in_proj.weight", f"{m}.conv1d_weight",
                                    f"{m}.conv1d_bias", f"{m}.dt_bias", f"{m}.A_log", f"{m}.D",
                                    f"{m}.norm.weight", f"{m}.out_proj.weight")))}
    if kind == "*":
        a = f"{p}.self_attention"
        return {"norm": f"{a}.linear_qkv.layer_norm_weight" if te
                else f"{p}.input_layernorm.weight",
                "qkv": f"{a}.linear_qkv.weight", "o": f"{a}.linear_proj.weight"}
    return {"norm": f"{p}.mlp.linear_fc1.layer_norm_weight" if te
            else f"{p}.pre_mlp_layernorm.weight",
            "up": f"{p}.mlp.linear_fc1.weight", "down": f"{p}.mlp.linear_fc2.weight"}


def _in_proj_sizes(spec) -> List[int]:
    """Rows of z, x, B, C, dt in a Mamba in_proj (HF and Megatron alike)."""
    inner = spec.mamba_num_heads * spec.mamba_head_dim
    bc = spec.mamba_num_groups * spec.mamba_state_dim
    return [inner, inner, bc, bc, spec.mamba_num_heads]


def _sharded(t: torch.Tensor, sizes: List[int], layout: RankLayout) -> torch.Tensor:
    """[part_0_r | part_1_r | ...]: this TP rank's block of each part of `t`'s rows."""
    return torch.cat([_rows(part, layout) for part in t.split(sizes)])


def _unsharded(tensors: List[torch.Tensor], sizes: List[int], tp: int) -> torch.Tensor:
    """The full [part_0; part_1; ...] rows from every TP rank's [part_0_r | part_1_r | ...]."""
    pieces = [t.split([s // tp for s in sizes]) for t in tensors]
    return torch.cat([torch.cat([p[i] for p in pieces]) for i in range(len(sizes))])


def nemotron_layer_to_megatron(spec, layout: RankLayout, hf, layer: int, local: int
                               ) -> Dict[str, torch.Tensor]:
    """This rank's Megatron tensors of global layer `layer` (local index `local`)."""
    src, dst = nemotron_hf_names(spec, layer), _megatron_names(spec, layer, local, layout)
    kind = spec.hybrid_layer_pattern[layer]
    out = {dst["norm"]: hf[src["norm"]]}
    if kind == "*":
        qkv = _rows(_qkv_groups(spec, hf[src["q"]], hf[src["k"]], hf[src["v"]]), layout)
        out.update({dst["qkv"]: qkv.reshape(-1, spec.hidden_size),
                    dst["o"]: _cols(hf[src["o"]], layout)})
    elif kind == "-":
        out.update({dst["up"]: _rows(hf[src["up"]], layout),
                    dst["down"]: _cols(hf[src["down"]], layout)})
    else:
        sizes = _in_proj_sizes(spec)
        out.update({dst["in_proj"]: _sharded(hf[src["in_proj"]], sizes, layout),
                    dst["conv1d"]: _sharded(hf[src["conv1d"]], sizes[1:4], layout),
                    dst["conv1d_bias"]: _sharded(hf[src["conv1d_bias"]], sizes[1:4], layout),
                    dst["out_proj"]: _cols(hf[src["out_proj"]], layout)})
        out.update({dst[k]: _rows(hf[src[k]], layout) for k in ("dt_bias", "A_log", "D",
                                                                 "gated_norm")})
    return out


def nemotron_layer_to_hf(spec, layouts, ranks, layer: int, local: int
                         ) -> Dict[str, torch.Tensor]:
    """HF tensors of global layer `layer` from one stage's TP ranks (`ranks[tp]`)."""
    src = [_megatron_names(spec, layer, local, lay) for lay in layouts]
    dst = nemotron_hf_names(spec, layer)
    get = lambda key: [r[s[key]] for r, s in zip(ranks, src)]  # noqa: E731
    kind, tp = spec.hybrid_layer_pattern[layer], len(layouts)
    out = {dst["norm"]: get("norm")[0]}
    if kind == "*":
        q, k, v = _split_qkv(spec, torch.cat(get("qkv")))
        out.update({dst["q"]: q, dst["k"]: k, dst["v"]: v, dst["o"]: torch.cat(get("o"), dim=1)})
    elif kind == "-":
        out.update({dst["up"]: torch.cat(get("up")), dst["down"]: torch.cat(get("down"), dim=1)})
    else:
        sizes = _in_proj_sizes(spec)
        out.update({dst["in_proj"]: _unsharded(get("in_proj"), sizes, tp),
                    dst["conv1d"]: _unsharded(get("conv1d"), sizes[1:4], tp),
                    dst["conv1d_bias"]: _unsharded(get("conv1d_bias"), sizes[1:4], tp),
                    dst["out_proj"]: torch.cat(get("out_proj"), dim=1)})
        out.update({dst[k]: torch.cat(get(k)) for k in ("dt_bias", "A_log", "D", "gated_norm")})
    return out
