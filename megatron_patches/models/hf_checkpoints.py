"""Load a Hugging Face Llama 3 / Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 checkpoint into a
(TP x PP x EP sharded) Megatron GPTModel, or a Nemotron-H one into a HybridModel, and write one
back; the tensor layouts are megatron_patches/models/checkpoints.py's (GDN hybrids:
checkpoints_gdn.py's, Nemotron-H: checkpoints_nemotron.py's).

    spec, config = read_hf_config(directory)
    load_hf_weights(model, directory)          # on every rank, after the model is built
    export_hf_weights([model], out_dir, config) # collective: every rank calls it; rank 0 writes
    export_hf_weights([model], out_dir, config, source=directory)  # the whole checkpoint back

A checkpoint directory is HF's `save_pretrained` layout: config.json and model.safetensors or
model.safetensors.index.json with its shards. Each rank reads only the tensors its stage needs.
Every parameter of the model must receive a tensor of its exact shape, else ValueError (nothing is
left at its random initialisation). A Qwen3.5 VLM checkpoint (Qwen3_5ForConditionalGeneration)
is read as its language model: `model.language_model.*` as `model.*`; the tensors no parameter
takes (a VLM's vision tower, multi-token-prediction `mtp.*` layers: MTP is not trained with
prefix reuse) are listed by `untrained_tensors`. An export writes the text model
(Qwen3_5ForCausalLM); with `source=` (the checkpoint loaded, as the entry point passes it) it
writes that checkpoint back whole instead: its config.json, the trained tensors under its own
names (a VLM's `model.language_model.*`), every untrained tensor copied unchanged, so an
inference engine loads the same architecture it was given (tests/test_hf_checkpoints_gdn.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import torch

from megatron_patches.models.checkpoints import (RankLayout, hf_names, local_experts, stage_layers,
                                                 to_hf, to_megatron, top_names)
from megatron_patches.models.model_configs import ModelSpec, from_hf_config
from megatron_patches.models.model_configs_hybrid import HYBRID_ARCH, unwrap_text_config

__all__ = ["read_hf_config", "hf_tensor_names", "read_hf_tensors", "rank_layout", "load_hf_weights",
           "export_hf_weights", "untrained_tensors", "write_hf_checkpoint"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(directory) -> Tuple[ModelSpec, dict]:
    """(ModelSpec, config.json as a dict) of a HF checkpoint directory."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json (give a Hugging Face checkpoint directory)")
    config = json.loads(path.read_text())
    return from_hf_config(config, name=Path(directory).name), config


_VLM_TEXT = "model.language_model."


def _shards(directory: Path) -> Dict[str, Tuple[Path, str]]:
    """tensor name (a VLM's language-model tensors as the text model's) -> (the safetensors
    file holding it, its name there)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        stored = {name: directory / file for name, file in weight_map.items()}
    else:
        single = directory / "model.safetensors"
        if not single.is_file():
            raise ValueError(f"{directory}: neither model.safetensors nor model.safetensors."
                             "index.json (only safetensors checkpoints are read)")
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            stored = {name: single for name in f.keys()}
    return {("model." + n[len(_VLM_TEXT):] if n.startswith(_VLM_TEXT) else n): (file, n)
            for n, file in stored.items()}


def hf_tensor_names(directory) -> List[str]:
    """Every tensor name of a HF checkpoint directory."""
    return sorted(_shards(Path(directory)))


def read_hf_tensors(directory, names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The named tensors of a HF checkpoint (fp32 copies); ValueError naming missing ones."""
    from safetensors import safe_open

    directory = Path(directory)
    where = _shards(directory)
    names = list(names)
    missing = [n for n in names if n not in where]
    if missing:
        raise ValueError(f"{directory}: missing tensors {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}")
    out: Dict[str, torch.Tensor] = {}
    for file in sorted({where[n][0] for n in names}):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if where[name][0] == file:
                    out[name] = f.get_tensor(where[name][1]).float()
    return out


def untrained_tensors(directory) -> Dict[str, List[str]]:
    """The checkpoint's tensors no parameter of its model takes, by kind ("mtp.*",
    "model.visual.*", or the name's first two parts): their stored names."""
    directory = Path(directory)
    spec, _ = read_hf_config(directory)
    whole = RankLayout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, padded_vocab_size=spec.vocab_size)
    trained = set(_needed_names(spec, whole))
    out: Dict[str, List[str]] = {}
    for name, (_, stored) in sorted(_shards(directory).items()):
        if name not in trained:
            kind = "mtp.*" if stored.startswith("mtp.") else ".".join(stored.split(".")[:2]) + ".*"
            out.setdefault(kind, []).append(stored)
    return out


def rank_layout(model) -> RankLayout:
    """This rank's RankLayout for a built GPTModel or HybridModel (parallel state + the
    model's names/shapes)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    names = dict(model.named_parameters())
    vocab_rows = next(p.shape[0] for n, p in names.items()
                      if n in ("embedding.word_embeddings.weight", "output_layer.weight"))
    return RankLayout(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                      pp_rank=ps.get_pipeline_model_parallel_rank(),
                      pp_size=ps.get_pipeline_model_parallel_world_size(),
                      padded_vocab_size=vocab_rows * tp,
                      te_names=any(n.endswith(("linear_qkv.layer_norm_weight",
                                               "in_proj.layer_norm_weight")) for n in names),
                      ep_rank=ps.get_expert_model_parallel_rank(),
                      ep_size=ps.get_expert_model_parallel_world_size(),
                      expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
                      expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
                      te_grouped=any(".experts.linear_fc1.weight" in n for n in names))


def _needed_names(spec: ModelSpec, layout: RankLayout) -> List[str]:
    experts = local_experts(spec, layout) if spec.is_moe else None
    names = [n for layer in stage_layers(spec, layout)
             for n in hf_names(spec, layer, experts).values()]
    top = top_names(spec)
    if layout.pp_rank == 0:
        names.append(top["embed"])
    if layout.pp_rank == layout.pp_size - 1:
        names.append(top["norm"])
        names.append(top["embed"] if spec.tie_word_embeddings else top["head"])
    return sorted(set(names))


def load_hf_weights(model, directory) -> ModelSpec:
    """Copy the HF checkpoint's weights into this rank's part of `model` (a GPTModel or, for
    Nemotron-H, a HybridModel, or a DDP/Float16Module wrapper of one); returns the checkpoint's
    ModelSpec."""
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    spec, _ = read_hf_config(directory)
    layout = rank_layout(gpt)
    tensors = to_megatron(spec, read_hf_tensors(directory, _needed_names(spec, layout)), layout)
    params = dict(gpt.named_parameters())
    problems = [f"{n}: model has no such parameter" for n in tensors if n not in params]
    problems += [f"{n}: not in the checkpoint" for n in params if n not in tensors]
    problems += [f"{n}: checkpoint {tuple(t.shape)} vs model {tuple(params[n].shape)}"
                 for n, t in tensors.items() if n in params and t.shape != params[n].shape]
    if problems:
        raise ValueError(f"{directory} does not fit this model: " + "; ".join(problems[:6]))
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
    return spec


def write_hf_checkpoint(directory, tensors: Dict[str, torch.Tensor], config: dict,
                        unchanged: Dict[str, torch.Tensor] | None = None) -> None:
    """config.json + model.safetensors: `tensors` in the checkpoint's dtype (config's
    torch_dtype/dtype, a VLM's text_config's), `unchanged` as they are."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    text = unwrap_text_config(config)
    dtype = _DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")
                            or text.get("torch_dtype") or text.get("dtype") or "float32"),
                        torch.float32)
    out = {n: t.to(dtype).contiguous() for n, t in tensors.items()}
    out.update({n: t.contiguous() for n, t in (unchanged or {}).items()})
    save_file(out, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    Path(directory, "config.json").write_text(json.dumps(config, indent=2))


def export_hf_weights(models, directory, config: dict, source=None) -> None:
    """Gather every rank's tensors on global rank 0 and write a HF checkpoint there. Collective
    over the default group (all ranks call it); data-parallel replicas beyond the first are
    skipped (MoE: expert tensors come from the first expert-data-parallel replica of each
    expert-parallel rank). Holds the whole model in rank 0's host memory. `source`: the HF
    checkpoint the model was loaded from, written back whole (module docstring)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    text = unwrap_text_config(config)
    if text is not config:  # a Qwen3.5 VLM's config: the text model is what is written
        config = {**text, "architectures": [HYBRID_ARCH[text["model_type"]]]}
    spec = from_hf_config(config)
    gpt = unwrap_model(models[0])
    layout = rank_layout(gpt)
    send_dense = ps.get_data_parallel_rank() == 0
    send_experts = ps.get_expert_data_parallel_rank() == 0
    params = {n: p for n, p in gpt.named_parameters()
              if (send_experts if ".experts." in n else send_dense)}  # host copies: what we send
    dense = {n: p.detach().float().cpu() for n, p in params.items() if ".experts." not in n}
    experts = {n: p.detach().float().cpu() for n, p in params.items() if ".experts." in n}
    has_experts = any(".experts." in n for n, _ in gpt.named_parameters())
    local = ((layout.pp_rank, layout.tp_rank, dense) if send_dense else None,
             (layout.pp_rank, layout.ep_rank, layout.expert_tp_rank, experts)
             if has_experts and send_experts else None)
    rank0 = torch.distributed.get_rank() == 0
    gathered = [None] * torch.distributed.get_world_size() if rank0 else None
    torch.distributed.gather_object(local, gathered, dst=0)
    if not rank0:
        return
    grid = [[None] * layout.tp_size for _ in range(layout.pp_size)]
    expert_grid = [[[None] * layout.expert_tp_size for _ in range(layout.ep_size)]
                   for _ in range(layout.pp_size)]
    for dense_part, expert_part in gathered:
        if dense_part is not None:
            grid[dense_part[0]][dense_part[1]] = dense_part[2]
        if expert_part is not None:
            expert_grid[expert_part[0]][expert_part[1]][expert_part[2]] = expert_part[3]
    tensors = to_hf(spec, grid, layout, expert_grid if spec.is_moe else None)
    if source is None:
        write_hf_checkpoint(directory, tensors, config)
        return
    where = _shards(Path(source))
    if set(tensors) - set(where):
        raise ValueError(f"export source {source} lacks {sorted(set(tensors) - set(where))[:3]}: "
                         "give the checkpoint this model was loaded from")
    from safetensors import safe_open

    files = {stored: file for file, stored in where.values()}
    untrained = sorted(n for names in untrained_tensors(source).values() for n in names)
    top = top_names(spec)
    if spec.tie_word_embeddings and top["head"] in where:  # stored although tied: the trained one
        tensors[top["head"]] = tensors[top["embed"]]
        untrained.remove(where[top["head"]][1])
    unchanged = {}
    for stored in untrained:
        with safe_open(str(files[stored]), framework="pt") as f:
            unchanged[stored] = f.get_tensor(stored)
    write_hf_checkpoint(directory, {where[n][1]: t for n, t in tensors.items()},
                        json.loads((Path(source) / "config.json").read_text()), unchanged)
