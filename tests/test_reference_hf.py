"""Cross-check of the float64 reference (tests/reference_impl.py) against Hugging Face
`transformers` (test-only dependency, pinned in the Makefile): LlamaForCausalLM (GQA, Llama 3.1
RoPE scaling) and Qwen3ForCausalLM (per-head q/k norm, explicit head_dim) with the same
weights give the same logits in float64. So the reference's definitions are the published
models', not our reading of them. Skipped when transformers is not installed."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import reference_impl as ref  # noqa: E402
from test_reference import MODELS, randomize, ref_model_config  # noqa: E402

pytestmark = pytest.mark.megatron


def hf_model(rcfg: ref.RefModelConfig):
    rope = {"rope_type": "default", "rope_theta": rcfg.rope_theta}
    if rcfg.llama3_scaling:
        rope = {"rope_type": "llama3", "rope_theta": rcfg.rope_theta, **rcfg.llama3_scaling}
    common = dict(vocab_size=rcfg.vocab_size, hidden_size=rcfg.hidden_size,
                  intermediate_size=rcfg.ffn_hidden_size, num_hidden_layers=rcfg.num_layers,
                  num_attention_heads=rcfg.num_heads, num_key_value_heads=rcfg.num_kv_heads,
                  head_dim=rcfg.head_dim, rms_norm_eps=rcfg.norm_eps, rope_parameters=rope,
                  max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False)
    if rcfg.qk_norm:
        config = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common, mlp_bias=False)
        model = transformers.LlamaForCausalLM(config)
    config._attn_implementation = "eager"
    return model.to(torch.float64).eval()


def load_reference_weights(model, reference: ref.ReferenceLM) -> None:
    p, c = reference.p, reference.cfg
    weights = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"],
               "lm_head.weight": p["out"]}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        weights.update({
            pre + "input_layernorm.weight": p[f"{i}.attn_norm"],
            pre + "self_attn.q_proj.weight": p[f"{i}.wq"],
            pre + "self_attn.k_proj.weight": p[f"{i}.wk"],
            pre + "self_attn.v_proj.weight": p[f"{i}.wv"],
            pre + "self_attn.o_proj.weight": p[f"{i}.wo"],
            pre + "post_attention_layernorm.weight": p[f"{i}.mlp_norm"],
            pre + "mlp.gate_proj.weight": p[f"{i}.gate"],
            pre + "mlp.up_proj.weight": p[f"{i}.up"],
            pre + "mlp.down_proj.weight": p[f"{i}.down"],
        })
        if c.qk_norm:
            weights[pre + "self_attn.q_norm.weight"] = p[f"{i}.q_norm"]
            weights[pre + "self_attn.k_norm.weight"] = p[f"{i}.k_norm"]
    state = model.state_dict()
    assert set(weights) == {k for k in state if "rotary" not in k}, set(weights) ^ set(state)
    model.load_state_dict({k: v.detach() for k, v in weights.items()}, strict=False)


@pytest.mark.parametrize("name", list(MODELS))
def test_reference_logits_equal_transformers(megatron_env, name):
    from megatron_patches.models.tiny import build_model

    cfg, rcfg = ref_model_config(name)
    megatron = build_model(cfg)
    randomize(megatron, seed=11)
    reference = ref.ReferenceLM(rcfg, megatron.state_dict())
    hf = hf_model(rcfg)
    load_reference_weights(hf, reference)
    tokens = torch.randint(0, rcfg.vocab_size, (100,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=tokens[None]).logits[0]
        got = reference.logits(tokens)
    # transformers computes RMSNorm statistics and the RoPE table in float32 even for a float64
    # model, so agreement is ~1e-6 relative; a wrong definition (theta, q/k norm, GQA mapping,
    # QKV layout) is off by O(1).
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # the RoPE frequencies (Llama 3.1 scaling included) to float32 precision
    assert torch.allclose(hf.model.rotary_emb.inv_freq.double(), ref.inv_frequencies(rcfg),
                          rtol=1e-6, atol=0)
