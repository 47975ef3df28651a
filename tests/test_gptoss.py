"""gpt-oss attention (learnable sinks, softmax_type='learnable'; sliding window on alternate
layers, window_size=(W, 0) + window_attn_skip_freq=2) with prefix reuse == stock Megatron dense
(local DotProductAttention: Megatron's own SoftmaxOne and sliding-window mask), fp32, every
gradient within 1e-5 (the sinks' included), NaN/inf fail."""
import zlib

import pytest
import torch

from test_equivalence import assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

WINDOW = 5
SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
GPTOSS_ATTENTION = dict(window_size=(WINDOW, 0), window_attn_skip_freq=2,
                        softmax_type="learnable", add_qkv_bias=True)


def build(**overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(**SHAPE), **{**GPTOSS_ATTENTION, **overrides})
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():  # sinks of order 1, not Megatron's 0.02 init
        if name.endswith("softmax_offset"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def model(megatron_env):
    return build()


def test_layers_alternate_window_and_full(model):
    from megatron_patches.runtime.hooks import _sink_and_window

    got = [_sink_and_window(layer.self_attention)[1] for layer in model.decoder.layers]
    assert got == [WINDOW, None, WINDOW, None]  # Megatron: layer_number % 2 != 0 is windowed
    assert all(layer.self_attention.core_attention.softmax_offset.requires_grad
               for layer in model.decoder.layers)


CASES = {  # (groups: (prefix, suffixes), token budget, prefix_chunk_tokens)
    "prefix longer than the window, several groups": ([(23, [6, 9, 4]), (17, [8, 3])], 20, None),
    "prefix shorter than the window": ([(3, [7, 5]), (4, [9, 2])], 16, None),
    "1-token suffixes": ([(14, [1, 1, 3, 1]), (2, [1, 1])], 8, None),
    "prefix chunks": ([(27, [6, 9, 4]), (13, [8, 3, 5])], 12, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reuse_equals_dense(model, name):
    shapes, budget, chunk = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) % 1000, shapes)
    kwargs = {} if chunk is None else {"prefix_chunk_tokens": chunk}
    dense, dg, reuse, rg, plan = run_both(model, batch, budget, **kwargs)
    assert plan.prefixes, "no group went through the cache"
    sinks = [n for n in dg if n.endswith("softmax_offset")]
    assert len(sinks) == 4 and all(dg[n].abs().max() > 0 for n in sinks)
    assert_equal_step(dense, dg, reuse, rg)


# gpt-oss's MoE block at tiny width: every layer MoE, top-k routing with softmax after top-k,
# the clamped SwiGLU (quick_gelu with GLU offset 1, clamp 7). Expert biases (gpt-oss has them)
# are left out: megatron-core 0.19.2's local SequentialMLP adds them in place to the output of a
# TP reduce (transformer/mlp.py:354), which autograd refuses, in stock dense training too.
GPTOSS_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_token_dispatcher_type="alltoall",
                  gated_linear_unit=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)


def _quick_gelu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return quick_gelu


def test_moe_reuse_equals_dense(megatron_env):
    """Stock dense over the dense packing of the reuse plan (the aux loss is per microbatch,
    as tests/test_moe.py)."""
    from megatron_patches.training import dense_step, param_grads, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS

    model = build(**GPTOSS_MOE, activation_func=_quick_gelu(), num_layers=2)
    batch = make_batch(3, [(19, [6, 1, 4]), (4, [7, 3])])
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, LOSS, packing=plan)
    dg = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, plan, LOSS)
    rg = param_grads(model)
    assert any("local_experts" in n for n in dg) and plan.prefixes
    assert_equal_step(dense, dg, reuse, rg)


def gptoss_rank(tp: int, pp: int, ep: int) -> dict:
    """One step of the gpt-oss tiny MoE model under TP x PP x EP: stock dense (over the reuse
    plan's dense packing) and prefix reuse, on twin models; every gradient compared."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, prepare_for_training, reuse_step)
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=tp, pp=pp, ep=ep)
    extra = dict(sequence_parallel=True) if tp > 1 else {}  # Megatron-LM's rule for MoE + TP
    models = [prepare_for_training(build(**GPTOSS_MOE, **extra, activation_func=_quick_gelu()),
                                   ddp=True) for _ in range(2)]
    # TP: dense rows of one length (Megatron normalises the aux loss by each TP rank's own
    # valid tokens, [Note: MoE under sequence parallelism]), 1-token suffixes included
    shapes = [(21, [6, 6, 6]), (26, [1, 1])] if tp > 1 else [(19, [6, 1, 4]), (4, [7, 3])]
    batch = make_batch(7 + 100 * parallel_state.get_data_parallel_rank(), shapes)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512, row_multiple=tp)
    dense = dense_step(models[0], batch, LOSS, packing=plan)
    reuse = reuse_step(models[1], batch, plan, LOSS)
    dg, rg = param_grads(models[0]), param_grads(models[1])
    last = parallel_state.is_pipeline_last_stage()
    return dict(loss=abs(dense.loss - reuse.loss) / abs(dense.loss) if last else 0.0,
                grads=max_relative_diff(dg, rg), missing=missing_grads(dense=dg, reuse=rg),
                sinks=sum(n.endswith("softmax_offset") for n in dg),
                experts=sum("local_experts" in n for n in dg), prefixes=len(plan.prefixes))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, ep", [(1, 2, 1), (2, 1, 1), (1, 1, 2)],
                         ids=["PP=2", "TP=2", "EP=2"])
def test_parallel_reuse_equals_dense(tp, pp, ep):
    from dist_harness import run_distributed

    results = run_distributed(gptoss_rank, world_size=tp * pp * ep, args=(tp, pp, ep),
                              timeout_s=300)
    for rank, out in enumerate(results):
        assert out["sinks"] > 0 and out["experts"] > 0 and out["prefixes"] > 0, (rank, out)
        assert not out["missing"], (rank, out["missing"][:5])
        assert out["grads"] <= 1e-5 and out["loss"] <= 1e-5, (rank, out)


def test_a_backend_without_window_kernels_is_refused_before_compute(model, monkeypatch):
    """On a GPU 'auto' picks TE or flash-attn: a windowed model is refused before any compute."""
    from prefix_schedule.attention.backends import (get_backend, get_default_backend,
                                                    set_default_backend)
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_config_support import _call_reuse

    monkeypatch.setattr(type(get_backend("torch")), "supports_window", False)
    before = get_default_backend()
    set_default_backend("torch")
    try:
        batch = make_batch(4, [(10, [3, 4])])
        step = ReuseStep(batch, plan_microbatches(batch, token_budget=8, max_seq_len=512))
        assert "no sliding-window path" in _call_reuse(model, step)
    finally:
        set_default_backend(before)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
    ids=["full", "selective-core_attn"])
def test_recompute_reuse_equals_dense(megatron_env, recompute):
    """Megatron's recompute re-runs the hooked attention (full: Phase C re-runs each prefix unit
    and injects its K/V gradients): the sinks and windows must come along."""
    model = build(**recompute)
    batch = make_batch(21, [(17, [5, 1, 7]), (4, [6, 3])])
    dense, dg, reuse, rg, plan = run_both(model, batch, 12, prefix_chunk_tokens=6)
    assert plan.prefixes
    assert_equal_step(dense, dg, reuse, rg)


@pytest.mark.parametrize("spec, chunk", [
    (dict(depth=3, branching=2, node_len=6, suffix_len=4, inner=1), 4),
    (dict(depth=2, branching=3, node_len=3, suffix_len=3, per_leaf=2, node_loss=True), None)],
    ids=["depth 3, chunks split nodes", "nodes shorter than the window, loss in nodes"])
def test_prefix_trees_reuse_equals_dense(model, spec, chunk):
    """Prefix trees (tests/test_prefix_trees_megatron.py): a node's or suffix's window reaches
    back through its chain of ancestors' K/V."""
    from tree_batches import make_tree_batch

    batch = make_tree_batch(17, [spec])
    dense, dg, reuse, rg, plan = run_both(model, batch, 12, prefix_chunk_tokens=chunk)
    assert len(plan.prefix_units()) >= batch.groups[0].num_nodes > 1
    assert_equal_step(dense, dg, reuse, rg)


@pytest.mark.slow
def test_tiny_twin_from_megatron_lm_parser_reuse_equals_dense(megatron_env, monkeypatch):
    """gpt-oss-20b-tiny's Megatron-LM arguments through Megatron-LM's own parser and config
    builder (megatron.training of the wheel, tests/megatron_lm_args.py's shim), the local spec,
    then one reuse step == stock dense. Deviations from the twin's flags, named: no linear biases
    (megatron-core 0.19.2's local SequentialMLP fails on expert biases, above), no bias-GELU
    fusion (CUDA), plain RoPE (build_model's; prefix reuse refuses YaRN before compute)."""
    import sys

    from megatron_lm_args import _import_megatron_training
    from megatron_patches.models.model_configs_gptoss import GPTOSS_MODELS
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    arguments, argument_utils, _ = _import_megatron_training()
    spec = GPTOSS_MODELS["gpt-oss-20b-tiny"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *spec.megatron_args(),
                                      "--disable-bias-linear", "--no-bias-gelu-fusion",
                                      "--micro-batch-size", "1", "--global-batch-size", "1",
                                      "--seq-length", "64", "--transformer-impl", "local",
                                      "--no-masked-softmax-fusion", "--no-rope-fusion",
                                      "--no-gradient-accumulation-fusion",
                                      "--use-cpu-initialization", "--no-persist-layer-norm",
                                      "--calculate-per-token-loss"])
    args = arguments.parse_and_validate_args()
    config = argument_utils.core_transformer_config_from_args(args)
    assert config.softmax_type == "learnable" and tuple(config.window_size) == (7, 0)
    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.moe_ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
                          vocab_size=spec.vocab_size, max_seq_len=512,
                          rotary_base=spec.rope_theta)
    model = build_model(cfg, transformer_config=config)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.normal_()
    from megatron_patches.training import dense_step, param_grads, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS

    batch = make_batch(31, [(19, [5, 1, 6]), (6, [4, 7])], vocab=spec.vocab_size)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    dense = dense_step(model, batch, LOSS, packing=plan)
    dg = param_grads(model)
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, plan, LOSS)
    rg = param_grads(model)
    assert plan.prefixes and any("local_experts" in n for n in dg)
    assert_equal_step(dense, dg, reuse, rg)
