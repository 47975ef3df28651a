"""Hugging Face Nemotron-H checkpoints (`NemotronHForCausalLM`, `backbone.*` names) <-> Megatron
HybridModels (megatron_patches/models/checkpoints_nemotron.py through hf_checkpoints.py), the
`nemotron-h-8b-tiny` twin (pattern M-M*M-: Mamba-2, relu^2 MLP, attention without positions).

* Round trip: a checkpoint written by transformers (weights at bf16 values, norms away from their
  init) -> Megatron tensors of every rank at TP x PP in {1, 2}^2 -> HF tensors: the same names
  and bit-identical tensors (at TP=2 each rank really holds half of the Mamba in_proj rows).
* Logits: our HybridModel (Megatron's MambaMixer on the CPU layer's torch kernels, local
  attention and MLP modules) loaded with `load_hf_weights` gives transformers' logits (both
  float64 with their fp32 up-casts kept in float64, 90 tokens across 16-token scan chunks:
  within 1e-5 of max|logit|), with HF's dt clamp at `time_step_min` checked inactive;
  `export_hf_weights` writes back bit-identical tensors, which transformers loads.
* Megatron names that the arguments do not build are refused by name (`load_hf_weights`).
"""

import dataclasses
import json

import pytest
import torch

from megatron_patches.models.model_configs import MODELS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

SPEC = MODELS["nemotron-h-8b-tiny"]
CHUNK = 16


def hf_model(spec, seed: int = 0):
    """A random transformers Nemotron-H of `spec`: norms away from their init, decays a trained
    model has (tests/test_gdn.py::weak_decay), every value a bf16 value (as real checkpoints)."""
    c = {k: v for k, v in spec.hf_config().items() if k != "model_type"}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(spec.family, **c))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
            elif name.endswith("dt_bias"):
                p.uniform_(-4.0, -2.0)
            elif name.endswith(".D"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / SPEC.name
    hf_model(SPEC).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(checkpoint, tp, pp):
    from megatron_patches.models.checkpoints import RankLayout, to_hf, to_megatron
    from megatron_patches.models.hf_checkpoints import (hf_tensor_names, read_hf_config,
                                                        read_hf_tensors)

    spec, _ = read_hf_config(checkpoint)
    assert dataclasses.replace(spec, name=SPEC.name) == SPEC
    hf = read_hf_tensors(checkpoint, hf_tensor_names(checkpoint))
    assert "backbone.layers.0.mixer.in_proj.weight" in hf  # the published names
    layout = RankLayout(tp_size=tp, pp_size=pp, padded_vocab_size=spec.vocab_size)
    ranks = [[to_megatron(spec, hf, dataclasses.replace(layout, tp_rank=t, pp_rank=s))
              for t in range(tp)] for s in range(pp)]
    if tp == 2:  # really split: each rank holds half of the Mamba heads' in_proj rows
        in_proj = ranks[0][0]["decoder.layers.0.mixer.in_proj.weight"]
        assert 2 * in_proj.shape[0] == hf["backbone.layers.0.mixer.in_proj.weight"].shape[0]
    back = to_hf(spec, ranks, layout)
    assert back.keys() == hf.keys(), sorted(set(back) ^ set(hf))
    different = [n for n in hf if not torch.equal(back[n], hf[n])]
    assert not different, different[:5]


def megatron_model(spec, dtype=torch.float64):
    """Our HybridModel of Nemotron-H `spec` (the arguments megatron_args() gives: relu^2 MLPs,
    no positional embedding, the Mamba sizes), on this process's parallel state."""
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron.core.activations import squared_relu

    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                          max_seq_len=256, params_dtype=dtype, kv_channels=spec.head_dim,
                          layernorm_epsilon=spec.rms_norm_eps)
    return build_hybrid_model(cfg, spec.hybrid_layer_pattern, position_embedding_type="none",
                              gated_linear_unit=False, activation_func=squared_relu,
                              mamba_num_heads=spec.mamba_num_heads,
                              mamba_head_dim=spec.mamba_head_dim,
                              mamba_state_dim=spec.mamba_state_dim,
                              mamba_num_groups=spec.mamba_num_groups)


def _dt_above_clamp(hf):
    """Forward hooks recording, per Mamba mixer, min softplus(dt + dt_bias) (HF clamps it below
    at time_step_min; Megatron's training kernel does not)."""
    seen = []

    def hook(mixer):
        def record(_module, _inputs, out):
            dt = out[..., -mixer.num_heads:] + mixer.dt_bias
            seen.append(torch.nn.functional.softplus(dt).min().item())
        return record

    for block in hf.model.layers:
        if block.block_type == "linear_attention":
            block.mixer.chunk_size = CHUNK
            block.mixer.in_proj.register_forward_hook(hook(block.mixer))
    return seen


def test_loaded_model_gives_transformers_logits_and_exports_the_same_tensors(
        checkpoint, megatron_env, tmp_path):
    from megatron_patches.models.hf_checkpoints import (export_hf_weights, hf_tensor_names,
                                                        load_hf_weights, read_hf_tensors)
    from test_mamba_hf import _float64_upcasts

    model = megatron_model(SPEC)
    assert load_hf_weights(model, checkpoint) == dataclasses.replace(SPEC,
                                                                     name=checkpoint.name)
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.chunk_size = CHUNK
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).to(torch.float64)
    dts = _dt_above_clamp(theirs_model)
    tokens = torch.randint(0, SPEC.vocab_size, (90,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), _float64_upcasts():
        ours = model(tokens[None], torch.arange(90)[None], None)[0]
        theirs = theirs_model(input_ids=tokens[None], use_cache=False).logits[0]
    assert len(dts) == SPEC.hybrid_layer_pattern.count("M")
    assert min(dts) > theirs_model.config.time_step_min  # HF's clamp changes nothing here
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all()
    print("nemotron logits: max|ours - theirs| / max|logit| =",
          ((ours - theirs).abs().max() / theirs.abs().max()).item())
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    config = json.loads((checkpoint / "config.json").read_text())
    export_hf_weights([model], tmp_path / "export", config)
    names = hf_tensor_names(checkpoint)
    assert hf_tensor_names(tmp_path / "export") == names
    a, b = read_hf_tensors(checkpoint, names), read_hf_tensors(tmp_path / "export", names)
    assert all(torch.equal(a[n], b[n]) for n in names)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # loads


def test_a_model_of_another_pattern_is_refused_by_name(checkpoint, megatron_env):
    from megatron_patches.models.hf_checkpoints import load_hf_weights

    other = dataclasses.replace(SPEC, hybrid_layer_pattern="M-*MM-")
    with pytest.raises(ValueError, match="does not fit this model: .*model has no such parameter"):
        load_hf_weights(megatron_model(other), checkpoint)
