"""Hugging Face Llama 3 / Qwen3 / Qwen3-MoE (and, through checkpoints_gdn.py, Qwen3-Next /
Qwen3.5) weights <-> Megatron GPTModel weights, for any TP x PP (x EP) split.

Pure tensor code (no Megatron import): `to_megatron` gives one rank's tensors, named like the
parameters of Megatron's GPTModel on that rank; `to_hf` assembles the HF tensors from every rank's.
Layouts (megatron-core 0.19 / 0.20, local and Transformer Engine layer specs):

* `linear_qkv` (column parallel): per query group g, the rows [q heads of g; k_g; v_g]; TP rank r
  holds groups r*G/tp .. (r+1)*G/tp - 1 (so num_key_value_heads % tp == 0).
* `linear_fc1` (column parallel, SwiGLU): TP rank r holds [gate rows of r; up rows of r].
* `linear_proj`, `linear_fc2` (row parallel): column blocks per TP rank.
* `word_embeddings`, `output_layer` (vocab parallel): row blocks of the vocabulary padded to
  `padded_vocab_size` (zero rows; `to_hf` drops them). The output layer's padded rows give logits
  of 0 which enter the softmax: for logits exactly equal to the HF model's, build Megatron with an
  unpadded vocabulary (`--make-vocab-size-divisible-by 1`).
* Tied embeddings: the first stage holds `embedding.word_embeddings.weight`; with PP > 1 the
  last stage holds its copy as `output_layer.weight`.
* Norms and q/k norms are replicated; with the TE spec the pre-attention / pre-MLP norms are
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (pass `te_names=True`).
* PP: stage s holds global layers [s*L/pp, (s+1)*L/pp) as local `decoder.layers.0..`.
* MoE (Qwen3-MoE: every layer, no shared experts): `mlp.router.weight` = HF `mlp.gate.weight`
  (replicated); expert e lives on EP rank e // (E/ep) as local expert e % (E/ep), named
  `mlp.experts.local_experts.j.linear_fc{1,2}.weight` (SequentialMLP) or
  `mlp.experts.linear_fc{1,2}.weight{j}` (Transformer Engine's grouped MLP: `te_grouped=True`);
  fc1 = [gate; up] and fc2 = down, split over the expert-tensor-parallel ranks like the dense
  MLP's; `pre_mlp_layernorm` is a separate norm in both layer specs.
* Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5; dense MLPs): checkpoints_gdn.py.
* Nemotron-H (Megatron HybridModel: Mamba-2, attention, relu^2 MLP layers):
  checkpoints_nemotron.py.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from megatron_patches.models.checkpoints_base import (RankLayout, _cols, _megatron_layer_names,
                                                      _mlp_to_hf, _mlp_to_megatron, _qkv_groups,
                                                      _rows, _split_qkv, local_experts,
                                                      mlp_hf_names)
from megatron_patches.models.checkpoints_gdn import (gdn_hf_names, gdn_layer_to_hf,
                                                     gdn_layer_to_megatron)
from megatron_patches.models.checkpoints_nemotron import (NEMOTRON_TOP_NAMES, nemotron_hf_names,
                                                          nemotron_layer_to_hf,
                                                          nemotron_layer_to_megatron)
from megatron_patches.models.model_configs import ModelSpec

__all__ = ["RankLayout", "stage_layers", "to_megatron", "to_hf", "hf_names", "top_names",
           "local_experts"]

_GPT_TOP_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                  "head": "lm_head.weight", "final_norm": "decoder.final_layernorm.weight"}


def top_names(spec: ModelSpec) -> Dict[str, str]:
    """HF names of the embedding, final norm and head ("embed", "norm", "head") and Megatron's
    final norm ("final_norm": GPTModel's or, Nemotron-H, HybridModel's)."""
    return NEMOTRON_TOP_NAMES if spec.is_nemotron_h else _GPT_TOP_NAMES


def stage_layers(spec: ModelSpec, layout: RankLayout) -> range:
    """Global indices of the decoder layers on `layout`'s pipeline stage."""
    per_stage = spec.num_layers // layout.pp_size
    return range(layout.pp_rank * per_stage, (layout.pp_rank + 1) * per_stage)


def hf_names(spec: ModelSpec, layer: int, experts: Optional[Sequence[int]] = None
             ) -> Dict[str, str]:
    """Short name -> HF tensor name of one decoder layer (MoE: of `experts`, default all)."""
    if spec.is_gdn:
        return gdn_hf_names(spec, layer, experts)
    if spec.is_nemotron_h:
        return nemotron_hf_names(spec, layer)
    p = f"model.layers.{layer}"
    names = {"input_norm": f"{p}.input_layernorm.weight", "q": f"{p}.self_attn.q_proj.weight",
             "k": f"{p}.self_attn.k_proj.weight", "v": f"{p}.self_attn.v_proj.weight",
             "o": f"{p}.self_attn.o_proj.weight",
             "mlp_norm": f"{p}.post_attention_layernorm.weight", **mlp_hf_names(spec, p, experts)}
    if spec.qk_norm:
        names.update(q_norm=f"{p}.self_attn.q_norm.weight", k_norm=f"{p}.self_attn.k_norm.weight")
    return names


def _norm_to_megatron(spec: ModelSpec, w: torch.Tensor) -> torch.Tensor:
    """GDN hybrids' HF norms compute (1 + w): Megatron's weight is w + 1 (checkpoints_gdn.py)."""
    return w + 1.0 if spec.is_gdn else w


def _norm_to_hf(spec: ModelSpec, w: torch.Tensor) -> torch.Tensor:
    return w - 1.0 if spec.is_gdn else w


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _layer_to_megatron(spec, layout, hf, layer: int, local: int) -> Dict[str, torch.Tensor]:
    if spec.is_gdn:
        return gdn_layer_to_megatron(spec, layout, hf, layer, local)
    if spec.is_nemotron_h:
        return nemotron_layer_to_megatron(spec, layout, hf, layer, local)
    src = hf_names(spec, layer, local_experts(spec, layout) if spec.is_moe else None)
    dst = _megatron_layer_names(local, layout, spec.is_moe)
    qkv = _rows(_qkv_groups(spec, hf[src["q"]], hf[src["k"]], hf[src["v"]]), layout)
    out = {dst["qkv"]: qkv.reshape(-1, spec.hidden_size), dst["o"]: _cols(hf[src["o"]], layout),
           dst["input_norm"]: hf[src["input_norm"]], dst["mlp_norm"]: hf[src["mlp_norm"]],
           **_mlp_to_megatron(spec, layout, hf, src, dst, local)}
    if spec.qk_norm:
        out.update({dst["q_norm"]: hf[src["q_norm"]], dst["k_norm"]: hf[src["k_norm"]]})
    return out


def to_megatron(spec: ModelSpec, hf: Dict[str, torch.Tensor], layout: RankLayout
                ) -> Dict[str, torch.Tensor]:
    """This rank's Megatron tensors (parameter name -> tensor) from the HF state dict `hf`."""
    layout.check(spec)
    out: Dict[str, torch.Tensor] = {}
    first, last = layout.pp_rank == 0, layout.pp_rank == layout.pp_size - 1
    top = top_names(spec)
    if first:
        embed = _padded(hf[top["embed"]], layout.padded_vocab_size)
        out["embedding.word_embeddings.weight"] = _rows(embed, layout)
    for local, layer in enumerate(stage_layers(spec, layout)):
        out.update(_layer_to_megatron(spec, layout, hf, layer, local))
    if last:
        out[top["final_norm"]] = _norm_to_megatron(spec, hf[top["norm"]])
        head = hf[top["embed"] if spec.tie_word_embeddings else top["head"]]
        if not (spec.tie_word_embeddings and first):  # else the embedding is the output layer
            out["output_layer.weight"] = _rows(_padded(head, layout.padded_vocab_size), layout)
    return {name: t.contiguous() for name, t in out.items()}


def _layer_to_hf(spec, layouts, ranks, layer: int, local: int, experts=None
                 ) -> Dict[str, torch.Tensor]:
    if spec.is_gdn:
        return gdn_layer_to_hf(spec, layouts, ranks, layer, local, experts)
    if spec.is_nemotron_h:
        return nemotron_layer_to_hf(spec, layouts, ranks, layer, local)
    src = [_megatron_layer_names(local, lay, spec.is_moe) for lay in layouts]
    dst = hf_names(spec, layer)
    cat0 = lambda key: torch.cat([r[s[key]] for r, s in zip(ranks, src)], dim=0)  # noqa: E731
    cat1 = lambda key: torch.cat([r[s[key]] for r, s in zip(ranks, src)], dim=1)  # noqa: E731
    q, k, v = _split_qkv(spec, cat0("qkv"))
    out = {dst["q"]: q, dst["k"]: k, dst["v"]: v, dst["o"]: cat1("o"),
           dst["input_norm"]: ranks[0][src[0]["input_norm"]],
           dst["mlp_norm"]: ranks[0][src[0]["mlp_norm"]],
           **_mlp_to_hf(spec, layouts, ranks, src, dst, local, experts)}
    if spec.qk_norm:
        out.update({dst["q_norm"]: ranks[0][src[0]["q_norm"]],
                    dst["k_norm"]: ranks[0][src[0]["k_norm"]]})
    return out


def to_hf(spec: ModelSpec, ranks: Sequence[Sequence[Dict[str, torch.Tensor]]],
          layout: RankLayout, experts: Optional[Sequence] = None) -> Dict[str, torch.Tensor]:
    """The HF state dict from every rank's Megatron tensors, `ranks[pp_rank][tp_rank]`
    (`layout` gives the sizes, the padding and the names; its ranks are ignored). MoE: the
    expert tensors come from `experts[pp_rank][ep_rank][expert_tp_rank]` (rank dicts holding
    them; by default `ranks[pp][tp]` where EP=1 and expert TP = TP)."""
    if len(ranks) != layout.pp_size or any(len(stage) != layout.tp_size for stage in ranks):
        raise ValueError(f"to_hf needs ranks[pp][tp] for PP={layout.pp_size} x TP={layout.tp_size}")
    if spec.is_moe and experts is None:
        if layout.ep_size != 1 or layout.expert_tp_size != layout.tp_size:
            raise ValueError("to_hf of an MoE model with EP > 1 or expert TP != TP needs "
                             "experts[pp][ep][expert_tp]")
        experts = [[stage] for stage in ranks]
    out: Dict[str, torch.Tensor] = {}
    vocab, top = spec.vocab_size, top_names(spec)
    for pp_rank, stage in enumerate(ranks):
        layouts: List[RankLayout] = [dataclasses.replace(layout, tp_rank=t, pp_rank=pp_rank)
                                     for t in range(layout.tp_size)]
        layouts[0].check(spec)
        for local, layer in enumerate(stage_layers(spec, layouts[0])):
            out.update(_layer_to_hf(spec, layouts, stage, layer, local,
                                    experts[pp_rank] if spec.is_moe else None))
        if pp_rank == 0:
            out[top["embed"]] = torch.cat(
                [r["embedding.word_embeddings.weight"] for r in stage])[:vocab]
        if pp_rank == layout.pp_size - 1:
            out[top["norm"]] = _norm_to_hf(spec, stage[0][top["final_norm"]])
            if not spec.tie_word_embeddings:
                out[top["head"]] = torch.cat([r["output_layer.weight"] for r in stage])[:vocab]
    return {name: t.contiguous() for name, t in out.items()}
