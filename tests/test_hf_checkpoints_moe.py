"""Hugging Face Qwen3-MoE checkpoints into Megatron MoE GPTModels and back
(megatron_patches/models/checkpoints.py, hf_checkpoints.py).

* Tensor layouts: HF -> every rank of a TP x PP x EP (x expert TP) split -> HF is the identity;
  expert e sits on EP rank e // (E/ep); what cannot be split is refused.
* Real models: a tiny random Qwen3-MoE (the Qwen3-30B-A3B twin: 8 experts, top-2, q/k norms, no
  shared experts) saved by `transformers` loads into Megatron's MoE GPTModel (local spec,
  SequentialMLP experts, alltoall dispatcher) at TP=1/2, PP=1/2, EP=1/2, expert TP = 1 or TP:
  the Megatron logits equal the HF model's (fp32, 1e-5 relative), with norm_topk_prob True
  (Megatron: softmax over the top-k logits) and False (`moe_router_pre_softmax`: softmax over
  all experts, then top-k); exporting the sharded model gives back identical tensors.
* Checkpoints whose routing Megatron's arguments would build differently are refused.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_harness import run_distributed  # noqa: E402
from megatron_patches.models.checkpoints import RankLayout, to_hf, to_megatron  # noqa: E402
from megatron_patches.models.model_configs import MODELS, from_hf_config  # noqa: E402
from test_hf_checkpoints import _megatron_logits, hf_model  # noqa: E402

pytestmark = pytest.mark.megatron
TWIN = MODELS["qwen3-30b-a3b-tiny"]


def moe_hf_model(spec, seed=0):
    model = hf_model(spec, seed)
    with torch.no_grad():  # routers start at zero in transformers: every expert would tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def hf_tensors(tmp_path_factory):
    """The twin's tensors as transformers writes them (per-expert gate/up/down_proj; in memory
    transformers 5 fuses them into gate_up_proj)."""
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("hf-moe")
    moe_hf_model(TWIN).save_pretrained(path, safe_serialization=True)
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("tp,pp,ep,etp", [(1, 1, 2, 1), (2, 1, 1, 2), (2, 2, 2, 1),
                                          (2, 1, 2, 2)])
def test_moe_tensor_layouts_round_trip(tp, pp, ep, etp, hf_tensors):
    hf = hf_tensors
    layout = RankLayout(tp_size=tp, pp_size=pp, ep_size=ep, expert_tp_size=etp,
                        padded_vocab_size=512)
    ranks = {(p, t, e, x): to_megatron(TWIN, hf, dataclasses.replace(
        layout, pp_rank=p, tp_rank=t, ep_rank=e, expert_tp_rank=x))
        for p in range(pp) for t in range(tp) for e in range(ep) for x in range(etp)}
    grid = [[ranks[p, t, 0, 0] for t in range(tp)] for p in range(pp)]
    experts = [[[ranks[p, 0, e, x] for x in range(etp)] for e in range(ep)] for p in range(pp)]
    back = to_hf(TWIN, grid, layout, experts)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # EP rank 1 of layer 0 holds experts 4..7 as local experts 0..3, fc1 = [gate; up] per ETP rank
    rank = ranks[0, 0, ep - 1, 0]
    fc1 = rank["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    expert = 4 if ep == 2 else 0
    gate = hf[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"]
    assert torch.equal(fc1[:32 // etp], gate[:32 // etp])
    assert torch.equal(rank["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])


def test_moe_layouts_that_cannot_be_split_are_refused(hf_tensors):
    hf = hf_tensors
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by EP=3"):
        to_megatron(TWIN, hf, RankLayout(ep_size=3, padded_vocab_size=512))
    with pytest.raises(ValueError, match="needs an MoE model"):
        to_megatron(MODELS["qwen3-8b-tiny"], {}, RankLayout(ep_size=2, padded_vocab_size=512))


def test_qwen3_moe_configs_megatron_cannot_build_are_refused():
    config = TWIN.hf_config()
    assert from_hf_config(config).moe_norm_topk_prob is True
    assert not from_hf_config({**config, "norm_topk_prob": False}).moe_norm_topk_prob
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        from_hf_config({**config, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="every layer is MoE"):
        from_hf_config({**config, "mlp_only_layers": [0]})


def _build(spec, etp):
    """This rank's stage of a Megatron MoE GPTModel of `spec`: Megatron's local decoder block
    spec (SequentialMLP experts); under TP the norms are sequence-parallel ones (Megatron needs
    sequence parallelism with MoE and TP > 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_patches.models.tiny import (SequenceParallelTorchNorm, TinyLlamaConfig,
                                         make_transformer_config)

    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, vocab_size=spec.vocab_size,
                          kv_channels=spec.head_dim, qk_layernorm=spec.qk_norm,
                          rotary_base=spec.rope_theta, layernorm_epsilon=spec.rms_norm_eps,
                          max_seq_len=64)
    sp = ps.get_tensor_model_parallel_world_size() > 1
    config = make_transformer_config(
        cfg, num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk, moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", sequence_parallel=sp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=etp)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization="RMSNorm")
    if sp:
        for layer in block.layer_specs:
            layer.submodules.input_layernorm = SequenceParallelTorchNorm
            layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
            attention = layer.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = SequenceParallelTorchNorm
        block.layer_norm = SequenceParallelTorchNorm
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=spec.vocab_size,
                    max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=spec.rope_theta).eval()


def _load_compare_export(tp, pp, ep, etp, checkpoint, export_dir):
    from megatron_patches.models.hf_checkpoints import export_hf_weights, load_hf_weights, read_hf_config
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    spec, config = read_hf_config(checkpoint)
    model = _build(spec, etp)
    load_hf_weights(model, checkpoint)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = _megatron_logits(model, tokens)
    export_hf_weights([model], export_dir, config)
    return logits


CASES = [(1, 1, 1, 1, True), (1, 1, 2, 1, True), (2, 1, 1, 2, True), (1, 2, 1, 1, False),
         (2, 1, 2, 1, True)]


@pytest.mark.parametrize("tp,pp,ep,etp,norm_topk", CASES,
                         ids=[f"tp{a}-pp{b}-ep{c}-etp{d}-norm{e}" for a, b, c, d, e in CASES])
def test_imported_moe_logits_equal_hf_and_export_round_trips(tp, pp, ep, etp, norm_topk, tmp_path,
                                                             megatron_env):
    _compare(tp, pp, ep, etp, norm_topk, tmp_path)


@pytest.mark.slow
def test_imported_moe_logits_equal_hf_tp2_pp2_ep2(tmp_path, megatron_env):
    _compare(2, 2, 2, 1, True, tmp_path)


def _compare(tp, pp, ep, etp, norm_topk, tmp_path):
    from safetensors.torch import load_file

    spec = dataclasses.replace(TWIN, moe_norm_topk_prob=norm_topk)
    reference = moe_hf_model(spec, seed=11)
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_topk_prob"] is norm_topk
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(tokens).logits
    results = run_distributed(_load_compare_export, world_size=pp * max(tp, etp * ep),
                              timeout_s=300, args=(tp, pp, ep, etp, str(tmp_path / "hf"),
                                                   str(tmp_path / "out")))
    for logits in results:
        rel = ((logits - expected).abs().max() / expected.abs().max()).item()
        assert rel < 1e-5, rel
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
