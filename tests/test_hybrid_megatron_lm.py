"""A HybridModel configured the Megatron-LM way: `--hybrid-layer-pattern` through Megatron-LM's
own parser and `core_transformer_config_from_args` (tests/megatron_lm_args.py), which set
`is_hybrid_model=True` on every such config. Attention / MLP / MoE patterns are accepted and
reuse == stock dense (fp32: loss, every gradient within 1e-5 per tensor, both sides present and
finite). Which layer symbols are refused is tests/test_hybrid.py's (HybridModels built with
the flag unset)."""

import pytest

from dist_harness import run_distributed
from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=48, num_attention_heads=4,
             num_query_groups=2, vocab_size=256)
MAX_SEQ = 512
TOL = 1e-5
MOE_FLAGS = ["--num-experts", "4", "--moe-ffn-hidden-size", "48", "--moe-router-topk", "2",
             "--moe-aux-loss-coeff", "0.1"]


def _parsed_hybrid_model(pattern: str, extra: list):
    """(the HybridModel built from the Megatron-LM-parsed config, DDP-wrapped; that config;
    where the config came from)."""
    import dataclasses

    from megatron_lm_args import production_settings
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig, initialize_distributed
    from megatron_patches.training import prepare_for_training

    initialize_distributed(seed=1234)
    settings = production_settings(tp=1, pp=1, dp=1, sequence_parallel=False, model=MODEL,
                                   seq_length=MAX_SEQ,
                                   extra=["--hybrid-layer-pattern", pattern, *extra])
    config = dataclasses.replace(settings.transformer_config)
    model = build_hybrid_model(TinyLlamaConfig(**MODEL, max_seq_len=MAX_SEQ), pattern,
                               config=config)
    return prepare_for_training(model, ddp=True), config, settings.source


def _batch_and_plan():
    from prefix_schedule.planning.planner import plan_microbatches

    batch = make_batch(31, [(26, [6, 5, 8]), (15, [7, 4]), (33, [5, 6, 3, 4])])
    return batch, plan_microbatches(batch, token_budget=12, max_seq_len=MAX_SEQ)


def parsed_hybrid_rank(pattern: str, extra: list) -> dict:
    import megatron_patches
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, reuse_step, zero_grads)

    megatron_patches.install()
    model, config, source = _parsed_hybrid_model(pattern, extra)
    batch, plan = _batch_and_plan()
    # MoE: the dense reference is the dense packing the plan equals (docs/DESIGN.md "MoE")
    dense = dense_step(model, batch, LOSS, packing=plan if config.num_moe_experts else None)
    dense_grads = param_grads(model)
    zero_grads(model)
    reuse = reuse_step(model, batch, plan, LOSS)
    reuse_grads = param_grads(model)
    return dict(source=source, is_hybrid_model=config.is_hybrid_model,
                layers="".join(model.module.decoder.layer_type_list),
                tokens=(dense.num_tokens, reuse.num_tokens),
                loss=abs(dense.loss - reuse.loss) / abs(dense.loss),
                grads=max_relative_diff(dense_grads, reuse_grads),
                missing=missing_grads(dense=dense_grads, reuse=reuse_grads))


@pytest.mark.parametrize("pattern,extra", [("*-*-", []), ("*E*-", MOE_FLAGS)],
                         ids=["attention-mlp", "attention-moe"])
def test_hybrid_pattern_from_megatron_lm_arguments_reuse_equals_dense(pattern, extra):
    got = run_distributed(parsed_hybrid_rank, world_size=1, args=(pattern, extra),
                          timeout_s=300)[0]
    assert got["source"] == "megatron-lm parser" and got["is_hybrid_model"] is True, got
    assert got["layers"] == pattern, got
    assert got["tokens"][0] == got["tokens"][1] > 0
    assert not got["missing"], got["missing"][:5]
    assert got["loss"] <= TOL and got["grads"] <= TOL, got

