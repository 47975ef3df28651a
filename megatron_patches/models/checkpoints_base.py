"""The pieces of the HF <-> Megatron checkpoint layouts that the GPT layers (checkpoints.py) and
the Gated DeltaNet hybrid layers (checkpoints_gdn.py) share: which part of the model a rank holds
(`RankLayout`), TP row / column blocks, and the MLP (SwiGLU; MoE router, experts and a gated
shared expert). Pure tensor code; the layouts are described in checkpoints.py.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from megatron_patches.models.model_configs import ModelSpec

__all__ = ["RankLayout", "local_experts", "mlp_hf_names"]


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
    ep_rank: int = 0
    ep_size: int = 1
    """Expert parallelism (MoE): EP rank r holds experts [r*E/ep, (r+1)*E/ep)."""
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    """Expert tensor parallelism (Megatron's expert_tensor_parallel_size: 1 or TP)."""
    te_grouped: bool = False
    """Transformer Engine grouped-MLP expert names (`linear_fc1.weight{j}`)."""

    def check(self, spec: ModelSpec) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size
                and 0 <= self.ep_rank < self.ep_size
                and 0 <= self.expert_tp_rank < self.expert_tp_size):
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
        if spec.is_gdn:
            problems += _gdn_problems(spec, self)
        if spec.is_nemotron_h:
            problems += [f"{n}={getattr(spec, n)} is not divisible by TP={self.tp_size}"
                         for n in ("mamba_num_heads", "mamba_num_groups")
                         if getattr(spec, n) % self.tp_size]
        if spec.is_moe:
            problems += _moe_problems(spec, self)
        elif self.ep_size > 1:
            problems.append(f"EP={self.ep_size} needs an MoE model")
        if problems:
            raise ValueError("cannot convert: " + "; ".join(problems))


def _moe_problems(spec: ModelSpec, layout: RankLayout) -> List[str]:
    problems = []
    if spec.num_experts % layout.ep_size:
        problems.append(f"num_experts={spec.num_experts} is not divisible by EP={layout.ep_size}")
    if spec.moe_ffn_hidden_size % layout.expert_tp_size:
        problems.append(f"moe_intermediate_size={spec.moe_ffn_hidden_size} is not divisible by "
                        f"expert TP={layout.expert_tp_size}")
    return problems


def _gdn_problems(spec: ModelSpec, layout: RankLayout) -> List[str]:
    problems = [f"{n}={getattr(spec, n)} is not divisible by TP={layout.tp_size}"
                for n in ("linear_num_key_heads", "linear_num_value_heads")
                if getattr(spec, n) % layout.tp_size]
    return problems


def local_experts(spec: ModelSpec, layout: RankLayout) -> range:
    """Global indices of the experts on `layout`'s expert-parallel rank."""
    per_rank = spec.num_experts // layout.ep_size
    return range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank)


def mlp_hf_names(spec: ModelSpec, p: str, experts: Optional[Sequence[int]] = None
                 ) -> Dict[str, str]:
    """Short name -> HF name of the MLP of layer prefix `p`: SwiGLU, or router + experts (of
    `experts`, default all) + the sigmoid-gated shared expert where the spec has one."""
    if not spec.is_moe:
        return {"gate": f"{p}.mlp.gate_proj.weight", "up": f"{p}.mlp.up_proj.weight",
                "down": f"{p}.mlp.down_proj.weight"}
    names = {"router": f"{p}.mlp.gate.weight"}
    for e in range(spec.num_experts) if experts is None else experts:
        names.update({f"gate.{e}": f"{p}.mlp.experts.{e}.gate_proj.weight",
                      f"up.{e}": f"{p}.mlp.experts.{e}.up_proj.weight",
                      f"down.{e}": f"{p}.mlp.experts.{e}.down_proj.weight"})
    if spec.moe_shared_expert_intermediate_size:
        names.update({f"shared.{k}": f"{p}.mlp.shared_expert.{k}_proj.weight"
                      for k in ("gate", "up", "down")},
                     shared_gate=f"{p}.mlp.shared_expert_gate.weight")
    return names


def _megatron_layer_names(local: int, layout: RankLayout, moe: bool = False) -> Dict[str, str]:
    p = f"decoder.layers.{local}"
    attn_norm = (f"{p}.self_attention.linear_qkv.layer_norm_weight" if layout.te_names
                 else f"{p}.input_layernorm.weight")
    mlp_norm = (f"{p}.mlp.linear_fc1.layer_norm_weight" if layout.te_names and not moe
                else f"{p}.pre_mlp_layernorm.weight")
    return {"input_norm": attn_norm, "mlp_norm": mlp_norm,
            "qkv": f"{p}.self_attention.linear_qkv.weight",
            "o": f"{p}.self_attention.linear_proj.weight",
            "q_norm": f"{p}.self_attention.q_layernorm.weight",
            "k_norm": f"{p}.self_attention.k_layernorm.weight",
            "fc1": f"{p}.mlp.linear_fc1.weight", "fc2": f"{p}.mlp.linear_fc2.weight",
            "router": f"{p}.mlp.router.weight",
            "shared_fc1": f"{p}.mlp.shared_experts.linear_fc1.weight",
            "shared_fc2": f"{p}.mlp.shared_experts.linear_fc2.weight",
            "shared_gate": f"{p}.mlp.shared_experts.gate_weight"}


def _expert_name(local: int, layout: RankLayout, j: int, fc: int) -> str:
    """Megatron's name of local expert j's linear_fc{fc} weight on decoder layer `local`."""
    p = f"decoder.layers.{local}.mlp.experts"
    if layout.te_grouped:
        return f"{p}.linear_fc{fc}.weight{j}"
    return f"{p}.local_experts.{j}.linear_fc{fc}.weight"


def _rows(t: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=0)[layout.tp_rank]


def _cols(t: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    return t.chunk(layout.tp_size, dim=1)[layout.tp_rank]


def _qkv_groups(spec: ModelSpec, q, k, v) -> torch.Tensor:
    """[G, (q heads per group + 2) * d, hidden]: per group [its q heads; k; v]."""
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    return torch.cat([q.reshape(g, per * d, -1), k.reshape(g, d, -1), v.reshape(g, d, -1)], dim=1)


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor):
    g, d = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // g
    grouped = qkv.reshape(g, (per + 2) * d, -1)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, q.shape[-1]), k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1])


def _expert_layout(layout: RankLayout) -> RankLayout:
    """The layout experts are split by: expert TP in place of TP."""
    return dataclasses.replace(layout, tp_rank=layout.expert_tp_rank,
                               tp_size=layout.expert_tp_size)


def _mlp_to_megatron(spec, layout, hf, src, dst, local: int) -> Dict[str, torch.Tensor]:
    if not spec.is_moe:
        return {dst["fc1"]: torch.cat([_rows(hf[src["gate"]], layout),
                                       _rows(hf[src["up"]], layout)]),
                dst["fc2"]: _cols(hf[src["down"]], layout)}
    out = {dst["router"]: hf[src["router"]]}
    ex = _expert_layout(layout)
    for j, e in enumerate(local_experts(spec, layout)):
        out[_expert_name(local, layout, j, 1)] = torch.cat(
            [_rows(hf[src[f"gate.{e}"]], ex), _rows(hf[src[f"up.{e}"]], ex)])
        out[_expert_name(local, layout, j, 2)] = _cols(hf[src[f"down.{e}"]], ex)
    if spec.moe_shared_expert_intermediate_size:  # a dense MLP split over TP, gate replicated
        out.update({dst["shared_fc1"]: torch.cat([_rows(hf[src["shared.gate"]], layout),
                                                  _rows(hf[src["shared.up"]], layout)]),
                    dst["shared_fc2"]: _cols(hf[src["shared.down"]], layout),
                    dst["shared_gate"]: hf[src["shared_gate"]]})
    return out


def _mlp_to_hf(spec, layouts, ranks, src, dst, local: int, experts) -> Dict[str, torch.Tensor]:
    """HF MLP tensors of one layer from one stage's TP ranks (MoE experts: `experts`)."""
    get = lambda key: [r[s[key]] for r, s in zip(ranks, src)]  # noqa: E731
    out = {}
    if not spec.is_moe:
        out[dst["gate"]], out[dst["up"]], out[dst["down"]] = _swiglu_to_hf(get("fc1"), get("fc2"))
        return out
    out[dst["router"]] = get("router")[0]
    out.update(_experts_to_hf(spec, layouts[0], experts, dst, local))
    if spec.moe_shared_expert_intermediate_size:
        (out[dst["shared.gate"]], out[dst["shared.up"]],
         out[dst["shared.down"]]) = _swiglu_to_hf(get("shared_fc1"), get("shared_fc2"))
        out[dst["shared_gate"]] = get("shared_gate")[0]
    return out


def _swiglu_to_hf(fc1: List[torch.Tensor], fc2: List[torch.Tensor]):
    """(gate, up, down) from the TP shards of fc1 = [gate; up] and fc2."""
    halves = [f.chunk(2, dim=0) for f in fc1]
    return (torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]),
            torch.cat(fc2, dim=1))


def _experts_to_hf(spec, layout, experts, dst, local: int) -> Dict[str, torch.Tensor]:
    """HF expert tensors of one layer from `experts[ep][etp]` (this stage's ranks)."""
    out = {}
    for ep_rank, shards in enumerate(experts):
        lay = dataclasses.replace(layout, ep_rank=ep_rank)
        for j, e in enumerate(local_experts(spec, lay)):
            gate, up, down = _swiglu_to_hf([r[_expert_name(local, lay, j, 1)] for r in shards],
                                           [r[_expert_name(local, lay, j, 2)] for r in shards])
            out.update({dst[f"gate.{e}"]: gate, dst[f"up.{e}"]: up, dst[f"down.{e}"]: down})
    return out
