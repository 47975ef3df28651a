"""Outside reference for the Gated DeltaNet path: transformers' Qwen3NextForCausalLM with the
weights of our Megatron GDN GPTModel (dense, no reuse) gives the same logits, loss and every
gradient on full sequences. With tests/test_gdn.py (reuse == stock dense) this ties the reuse
path to the published model's definition, not to our reading of Megatron.

Both models run in float64, but both up-cast inside to fp32 (the chunked delta rule, the norms,
the gates: ../shared/notes/hybrid.md), so agreement is at fp32 level (~1e-6 relative); a wrong
layout (in_proj interleave, [query; gate] rows, (1 + w) norms, GQA head mapping, partial RoPE)
is off by O(1). Layout facts: HF's in_proj_qkvz rows are, per key head, [q, k, v group, z group]
and in_proj_ba [b group, a group]; Megatron's in_proj is [q | k | v | z | beta | alpha];
HF's q_proj rows are [query_h; gate_h] per head, Megatron's linear_qkv per query group
[q heads; gate heads; k; v]; HF's Qwen3NextRMSNorm computes (1 + w), the GDN output norm w.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_gdn import SHAPE, weak_decay  # noqa: E402

pytestmark = pytest.mark.megatron

HEADS = dict(hk=2, hv=4, dk=16, dv=16)  # megatron_patches.models.gdn.GDN_TINY_SHAPE
PATTERN = (1, 0, 1, 0)  # GDN, attention, GDN, attention


def _megatron_model():
    from megatron_patches.models.gdn import build_gdn_model
    from megatron_patches.models.tiny import TinyLlamaConfig

    cfg = TinyLlamaConfig(**{**SHAPE, "num_layers": len(PATTERN)}, params_dtype=torch.float64,
                          qk_layernorm=True, layernorm_epsilon=1e-6)
    model = build_gdn_model(cfg, linear_attention_freq=list(PATTERN),
                            attention_output_gate=True, rotary_percent=0.5)
    weak_decay(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norms away from 1: a missed (1 + w) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _hf_model():
    c = SHAPE
    config = transformers.Qwen3NextConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["ffn_hidden_size"], num_hidden_layers=len(PATTERN),
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_query_groups"],
        head_dim=c["hidden_size"] // c["num_attention_heads"], rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4, linear_key_head_dim=HEADS["dk"],
        linear_value_head_dim=HEADS["dv"], linear_num_key_heads=HEADS["hk"],
        linear_num_value_heads=HEADS["hv"], num_experts=0, tie_word_embeddings=False,
        layer_types=["linear_attention" if x else "full_attention" for x in PATTERN],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5, max_position_embeddings=512)
    config._attn_implementation = "eager"
    return transformers.Qwen3NextForCausalLM(config).to(torch.float64)


def _spec():
    """The ModelSpec of both models (qwen3_next, dense MLPs, GDN / attention alternating)."""
    from megatron_patches.models.model_configs import ModelSpec

    c = SHAPE
    return ModelSpec(name="reference", family="qwen3_next", num_layers=len(PATTERN),
                     hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn_hidden_size"],
                     num_attention_heads=c["num_attention_heads"],
                     num_query_groups=c["num_query_groups"],
                     head_dim=c["hidden_size"] // c["num_attention_heads"],
                     vocab_size=c["vocab_size"], max_position_embeddings=512, rope_theta=10000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qk_norm=True,
                     linear_attention_freq=2, linear_num_key_heads=HEADS["hk"],
                     linear_num_value_heads=HEADS["hv"], linear_key_head_dim=HEADS["dk"],
                     linear_value_head_dim=HEADS["dv"], linear_conv_kernel_dim=4,
                     attention_output_gate=True, rotary_percent=0.5)


def to_hf(m: dict, offset: float) -> dict:
    """Megatron tensors by name -> HF tensors by name through the checkpoint mapping
    (megatron_patches/models/checkpoints_gdn.py). Weights: offset=1 (its (1 + w) norms);
    gradients: offset=0 (d/dw is the same on both sides, so norm gradients are not shifted)."""
    from megatron_patches.models.checkpoints import RankLayout, to_hf as mapping
    from megatron_patches.models.checkpoints_gdn import NORM_OFFSET

    out = mapping(_spec(), [[dict(m)]], RankLayout(padded_vocab_size=SHAPE["vocab_size"]))
    if offset != NORM_OFFSET:  # gradients: undo the weight offset the mapping applied
        out = {n: t + (NORM_OFFSET - offset) if _shifted(n) else t for n, t in out.items()}
    return out


def _shifted(name: str) -> bool:
    """HF norms the mapping shifts by NORM_OFFSET (all but the GDN output norm)."""
    return name.endswith("norm.weight") and ".linear_attn.norm." not in name


def _loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits[:-1], tokens[1:])


def test_qwen3_next_reference_loss_logits_and_every_gradient(megatron_env):
    megatron, hf = _megatron_model(), _hf_model()
    weights = to_hf({n: p.detach() for n, p in megatron.named_parameters()}, offset=1.0)
    assert set(weights) == set(dict(hf.named_parameters())), set(weights) ^ set(
        dict(hf.named_parameters()))
    hf.load_state_dict(weights, strict=False)
    tokens = torch.randint(0, SHAPE["vocab_size"], (90,),
                           generator=torch.Generator().manual_seed(0))  # two 64-token chunks
    ours = megatron(tokens[None], torch.arange(90)[None], None)[0]
    theirs = hf(input_ids=tokens[None]).logits[0]
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-5 * scale
    loss_ours, loss_theirs = _loss(ours, tokens), _loss(theirs, tokens)
    assert abs(loss_ours.item() - loss_theirs.item()) <= 1e-6 * abs(loss_theirs.item())
    loss_ours.backward()
    loss_theirs.backward()
    grads = to_hf({n: p.grad for n, p in megatron.named_parameters()}, offset=0.0)
    worst = {}
    for name, p in hf.named_parameters():
        ref = p.grad
        assert ref is not None and torch.isfinite(ref).all() and torch.isfinite(grads[name]).all()
        assert ref.abs().max() > 0, f"{name}: no gradient"
        worst[name] = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
