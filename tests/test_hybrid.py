"""Prefix reuse on Megatron's `HybridModel` (GPTModel's successor) vs stock dense HybridModel.

Attention (`*`) and MLP (`-`) layer patterns, fp32: loss and every gradient within 1e-5 relative,
single process and PP=2 (gloo). MTP patterns are refused before any compute (gated delta net
`G`: tests/test_gdn_hybrid.py; Mamba `M`: tests/test_mamba.py; MoE `E`: tests/test_hybrid_moe.py;
full recompute: tests/test_hybrid_recompute.py).
Models: megatron_patches.models.hybrid (Megatron's local modules, runs on CPU).
"""

import dataclasses
import types
import zlib

import pytest
import torch

from dist_harness import DistributedRunError, run_distributed
from prefix_schedule.planning.planner import plan_microbatches
from test_equivalence import LOSS, TOL, assert_equal_step, make_batch

pytestmark = pytest.mark.megatron

SHAPES = [(33, [6, 9, 4]), (17, [8, 3]), (26, [5, 7])]


def _cfg():
    from megatron_patches.models.tiny import TinyLlamaConfig

    return TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=176,
                           num_attention_heads=4, num_query_groups=2, vocab_size=256,
                           max_seq_len=512)


def _build(pattern, **kwargs):
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_hybrid_model(_cfg(), pattern, **kwargs)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


def _dense_and_reuse(model, batch, budget, **plan_kwargs):
    from megatron_patches.training import dense_step, param_grads, reuse_step

    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, LOSS)
    dense_grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512, **plan_kwargs)
    reuse = reuse_step(model, batch, plan, LOSS)
    return dense, dense_grads, reuse, param_grads(model)


CASES = {
    "attention then MLP": ("*-*-", {}),
    "MLP first, attention last": ("-*-*", {}),
    "MLP layers after the last attention": ("**--", {}),
    "prefix chunks": ("*-*-", {"prefix_chunk_tokens": 12}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_reuse_equals_dense(megatron_env, name):
    pattern, plan_kwargs = CASES[name]
    model = _build(pattern)
    batch = make_batch(zlib.crc32(name.encode()) % 1000, SHAPES)
    assert_equal_step(*_dense_and_reuse(model, batch, 12, **plan_kwargs))


def test_the_hybrid_rope_hook_is_what_makes_it_exact(megatron_env):
    """Without HybridModel's RoPE hook, suffixes restart at position 0: far from dense."""
    from megatron.core.models.hybrid import hybrid_model
    from megatron_patches.training import max_relative_diff

    model = _build("*-*-")
    batch = make_batch(5, SHAPES)
    installed, hybrid_model._rotary_pos_emb_hook = hybrid_model._rotary_pos_emb_hook, None
    try:
        dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(model, batch, 12)
    finally:
        hybrid_model._rotary_pos_emb_hook = installed
    assert installed is not None
    assert max_relative_diff(dense_grads, reuse_grads) > 1e3 * TOL


def test_local_hybrid_stack_is_the_gpt_local_spec(megatron_env):
    """'*-*-' with a 2-layer GPTModel's weights gives that GPTModel's logits (same modules)."""
    from megatron_patches.models.tiny import build_model

    gpt, hybrid = build_model(dataclasses.replace(_cfg(), num_layers=2)), _build("*-*-")
    renamed = {}
    for name, value in gpt.state_dict().items():
        if name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            mlp_half = rest.startswith(("pre_mlp_layernorm", "mlp."))
            name = f"decoder.layers.{2 * int(index) + mlp_half}.{rest}"
        renamed[name.replace("decoder.final_layernorm", "decoder.final_norm")] = value
    assert set(renamed) == set(hybrid.state_dict())
    hybrid.load_state_dict(renamed)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(gpt(tokens, positions, None), hybrid(tokens, positions, None))


REFUSED = {
    "DeepSeek sparse attention": ("D-", r"'D' \(DeepSeek sparse attention\)"),
    "multi-token prediction": ("*-/*-", "multi-token prediction"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_layer_kinds_fail_before_any_compute(megatron_env, name):
    """`D` layers are Megatron's placeholders here (no local spec): the refusal reads the
    pattern."""
    from megatron_patches.training import reuse_step

    pattern, message = REFUSED[name]
    model = _build(pattern)
    batch = make_batch(9, SHAPES[:2])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    with pytest.raises(ValueError, match=message):
        reuse_step(model, batch, plan, LOSS)
    assert all(p.grad is None for p in model.parameters()), "compute ran before the refusal"


def test_stage_patterns_follow_megatrons_split():
    from megatron_patches.runtime.layers import stage_patterns

    even = types.SimpleNamespace(num_layers_in_first_pipeline_stage=None,
                                 num_layers_in_last_pipeline_stage=None)
    assert stage_patterns("*-*-*-", 3, even) == ["*-", "*-", "*-"]
    assert stage_patterns("*-|*--*/*-", 2, even) == ["*-", "*--*"]
    uneven = types.SimpleNamespace(num_layers_in_first_pipeline_stage=1,
                                   num_layers_in_last_pipeline_stage=None)
    assert stage_patterns("*-*-*", 3, uneven) == ["*", "-*", "-*"]


def _pp2_rank(pattern, refused_pattern):
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import max_relative_diff, missing_grads

    megatron_patches.install()
    initialize_distributed(seed=1234, pp=2)
    model = _build(pattern)
    dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(model, make_batch(4, SHAPES), 10)
    refused = _build(refused_pattern)
    try:
        _dense_and_reuse(refused, make_batch(4, SHAPES[:1]), 10)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                layers="".join(model.decoder.layer_type_list),
                losses=(dense.loss, reuse.loss), tokens=(dense.num_tokens, reuse.num_tokens),
                grad_diff=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads), refusal=refusal)


def test_pp2_hybrid_reuse_equals_dense_and_refuses_a_stage_without_attention():
    try:
        results = run_distributed(_pp2_rank, world_size=2, args=("*-*|-*-", "*-|--"),
                                  timeout_s=240)
    except DistributedRunError as error:
        pytest.fail(str(error))
    assert [r["layers"] for r in results] == ["*-*", "-*-"]
    dense_loss, reuse_loss = results[-1]["losses"]
    assert results[-1]["tokens"][0] == results[-1]["tokens"][1] > 0
    assert abs(dense_loss - reuse_loss) <= TOL * abs(dense_loss)
    for r in results:
        assert not r["missing"] and r["grad_diff"] <= TOL, r
        # every rank refuses, before compute: no rank waits on a peer that raised
        assert r["refusal"] and "stage(s) [1] hold no attention" in r["refusal"], r
