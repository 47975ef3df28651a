"""Hugging Face Llama 3 / Qwen3 weights <-> Megatron GPTModel weights, for any TP x PP split.

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
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch

from megatron_patches.model_configs import ModelSpec

__all__ = ["RankLayout", "stage_layers", "to_megatron", "to_hf", "hf_names"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Which part of the model one rank holds."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    padded_vocab_size: int
    """Megatron's (padded) vocabulary: >= the checkpoint's vocab_size, a multiple of tp_size."""
    te_names: bool = False
    """Transformer Engine spec names for the fused pre-attention / pre-MLP norms."""

    def check(self, spec: ModelSpec) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"{self}: ranks must be within their sizes")
        problems = []
        if spec.num_query_groups % self.tp_size:
            problems.append(f"num_key_value_heads={spec.num_query_groups} is not divisible by "
                            f"TP={self.tp_size}")
        if spec.ffn_hidden_size % self.tp_size:
            problems.append(f"intermediate_size={spec.ffn_hidden_size} is not divisible by TP")
        if spec.num_layers % self.pp_size:
            problems.append(f"{spec.num_layers} layers do not split evenly over PP={self.pp_size}")
        if self.padded_vocab_size < spec.vocab_size or self.padded_vocab_size % self.tp_size:
            problems.append(f"padded_vocab_size={self.padded_vocab_size} must be >= "
                            f"vocab_size={spec.vocab_size} and a multiple of TP")
        if spec.is_moe:
            problems.append("MoE checkpoints are not converted yet")
        if problems:
            raise ValueError("cannot convert: " + "; ".join(problems))



def stage_layers(spec: ModelSpec, layout: RankLayout) -> range:
    """Global indices of the decoder layers on `layout`'s pipeline stage."""
    per_stage = spec.num_layers // layout.pp_size
    return range(layout.pp_rank * per_stage, (layout.pp_rank + 1) * per_stage)


def hf_names(spec: ModelSpec, layer: int) -> Dict[str, str]:
    """Short name -> HF tensor name of one decoder layer."""
    p = f"model.layers.{layer}"
    names = {"input_norm": f"{p}.input_layernorm.weight", "q": f"{p}.self_attn.q_proj.weight",
             "k": f"{p}.self_attn.k_proj.weight", "v": f"{p}.self_attn.v_proj.weight",
             "o": f"{p}.self_attn.o_proj.weight",
             "mlp_norm": f"{p}.post_attention_layernorm.weight",
             "gate": f"{p}.mlp.gate_proj.weight", "up": f"{p}.mlp.up_proj.weight",
             "down": f"{p}.mlp.down_proj.weight"}
    if spec.qk_norm:
        names.update(q_norm=f"{p}.self_attn.q_norm.weight", k_norm=f"{p}.self_attn.k_norm.weight")
    return names


def _megatron_layer_names(local: int, layout: RankLayout) -> Dict[str, str]:
    p = f"decoder.layers.{local}"
    attn_norm = (f"{p}.self_attention.linear_qkv.layer_norm_weight" if layout.te_names
                 else f"{p}.input_layernorm.weight")
    mlp_norm = (f"{p}.mlp.linear_fc1.layer_norm_weight" if layout.te_names
                else f"{p}.pre_mlp_layernorm.weight")
    return {"input_norm": attn_norm, "mlp_norm": mlp_norm,
            "qkv": f"{p}.self_attention.linear_qkv.weight",
            "o": f"{p}.self_attention.linear_proj.weight",
            "q_norm": f"{p}.self_attention.q_layernorm.weight",
            "k_norm": f"{p}.self_attention.k_layernorm.weight",
            "fc1": f"{p}.mlp.linear_fc1.weight", "fc2": f"{p}.mlp.linear_fc2.weight"}


def _qkv_groups(spec: ModelSpec, q, k, v) -> torch.Tensor:
    """[G, (q heads per group + 2) * d, hidden]: per group [its q heads; k; v]."""
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    return torch.cat([q.reshape(g, per * d, -1), k.reshape(g, d, -1), v.reshape(g, d, -1)], dim=1)


def _rows(t: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=0)[layout.tp_rank]


def _cols(t: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=1)[layout.tp_rank]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _layer_to_megatron(spec, layout, hf, layer: int, local: int) -> Dict[str, torch.Tensor]:
    src, dst = hf_names(spec, layer), _megatron_layer_names(local, layout)
    qkv = _rows(_qkv_groups(spec, hf[src["q"]], hf[src["k"]], hf[src["v"]]), layout)
    out = {dst["qkv"]: qkv.reshape(-1, spec.hidden_size), dst["o"]: _cols(hf[src["o"]], layout),
           dst["input_norm"]: hf[src["input_norm"]], dst["mlp_norm"]: hf[src["mlp_norm"]],
           dst["fc1"]: torch.cat([_rows(hf[src["gate"]], layout), _rows(hf[src["up"]], layout)]),
           dst["fc2"]: _cols(hf[src["down"]], layout)}
    if spec.qk_norm:
        out.update({dst["q_norm"]: hf[src["q_norm"]], dst["k_norm"]: hf[src["k_norm"]]})
    return out


def to_megatron(spec: ModelSpec, hf: Dict[str, torch.Tensor], layout: RankLayout
                ) -> Dict[str, torch.Tensor]:
    """This rank's Megatron tensors (parameter name -> tensor) from the HF state dict `hf`."""
    layout.check(spec)
    out: Dict[str, torch.Tensor] = {}
    first, last = layout.pp_rank == 0, layout.pp_rank == layout.pp_size - 1
    if first:
        embed = _padded(hf["model.embed_tokens.weight"], layout.padded_vocab_size)
        out["embedding.word_embeddings.weight"] = _rows(embed, layout)
    for local, layer in enumerate(stage_layers(spec, layout)):
        out.update(_layer_to_megatron(spec, layout, hf, layer, local))
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        head = hf["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
        if not (spec.tie_word_embeddings and first):  # else the embedding is the output layer
            out["output_layer.weight"] = _rows(_padded(head, layout.padded_vocab_size), layout)
    return {name: t.contiguous() for name, t in out.items()}


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor):
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    grouped = qkv.reshape(g, (per + 2) * d, -1)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1])


def _layer_to_hf(spec, layouts, ranks, layer: int, local: int) -> Dict[str, torch.Tensor]:
    src = [_megatron_layer_names(local, lay) for lay in layouts]
    dst = hf_names(spec, layer)
    cat0 = lambda key: torch.cat([r[s[key]] for r, s in zip(ranks, src)], dim=0)  # noqa: E731
    cat1 = lambda key: torch.cat([r[s[key]] for r, s in zip(ranks, src)], dim=1)  # noqa: E731
    q, k, v = _split_qkv(spec, cat0("qkv"))
    fc1 = [r[s["fc1"]].chunk(2, dim=0) for r, s in zip(ranks, src)]
    out = {dst["q"]: q, dst["k"]: k, dst["v"]: v, dst["o"]: cat1("o"),
           dst["input_norm"]: ranks[0][src[0]["input_norm"]],
           dst["mlp_norm"]: ranks[0][src[0]["mlp_norm"]],
           dst["gate"]: torch.cat([f[0] for f in fc1]), dst["up"]: torch.cat([f[1] for f in fc1]),
           dst["down"]: cat1("fc2")}
    if spec.qk_norm:
        out.update({dst["q_norm"]: ranks[0][src[0]["q_norm"]],
                    dst["k_norm"]: ranks[0][src[0]["k_norm"]]})
    return out


def to_hf(spec: ModelSpec, ranks: Sequence[Sequence[Dict[str, torch.Tensor]]],
          layout: RankLayout) -> Dict[str, torch.Tensor]:
    """The HF state dict from every rank's Megatron tensors, `ranks[pp_rank][tp_rank]`
    (`layout` gives the sizes, the padding and the names; its ranks are ignored)."""
    if len(ranks) != layout.pp_size or any(len(stage) != layout.tp_size for stage in ranks):
        raise ValueError(f"to_hf needs ranks[pp][tp] for PP={layout.pp_size} x TP={layout.tp_size}")
    out: Dict[str, torch.Tensor] = {}
    vocab = spec.vocab_size
    for pp_rank, stage in enumerate(ranks):
        layouts: List[RankLayout] = [dataclasses.replace(layout, tp_rank=t, pp_rank=pp_rank)
                                     for t in range(layout.tp_size)]
        layouts[0].check(spec)
        for local, layer in enumerate(stage_layers(spec, layouts[0])):
            out.update(_layer_to_hf(spec, layouts, stage, layer, local))
        if pp_rank == 0:
            out["model.embed_tokens.weight"] = torch.cat(
                [r["embedding.word_embeddings.weight"] for r in stage])[:vocab]
        if pp_rank == layout.pp_size - 1:
            out["model.norm.weight"] = stage[0]["decoder.final_layernorm.weight"]
            if not spec.tie_word_embeddings:
                out["lm_head.weight"] = torch.cat([r["output_layer.weight"] for r in stage])[:vocab]
    return {name: t.contiguous() for name, t in out.items()}
