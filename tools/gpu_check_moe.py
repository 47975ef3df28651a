"""gpu_check.py, phase 4: one MoE training step, dense vs prefix reuse, with grouped experts.

megatron-core 0.19.2 has three expert MLPs (transformer/moe/experts.py): `SequentialMLP` (a loop
over experts; what the CPU tests run), `TEGroupedMLP` (Transformer Engine's GroupedLinear, one
grouped GEMM per projection: `moe_grouped_gemm=True` with the TE spec) and
`InferenceGroupedMLP` (inference only). The legacy `GroupedMLP` (the `grouped_gemm` package) is
gone from 0.19, and no torch-native training path exists (torch._grouped_mm is used only by the
inference class), so grouped experts run on a GPU with TE only. The reuse hooks never touch the
experts: they wrap `TopKRouter.routing` and replace core attention; an expert MLP receives the
permuted tokens of a microbatch (or of a prefix unit) and is a per-token function, so
TEGroupedMLP is as exact as SequentialMLP. This phase proves it on the GPU: the TE spec with
`moe_grouped_gemm=True` (TEGroupedMLP), alltoall dispatcher, aux loss, bf16, dense over the
dense packing the reuse plan equals (docs/DESIGN.md "MoE") and reuse, both against an fp32 dense
reference of the same weights (the TE spec in fp32, Megatron's unfused core attention); the
logged aux losses of dense and reuse agree. `--dry-run`: the local spec (SequentialMLP) on CPU.
"""
from __future__ import annotations

import torch

from benchlib.steps import private_rendezvous
from benchlib.workload import make_batch

LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GPU_SHAPE = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                 num_query_groups=2, vocab_size=4096)
DRY_SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)
GPU_MOE = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1408)
DRY_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64)
MOE_COMMON = dict(moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
GPU_WORK = dict(prefix_len=1536, suffix_len=256, group_size=4, num_groups=2)
DRY_WORK = dict(prefix_len=40, suffix_len=8, group_size=3, num_groups=2)


def _te_moe_model(cfg, seed: int, *, exact_attention: bool, **overrides):
    """GPTModel with get_gpt_decoder_block_spec(use_transformer_engine=True): TEGroupedMLP
    experts with moe_grouped_gemm=True; `exact_attention`: Megatron's unfused core attention."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron_patches.models.tiny import make_transformer_config

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = make_transformer_config(cfg, **overrides)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                      normalization=config.normalization)
    for layer in spec.layer_specs:
        if exact_attention:
            layer.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_seq_len, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=10000)
    return model.to(cfg.params_dtype).cuda()


def _models(dry_run: bool, max_seq_len: int):
    """(bf16 model, fp32 reference with the same bf16-rounded weights, settings)."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    shape, moe = (DRY_SHAPE, DRY_MOE) if dry_run else (GPU_SHAPE, GPU_MOE)
    moe = {**moe, **MOE_COMMON}
    cfg16 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len, params_dtype=torch.bfloat16)
    cfg32 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len)
    if dry_run:
        settings = dict(spec="local decoder block spec, SequentialMLP (dry-run stand-in)")
        model16, model32 = build_model(cfg16, seed=3, **moe), build_model(cfg32, seed=4, **moe)
    else:
        from megatron.core.transformer.enums import AttnBackend

        settings = dict(spec="get_gpt_decoder_block_spec(use_transformer_engine=True), "
                             "moe_grouped_gemm=True (TEGroupedMLP)",
                        reference="the same spec in fp32 with Megatron's unfused core attention")
        kw = dict(moe, moe_grouped_gemm=True, apply_rope_fusion=True,
                  attention_backend=AttnBackend.fused)
        model16 = _te_moe_model(cfg16, 3, exact_attention=False, **kw)
        model32 = _te_moe_model(cfg32, 4, exact_attention=True, **kw)
    experts = {type(m).__name__ for m in model16.modules()} & {"SequentialMLP", "TEGroupedMLP"}
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    for model in (model16, model32):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    settings.update(moe, expert_mlp=sorted(experts))
    return model16, model32, settings, shape


def _aux_loss() -> float:
    """The logged load_balancing_loss summed over layers and microbatches; tracker reset."""
    from megatron.core.transformer.moe.moe_logging import (destroy_moe_metrics_tracker,
                                                           get_moe_metrics_tracker)

    entry = get_moe_metrics_tracker().metrics.get("load_balancing_loss")
    destroy_moe_metrics_tracker()
    return float("nan") if entry is None else float(entry.values.sum())


def run(device, *, dry_run: bool) -> dict:
    import megatron_patches
    from megatron_patches.models.tiny import initialize_single_process
    from megatron_patches.training import (dense_step, max_relative_diff, param_grads,
                                           reuse_step, zero_grads)
    from prefix_schedule.attention.backends import set_default_backend
    from prefix_schedule.losses import PolicyLossConfig
    from prefix_schedule.planning.planner import plan_microbatches

    work = DRY_WORK if dry_run else GPU_WORK
    max_seq_len = work["prefix_len"] + work["suffix_len"]
    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    megatron_patches.install()
    private_rendezvous()
    initialize_single_process(seed=1234)
    set_default_backend("torch" if dry_run else "transformer_engine")
    model16, model32, settings, shape = _models(dry_run, max_seq_len)
    batch = make_batch(**work, vocab_size=shape["vocab_size"], seed=5)
    plan = plan_microbatches(batch, token_budget=work["group_size"] * work["suffix_len"],
                             max_seq_len=max_seq_len)
    loss = PolicyLossConfig(**LOSS_KW)
    results, grads, aux = {}, {}, {}
    _aux_loss()
    for name, model, fn in (
            ("reference_fp32_dense", model32, lambda: dense_step(model32, batch, loss, packing=plan)),
            ("dense_bf16", model16, lambda: dense_step(model16, batch, loss, packing=plan)),
            ("reuse_bf16", model16, lambda: reuse_step(model16, batch, plan, loss))):
        zero_grads(model)
        results[name] = fn().loss
        aux[name], grads[name] = _aux_loss(), param_grads(model)
        zero_grads(model)
    ref = grads["reference_fp32_dense"]
    errors = {name: max_relative_diff(ref, grads[name]) for name in ("dense_bf16", "reuse_bf16")}
    expected = "SequentialMLP" if dry_run else "TEGroupedMLP"
    ok = (settings["expert_mlp"] == [expected] and 0 < errors["dense_bf16"] < 0.2 and errors["reuse_bf16"] <= 1.5 * errors["dense_bf16"]
          and abs(aux["reuse_bf16"] - aux["dense_bf16"]) <= 2e-2 * abs(aux["dense_bf16"])
          and abs(results["reuse_bf16"] - results["dense_bf16"])
          <= 2e-2 * max(1.0, abs(results["dense_bf16"])))
    return dict(claim=f"MoE, {settings['spec']}, bf16: a dense step (the plan's packing) and a "
                      "prefix-reuse step are equally close to an fp32 dense reference (reuse "
                      "error <= 1.5 x dense error); logged aux losses and losses agree",
                ok=ok, settings=settings, model=shape, workload=dict(work),
                grad_rel_err_vs_fp32=errors, losses=results, aux_loss=aux)
