"""Hugging Face Llama 3 / Qwen3 checkpoints into Megatron GPTModels and back
(megatron_patches/models/checkpoints.py, hf_checkpoints.py).

* Tensor layouts: HF -> every rank of a TP x PP split -> HF is the identity (untied and tied
  embeddings, padded vocabulary), and layouts it cannot represent are refused.
* Real models: tiny random Llama 3.1 / Qwen3 models saved by `transformers` (safetensors) load into
  Megatron's GPTModel (local spec) at TP=1/2 and PP=1/2; the Megatron logits equal the HF
  model's (fp32, 1e-5 relative), and exporting the sharded model gives back identical tensors.
"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_harness import run_distributed  # noqa: E402
from megatron_patches.models.checkpoints import RankLayout, to_hf, to_megatron  # noqa: E402
from megatron_patches.models.model_configs import MODELS  # noqa: E402

pytestmark = pytest.mark.megatron


def hf_model(spec, seed=0):
    """A random transformers model of `spec` (fp32, eager attention)."""
    config = transformers.AutoConfig.for_model(
        spec.family, **{k: v for k, v in spec.hf_config().items() if k != "model_type"})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms start at 1: make them informative
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _random_hf_state(spec):
    return {k: v.detach().clone() for k, v in hf_model(spec).state_dict().items()
            if "rotary" not in k}


@pytest.mark.parametrize("name,tied", [("llama3.1-8b-tiny", False), ("qwen3-8b-tiny", False),
                                       ("qwen3-8b-tiny", True)])
@pytest.mark.parametrize("tp,pp,padded", [(1, 1, 512), (2, 1, 512), (1, 2, 512), (2, 2, 520)])
def test_tensor_layouts_round_trip(name, tied, tp, pp, padded):
    spec = dataclasses.replace(MODELS[name], tie_word_embeddings=tied)
    hf = _random_hf_state(spec)
    if tied:
        hf.pop("lm_head.weight", None)
    layout = RankLayout(tp_size=tp, pp_size=pp, padded_vocab_size=padded)
    ranks = [[to_megatron(spec, hf, dataclasses.replace(layout, tp_rank=t, pp_rank=p))
              for t in range(tp)] for p in range(pp)]
    back = to_hf(spec, ranks, layout)
    assert set(back) == set(hf)
    for name_, tensor in hf.items():
        assert torch.equal(back[name_], tensor), name_
    qkv = ranks[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    heads_per_rank = (spec.num_attention_heads + 2 * spec.num_query_groups) // tp
    assert qkv.shape == (heads_per_rank * spec.head_dim, spec.hidden_size)
    # rank 0's first rows are query group 0: its q heads, then k, then v
    per_group = spec.num_attention_heads // spec.num_query_groups * spec.head_dim
    k_rows = qkv[per_group:per_group + spec.head_dim]
    assert torch.equal(k_rows, hf["model.layers.0.self_attn.k_proj.weight"][:spec.head_dim])


def test_layouts_that_cannot_be_represented_are_refused():
    spec = MODELS["qwen3-8b-tiny"]  # 2 K/V heads
    hf = _random_hf_state(spec)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by TP=4"):
        to_megatron(spec, hf, RankLayout(tp_size=4, padded_vocab_size=512))
    with pytest.raises(ValueError, match="must be >= vocab_size=512"):
        to_megatron(spec, hf, RankLayout(padded_vocab_size=256))
    with pytest.raises(ValueError, match="do not split evenly over PP=3"):
        to_megatron(spec, hf, RankLayout(pp_size=3, padded_vocab_size=512))


def _build(spec):
    """This rank's stage of a Megatron GPTModel of `spec` (local spec, fp32)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config

    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                          kv_channels=spec.head_dim, qk_layernorm=spec.qk_norm,
                          rotary_base=spec.rope_theta,
                          rope_scaling_factor=spec.rope_scaling_factor,
                          layernorm_epsilon=spec.rms_norm_eps, max_seq_len=64)
    config = make_transformer_config(cfg)
    return GPTModel(config=config, vocab_size=spec.vocab_size, max_sequence_length=64,
                    transformer_layer_spec=get_gpt_layer_local_spec(
                        normalization="RMSNorm", qk_layernorm=spec.qk_norm),
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=spec.tie_word_embeddings,
                    position_embedding_type="rope", rotary_base=spec.rope_theta,
                    rope_scaling=spec.rope_scaling_factor is not None,
                    rope_scaling_factor=spec.rope_scaling_factor or 8.0)


def _megatron_logits(model, tokens):
    """Full-vocabulary logits [b, s, V] on every rank (manual PP forward, TP all-gather;
    sequence parallel: each stage sends its sequence shard)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    seq = tokens.shape[1] // (ps.get_tensor_model_parallel_world_size()
                              if model.config.sequence_parallel else 1)
    hidden_shape = (seq, tokens.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if pp_rank > 0:
            received = torch.empty(hidden_shape)
            torch.distributed.recv(received, group=pp_group, group_src=pp_rank - 1)
            model.set_input_tensor(received)
        out = model(tokens, positions, None)
        if pp_rank < pp_size - 1:
            torch.distributed.send(out.contiguous(), group=pp_group, group_dst=pp_rank + 1)
            logits = torch.empty(*tokens.shape, model.vocab_size)
        else:
            logits = gather_from_tensor_model_parallel_region(out).contiguous()
        torch.distributed.broadcast(logits, group=pp_group,
                                    group_src=pp_size - 1)
    return logits


def _load_compare_export(name, tied, tp, pp, checkpoint, export_dir):
    from megatron_patches.models.hf_checkpoints import export_hf_weights, load_hf_weights, read_hf_config
    from megatron_patches.megatron_lm.compat import enable_megatron_lm_cpu_support
    from megatron_patches.models.tiny import initialize_distributed

    enable_megatron_lm_cpu_support()  # tied embeddings + PP: Megatron moves a weight to CUDA
    initialize_distributed(seed=7, tp=tp, pp=pp)
    spec, config = read_hf_config(checkpoint)
    model = _build(spec)
    load_hf_weights(model, checkpoint)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = _megatron_logits(model, tokens)
    export_hf_weights([model], export_dir, config)
    return logits


CASES = [("llama3.1-8b-tiny", False, 1, 1), ("qwen3-8b-tiny", False, 2, 1),
         ("qwen3-8b-tiny", True, 1, 2), ("llama3.1-8b-tiny", False, 2, 2)]


@pytest.mark.parametrize("name,tied,tp,pp", CASES, ids=[f"{n}-tied{t}-tp{a}-pp{b}" for n, t, a, b in CASES])
def test_imported_megatron_logits_equal_hf_and_export_round_trips(name, tied, tp, pp, tmp_path,
                                                                  megatron_env):
    from safetensors.torch import load_file

    spec = dataclasses.replace(MODELS[name], tie_word_embeddings=tied)
    reference = hf_model(spec, seed=11)
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(tokens).logits
    results = run_distributed(_load_compare_export, world_size=tp * pp, timeout_s=240,
                              args=(name, tied, tp, pp, str(tmp_path / "hf"), str(tmp_path / "out")))
    for logits in results:
        rel = ((logits - expected).abs().max() / expected.abs().max()).item()
        assert rel < 1e-5, rel
    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(
        tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
