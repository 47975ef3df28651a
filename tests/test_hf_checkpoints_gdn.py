"""Hugging Face checkpoints of the Gated DeltaNet hybrids (megatron_patches/models/
checkpoints_gdn.py through hf_checkpoints.py), the tiny twins' shapes: Qwen3.5
(`Qwen3_5ForCausalLM`: separate in_proj_qkv / z / b / a), Qwen3-Next with dense MLPs
(`Qwen3NextForCausalLM`: per-key-head interleaved in_proj_qkvz / in_proj_ba), and the MoE
hybrids Qwen3.5-MoE and Qwen3-Next (router, experts, sigmoid-gated shared expert; at TP=2 with
expert TP = TP).

* Round trip: a checkpoint written by transformers (weights at bf16 values, norms away from
  their init) -> Megatron tensors of every rank at TP x PP in {1, 2}^2 -> HF tensors: the same
  names and bit-identical tensors.
* Logits: our GDN GPTModel loaded from that checkpoint with `load_hf_weights` gives the
  transformers model's logits (both float64 with fp32 internals: within 1e-5 of max|logit|);
  `export_hf_weights` writes back bit-identical tensors, which transformers loads.
* A Qwen3.5 VLM-style checkpoint (`model.language_model.*` names, the config under
  text_config) is read as its text model.
"""

import dataclasses
import json

import pytest
import torch

from megatron_patches.models.model_configs import MODELS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

QWEN35 = MODELS["qwen3.5-27b-tiny"]
QWEN3_NEXT_DENSE = dataclasses.replace(  # Qwen3-Next's layout with num_experts=0 (dense MLPs)
    MODELS["qwen3-next-80b-a3b-tiny"], name="qwen3-next-dense-tiny", num_experts=None,
    moe_ffn_hidden_size=None, moe_router_topk=None, moe_shared_expert_intermediate_size=None)
SPECS = {"qwen3.5": QWEN35, "qwen3-next": QWEN3_NEXT_DENSE,
         "qwen3.5-moe": MODELS["qwen3.5-35b-a3b-tiny"],
         "qwen3-next-moe": MODELS["qwen3-next-80b-a3b-tiny"]}


def hf_model(spec, seed: int = 0):
    """A random transformers model of `spec`: norms away from their init, decays a trained
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
            elif "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(request, tmp_path_factory):
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp("hf") / spec.name
    hf_model(spec).save_pretrained(path, safe_serialization=True)
    return spec, path


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_identical(checkpoint, tp, pp):
    from megatron_patches.models.checkpoints import RankLayout, to_hf, to_megatron
    from megatron_patches.models.hf_checkpoints import (hf_tensor_names, read_hf_config,
                                                        read_hf_tensors)

    _, path = checkpoint
    spec, _ = read_hf_config(path)
    hf = read_hf_tensors(path, hf_tensor_names(path))
    layout = RankLayout(tp_size=tp, pp_size=pp, padded_vocab_size=spec.vocab_size,
                        expert_tp_size=tp if spec.is_moe else 1)  # MoE: expert TP = TP
    ranks = [[to_megatron(spec, hf, dataclasses.replace(
        layout, tp_rank=t, pp_rank=s, expert_tp_rank=t if spec.is_moe else 0))
              for t in range(tp)] for s in range(pp)]
    if tp == 2:  # really split: each rank holds half of the GDN heads
        in_proj = ranks[0][0]["decoder.layers.0.self_attention.in_proj.weight"]
        assert 2 * in_proj.shape[0] == sum(hf[n].shape[0] for n in hf
                                           if ".layers.0.linear_attn.in_proj" in n)
    back = to_hf(spec, ranks, layout)
    assert back.keys() == hf.keys(), sorted(set(back) ^ set(hf))
    different = [n for n in hf if not torch.equal(back[n], hf[n])]
    assert not different, different[:5]


def _megatron_model(spec):
    from megatron_patches.models.gdn import build_gdn_model
    from megatron_patches.models.tiny import TinyLlamaConfig

    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                          max_seq_len=256, params_dtype=torch.float64, kv_channels=spec.head_dim,
                          qk_layernorm=True, rotary_base=spec.rope_theta,
                          layernorm_epsilon=spec.rms_norm_eps)
    gdn = {f: getattr(spec, f) for f in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                         "linear_value_head_dim", "linear_num_key_heads",
                                         "linear_num_value_heads")}
    if spec.is_moe:  # the MoE arguments megatron_args() gives (softmax over the top-k logits)
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()  # sized by an earlier model's layer count
        gdn.update(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                   moe_router_topk=spec.moe_router_topk, moe_router_score_function="softmax",
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.001,
                   moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                   moe_shared_expert_gate=True)
    return build_gdn_model(cfg, linear_attention_freq=spec.linear_attention_freq,
                           attention_output_gate=True, rotary_percent=spec.rotary_percent, **gdn)


def test_loaded_model_gives_transformers_logits_and_exports_the_same_tensors(
        checkpoint, megatron_env, tmp_path):
    from megatron_patches.models.hf_checkpoints import (export_hf_weights, hf_tensor_names,
                                                        load_hf_weights, read_hf_tensors)

    spec, path = checkpoint
    model = _megatron_model(spec)
    assert load_hf_weights(model, path) == dataclasses.replace(spec, name=path.name)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="eager").to(torch.float64)  # grouped_mm has no float64
    tokens = torch.randint(0, spec.vocab_size, (90,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # 90 tokens: across the delta rule's 64-token chunks
        ours = model(tokens[None], torch.arange(90)[None], None)[0]
        theirs = theirs_model(input_ids=tokens[None]).logits[0]
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    config = json.loads((path / "config.json").read_text())
    export_hf_weights([model], tmp_path / "export", config)
    names = hf_tensor_names(path)
    assert hf_tensor_names(tmp_path / "export") == names
    a, b = read_hf_tensors(path, names), read_hf_tensors(tmp_path / "export", names)
    assert all(torch.equal(a[n], b[n]) for n in names)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # loads


def test_qwen35_vlm_checkpoint_reads_as_its_text_model(tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_patches.models.hf_checkpoints import read_hf_config, read_hf_tensors

    text = tmp_path / "text"
    hf_model(QWEN35).save_pretrained(text, safe_serialization=True)
    tensors = load_file(text / "model.safetensors")
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    save_file({n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()},
              vlm / "model.safetensors")
    text_config = json.loads((text / "config.json").read_text())
    (vlm / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {**text_config, "model_type": "qwen3_5_text"}, "vision_config": {}}))
    spec, _ = read_hf_config(vlm)
    assert dataclasses.replace(spec, name=QWEN35.name) == QWEN35
    got = read_hf_tensors(vlm, tensors)
    assert all(torch.equal(got[n], tensors[n].float()) for n in tensors)


def test_export_with_source_writes_the_whole_vlm_checkpoint_back(megatron_env, tmp_path):
    """A Qwen3.5 VLM checkpoint with a vision tower and MTP layers: `untrained_tensors` lists
    what no parameter takes; an export with `source=` writes the source's config, every trained
    tensor under the VLM's name (the model's values: one weight changed shows), and every
    untrained tensor bit-identical, nothing else."""
    from safetensors.torch import load_file, save_file

    from megatron_patches.models.hf_checkpoints import (export_hf_weights, load_hf_weights,
                                                        untrained_tensors)

    text = tmp_path / "text"
    hf_model(QWEN35).save_pretrained(text, safe_serialization=True)
    tensors = {n.replace("model.", "model.language_model.", 1): t
               for n, t in load_file(text / "model.safetensors").items()}
    extra = {"mtp.fc.weight": torch.randn(8, 16), "mtp.layers.0.input_layernorm.weight":
             torch.randn(8), "model.visual.patch_embed.proj.weight": torch.randn(4, 3).half()}
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    save_file({**tensors, **extra}, vlm / "model.safetensors")
    text_config = json.loads((text / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {**text_config, "model_type": "qwen3_5_text"}, "vision_config": {}}
    (vlm / "config.json").write_text(json.dumps(config))
    assert untrained_tensors(vlm) == {"model.visual.*": ["model.visual.patch_embed.proj.weight"],
                                      "mtp.*": ["mtp.fc.weight",
                                                "mtp.layers.0.input_layernorm.weight"]}
    model = _megatron_model(QWEN35)
    load_hf_weights(model, vlm)
    with torch.no_grad():  # "training" moved the final norm
        model.decoder.final_layernorm.weight.add_(0.5)
    export_hf_weights([model], tmp_path / "export", config, source=vlm)
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == config
    out = load_file(tmp_path / "export" / "model.safetensors")
    assert out.keys() == {**tensors, **extra}.keys()
    assert all(torch.equal(out[n], t) and out[n].dtype == t.dtype for n, t in extra.items())
    changed = [n for n in tensors if not torch.equal(out[n].float(), tensors[n].float())]
    assert changed == ["model.language_model.norm.weight"]
    assert torch.equal(out[changed[0]].float(), (tensors[changed[0]].float() + 0.5).to(
        out[changed[0]].dtype).float())
    other = tmp_path / "other"  # not the checkpoint this model came from
    other.mkdir()
    save_file(extra, other / "model.safetensors")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks"):
        export_hf_weights([model], tmp_path / "export2", config, source=other)
