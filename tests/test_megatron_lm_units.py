"""Pieces of the Megatron-LM entry point that need no launch: argument refusals, the HF-checkpoint
check, RL step sources (synthetic generator, pluggable trace readers), the Python 3.11 shim, and
the config classification of Megatron-LM's tensor_parallel_num_weight_shards."""

import argparse
import json
import sys
import types

import pytest

from megatron_patches.megatron_lm import data
from megatron_patches.megatron_lm.arguments import add_prefix_reuse_args, check_prefix_reuse_args
from megatron_patches.models.model_configs import MODELS


def _args(**overrides):
    args = add_prefix_reuse_args(argparse.ArgumentParser()).parse_args([])
    defaults = dict(num_experts=None, tensor_model_parallel_size=1, sequence_parallel=False,
                    expert_tensor_parallel_size=None, expert_gtp_weight_remat_size=1,
                    expert_tensor_parallel_num_weight_shards=None,
                    grpo_entropy_term_weight=0.0, micro_batch_size=1,
                    calculate_per_token_loss=True, virtual_pipeline_model_parallel_size=None,
                    seq_length=64, train_iters=2, vocab_size=512, padded_vocab_size=512,
                    grpo_prompts_per_step=2, grpo_group_size=3, seed=5,
                    rl_synthetic_fixed_response_len=False)
    for key, value in {**defaults, **overrides}.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("overrides,message", [
    (dict(num_experts=8, tensor_model_parallel_size=2), "MoE.*size 2 needs --sequence-parallel"),
    (dict(num_experts=8, tensor_model_parallel_size=2, sequence_parallel=True,
          expert_tensor_parallel_size=1), "give --expert-tensor-parallel-size 2"),
    (dict(num_experts=8, expert_tensor_parallel_size=2), "give --expert-tensor-parallel-size 1"),
    (dict(num_experts=8, tensor_model_parallel_size=2, sequence_parallel=True,
          expert_tensor_parallel_size=2, expert_tensor_parallel_num_weight_shards=4,
          expert_gtp_weight_remat_size=2), "--expert-tensor-parallel-num-weight-shards 4"),
    (dict(grpo_entropy_term_weight=0.1), "use --rl-entropy-coef"),
    (dict(micro_batch_size=2), "--micro-batch-size 1"),
    (dict(calculate_per_token_loss=False), "--calculate-per-token-loss"),
    (dict(prefix_chunk_tokens=0), "--prefix-chunk-tokens 0"),
    (dict(export_hf="/tmp/x"), "--export-hf needs --hf-checkpoint"),
    (dict(train_iters=None), "--train-iters"),
])
def test_arguments_the_trainer_cannot_honour_are_refused(overrides, message):
    check_prefix_reuse_args(_args())
    check_prefix_reuse_args(_args(num_experts=8, tensor_model_parallel_size=2,
                                  sequence_parallel=True, expert_tensor_parallel_size=2))
    with pytest.raises(ValueError, match=message):
        check_prefix_reuse_args(_args(**overrides))


def _megatron_args_for(name, **overrides):
    spec = MODELS[name]
    fields = dict(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                  ffn_hidden_size=spec.ffn_hidden_size,
                  num_attention_heads=spec.num_attention_heads,
                  num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
                  rotary_base=spec.rope_theta, layernorm_epsilon=spec.rms_norm_eps,
                  qk_layernorm=spec.qk_norm,
                  untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
                  use_rope_scaling=spec.rope_scaling_factor is not None,
                  rope_scaling_factor=spec.rope_scaling_factor or 8.0, normalization="RMSNorm",
                  swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                  vocab_size=spec.vocab_size, padded_vocab_size=spec.vocab_size)
    return types.SimpleNamespace(**{**fields, "hf_checkpoint": None, **overrides})


def test_hf_checkpoint_must_match_the_arguments(tmp_path):
    from megatron_patches.megatron_lm.main import _check_hf_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(MODELS["qwen3-8b-tiny"].hf_config()))
    args = _megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path))
    assert _check_hf_checkpoint(args)["model_type"] == "qwen3"
    wrong = _megatron_args_for("llama3.1-8b-tiny", hf_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="do not build the model.*--kv-channels 8 but the "
                                         "checkpoint has head_dim=16"):
        _check_hf_checkpoint(wrong)
    padded = _megatron_args_for("qwen3-8b-tiny", padded_vocab_size=640, hf_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by 1"):
        _check_hf_checkpoint(padded)


def _moe_args(**overrides):
    spec = MODELS["qwen3-30b-a3b-tiny"]
    moe = dict(num_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
               moe_router_topk=spec.moe_router_topk, moe_router_score_function="softmax",
               moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
               moe_router_topk_scaling_factor=None, moe_router_num_groups=None, moe_layer_freq=1)
    return _megatron_args_for("qwen3-30b-a3b-tiny", **{**moe, **overrides})


def test_hf_moe_checkpoint_must_route_like_the_arguments(tmp_path):
    """Qwen3-MoE: softmax over all experts, top-k, renormalised (norm_topk_prob) == Megatron's
    softmax over the top-k logits; without norm_topk_prob == --moe-router-pre-softmax."""
    from megatron_patches.megatron_lm.main import _check_hf_checkpoint

    config = MODELS["qwen3-30b-a3b-tiny"].hf_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _check_hf_checkpoint(_moe_args(hf_checkpoint=str(tmp_path)))["norm_topk_prob"]
    for overrides, message in ((dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
                               (dict(moe_router_topk=4), "--moe-router-topk 4"),
                               (dict(moe_shared_expert_intermediate_size=32), "shared-expert"),
                               (dict(moe_router_score_function="sigmoid"), "score-function"),
                               (dict(moe_layer_freq=[1, 0, 1, 0]), "--moe-layer-freq")):
        with pytest.raises(ValueError, match=message):
            _check_hf_checkpoint(_moe_args(hf_checkpoint=str(tmp_path), **overrides))
    (tmp_path / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    _check_hf_checkpoint(_moe_args(hf_checkpoint=str(tmp_path), moe_router_pre_softmax=True))
    with pytest.raises(ValueError, match="--num-experts 8 but the checkpoint needs None"):
        dense = MODELS["qwen3-8b-tiny"].hf_config()
        (tmp_path / "config.json").write_text(json.dumps(dense))
        _check_hf_checkpoint(_megatron_args_for("qwen3-8b-tiny", hf_checkpoint=str(tmp_path),
                                                num_experts=8, moe_ffn_hidden_size=32,
                                                moe_router_topk=2,
                                                moe_router_score_function="softmax",
                                                moe_router_pre_softmax=False,
                                                moe_shared_expert_intermediate_size=None,
                                                moe_router_topk_scaling_factor=None,
                                                moe_router_num_groups=None, moe_layer_freq=1))


def test_synthetic_steps_depend_only_on_seed_and_iteration():
    source = data.open_step_source(_args())
    again = data.open_step_source(_args())
    later = again.step(1)  # read out of order: a resumed run starts at its iteration
    first = source.step(0)
    assert [g.prefix.tolist() for g in source.step(1).groups] == [g.prefix.tolist()
                                                                   for g in later.groups]
    assert first.groups[0].prefix.tolist() != later.groups[0].prefix.tolist()
    assert len(first.groups) == 2 and all(len(g.trajectories) == 3 for g in first.groups)
    assert all(g.prefix.numel() + t.suffix.numel() <= 64
               for g in first.groups for t in g.trajectories)
    assert all(int(g.prefix.max()) < 512 for g in first.groups)
    with pytest.raises(ValueError, match="within --seq-length 64"):
        data.open_step_source(_args(rl_synthetic_prefix_len=60, rl_synthetic_max_response_len=10))


def test_moe_tensor_parallel_rows_must_be_one_length_a_multiple_of_tp():
    """MoE with TP > 1: every dense microbatch of the packing reuse equals has rows of one
    length, a multiple of TP (Megatron normalises each TP rank's aux loss by its own valid
    tokens); the synthetic generator's --rl-synthetic-fixed-response-len gives such rows."""
    from prefix_schedule import plan_microbatches

    def check(tp, **overrides):
        batch = data.open_step_source(_args(**overrides)).step(3)
        plan = plan_microbatches(batch, token_budget=32, max_seq_len=64, row_multiple=tp)
        assert len(plan.microbatches) > 1
        data.check_moe_tensor_parallel_rows(plan, batch, tp, dp_rank=1)
        return batch

    fixed = dict(rl_synthetic_prefix_len=48, rl_synthetic_max_response_len=15,
                 rl_synthetic_fixed_response_len=True)
    batch = check(2, **fixed)
    assert {t.suffix.numel() for g in batch.groups for t in g.trajectories} == {15}
    check(1, rl_synthetic_prefix_len=48, rl_synthetic_max_response_len=15)  # TP=1: any rows
    with pytest.raises(ValueError, match=r"microbatch 0 of data-parallel rank 1 holds .*rows of "
                                         r"\[61, 62\] tokens.*--rl-synthetic-fixed-response-len"):
        check(2, rl_synthetic_prefix_len=48, rl_synthetic_max_response_len=16)
    with pytest.raises(ValueError, match=r"rows of \[61\] tokens.*a multiple of 2"):
        check(2, **dict(fixed, rl_synthetic_max_response_len=14))


class _ConstantReader:
    def __init__(self, path, args):
        self.path, self.args = path, args

    def step(self, iteration):
        return data.SyntheticSteps(vocab_size=8, num_groups=1, group_size=2, prefix_len=3,
                                   max_response_len=2).step(0)


def test_trace_readers_are_pluggable(tmp_path, monkeypatch):
    trace = tmp_path / "steps.mytrace"
    trace.write_text("x")
    with pytest.raises(ValueError, match="no trace reader claims this file"):
        data.open_step_source(_args(rl_trace=str(trace)))
    monkeypatch.setattr(data, "_READERS", {})
    data.register_trace_reader("mine", _ConstantReader, extensions=(".mytrace",))
    source = data.open_step_source(_args(rl_trace=str(trace)))
    assert isinstance(source, _ConstantReader) and len(source.step(7).groups) == 1
    module = types.ModuleType("my_trace_module")
    module.make = _ConstantReader
    monkeypatch.setitem(sys.modules, "my_trace_module", module)
    by_name = data.open_step_source(_args(rl_trace=str(trace), rl_trace_format="my_trace_module:make"))
    assert isinstance(by_name, _ConstantReader)
    with pytest.raises(ValueError, match="'other' is not a registered trace reader"):
        data.open_step_source(_args(rl_trace=str(trace), rl_trace_format="other"))
    with pytest.raises(ValueError, match="no such file"):
        data.open_step_source(_args(rl_trace=str(tmp_path / "missing.mytrace")))


def test_python311_shim_provides_typing_override():
    import typing

    from megatron_patches.megatron_lm.compat import enable_python311_support

    enable_python311_support()

    @typing.override
    def f():
        return 1

    assert f() == 1


@pytest.mark.megatron
def test_megatron_lm_tp_weight_shard_count_is_plain_tensor_parallelism(megatron_env):
    """Megatron-LM's arguments set tensor_parallel_num_weight_shards = TP (no GTP): reuse runs it;
    more shards than TP is GTP weight sharding (gtp_weight_remat_size > 1): refused."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.config.config_support import check_config_supported

    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, calculate_per_token_loss=True,
                  hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2)
    check_config_supported(TransformerConfig(**common, tensor_parallel_num_weight_shards=2))
    with pytest.raises(ValueError, match="gtp_weight_remat_size"):
        check_config_supported(TransformerConfig(**common, tensor_parallel_num_weight_shards=4))
