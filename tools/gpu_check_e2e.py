"""gpu_check.py, phase 3: one training step, dense vs prefix reuse, with Megatron's TE layer spec.

How the reuse hooks fit the TE spec (megatron-core 0.19.2, transformer/attention.py
Attention.forward): RoPE is applied in Attention.forward before `_run_core_attention` --
`apply_rotary_pos_emb` (TE's fused kernel when `apply_rope_fusion=True`) or the fused
qkv+RoPE path (`fused_single_qkv_rope`) -- so the hook sees post-RoPE q/k either way, with the
positions its GPTModel._preprocess hook gave the RoPE table (TE's fused RoPE takes the table per
token: sbhd freqs [s, 1, 1, d]). Without the hook, TEDotProductAttention receives q [s, b, h, d],
k/v [s, b, g, d] (sbhd), attention_mask None, attn_mask_type causal, packed_seq_params None,
and returns [s, b, h*d], the shape the hook returns. Its softmax scale is config.softmax_scale or
1/sqrt(kv_channels) (TE DotProductAttention.__init__), the hook's is core_attention.softmax_scale,
else config.softmax_scale, else 1/sqrt(d): equal.

Settings where the hook is exact and that this check uses: attention dropout 0, no context
parallelism, no sliding window, vanilla softmax, qk_layernorm off, apply_rope_fusion on (the
production default of megatron.training), gradient_accumulation_fusion off (it needs DDP's
main_grad), attention_backend=fused: dense runs TEDotProductAttention on cuDNN's fused kernel
(Megatron's LanguageModule sets NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=1, NVTE_UNFUSED_ATTN=0), reuse
runs the `transformer_engine` backend on the same kernel family. Both bf16 runs are compared with
an fp32 dense reference of the same (bf16-rounded) weights, the TE spec with Megatron's unfused
core attention: reuse's distance from it must be at most 1.5x dense's, as
tests/test_equivalence.py asks on CPU.
"""
from __future__ import annotations

import statistics

import torch

from benchlib.steps import dense_step, private_rendezvous, reuse_step
from benchlib.timing import PhaseMemory, RegionTimer
from benchlib.workload import make_batch

LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GPU_SHAPE = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                 num_query_groups=2, vocab_size=4096)  # head_dim 128, GQA 4:1
DRY_SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)
GPU_WORK = dict(prefix_len=1536, suffix_len=256, group_size=4, num_groups=2)
DRY_WORK = dict(prefix_len=40, suffix_len=8, group_size=3, num_groups=2)


def build_te_model(cfg, seed: int, *, exact_attention: bool = False, **overrides):
    """build_model's GPTModel with get_gpt_layer_with_transformer_engine_spec (CUDA, TE);
    `exact_attention` swaps its core attention for Megatron's unfused DotProductAttention (the
    fp32 reference: TE's fused kernels take fp16/bf16 only)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron_patches.models.tiny import make_transformer_config

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    config = make_transformer_config(cfg, **overrides)
    spec = get_gpt_layer_with_transformer_engine_spec()
    if exact_attention:
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_len,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=10000)
    return model.to(cfg.params_dtype).cuda()


def _models(dry_run: bool, shape: dict, max_seq_len: int):
    """(bf16 model, fp32 reference with the same bf16-rounded weights, settings)."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    cfg16 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len, params_dtype=torch.bfloat16)
    cfg32 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len)
    if dry_run:
        settings = dict(spec="local (get_gpt_layer_local_spec; dry-run stand-in)", apply_rope_fusion=False)
        model16, model32 = build_model(cfg16, seed=3), build_model(cfg32, seed=4)
    else:
        from megatron.core.transformer.enums import AttnBackend

        settings = dict(spec="get_gpt_layer_with_transformer_engine_spec()", apply_rope_fusion=True,
                        attention_backend="fused (Megatron sets NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=1, "
                                          "NVTE_UNFUSED_ATTN=0)",
                        reference="the same TE spec in fp32 with Megatron's unfused core attention")
        kw = dict(apply_rope_fusion=True, attention_backend=AttnBackend.fused)
        model16 = build_te_model(cfg16, 3, **kw)
        model32 = build_te_model(cfg32, 4, exact_attention=True, **kw)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    for model in (model16, model32):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    settings.update(attention_dropout=0.0, context_parallel=1, window_size=None,
                    softmax_type="vanilla", qk_layernorm=False, gradient_accumulation_fusion=False)
    return model16, model32, settings


def _phase(name, model, run, device, warmup, repeats):
    """Run `run` warmup + repeats times (gradients cleared before each); time each (synchronized)
    and the allocator's peak over the phase; the last run's loss and fp32 gradients."""
    from megatron_patches.training import param_grads, zero_grads

    times = []
    with PhaseMemory(device) as memory:
        for i in range(warmup + repeats):
            zero_grads(model)
            with RegionTimer(device) as timer:
                loss = run().loss
            if i >= warmup:
                times.append(timer.seconds * 1e3)
    grads = param_grads(model)
    zero_grads(model)
    row = dict(phase=name, ms=statistics.median(times), loss=loss, warmup=warmup, repeats=repeats,
               timing_basis=timer.basis,
               peak_mib=None if memory.peak_bytes is None else memory.peak_bytes / 2**20,
               peak_extra_mib=None if memory.peak_extra_bytes is None else memory.peak_extra_bytes / 2**20)
    return row, grads


def _add_model_peaks(phases, model, batch, plan, loss) -> None:
    """The device-memory accounting model's peak (tools/memory_probe.py, one more untimed step)
    beside each bf16 phase's allocator peak above its start (`peak_extra_mib`): on a GPU this is
    the check of the model; parameters, gradients and allocator slack are outside both."""
    import memory_probe
    from megatron_patches.training import zero_grads
    from prefix_schedule.runtime.step import ReuseStep

    for row in phases:
        name = row["phase"]
        if name == "dense_bf16":
            report = memory_probe.measure_dense(model, lambda: dense_step(model, batch, loss))
        elif name.startswith("reuse_bf16"):
            step = ReuseStep(batch, plan, offload_prefix_activations="offload" in name)
            report = memory_probe.measure_reuse(
                model, step, lambda s: reuse_step(model, batch, plan, loss, step=s))
        else:
            continue
        zero_grads(model)
        row["model_peak_mib"] = report.peak_saved_bytes / 2**20


def run(device, *, dry_run: bool, warmup: int = 1, repeats: int = 2) -> dict:
    import megatron_patches
    from megatron_patches.models.tiny import initialize_single_process
    from megatron_patches.training import max_relative_diff
    from prefix_schedule.attention.backends import set_default_backend
    from prefix_schedule.losses import PolicyLossConfig
    from prefix_schedule.planning.planner import plan_microbatches

    shape, work = (DRY_SHAPE, DRY_WORK) if dry_run else (GPU_SHAPE, GPU_WORK)
    max_seq_len = work["prefix_len"] + work["suffix_len"]
    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    megatron_patches.install()
    private_rendezvous()
    initialize_single_process(seed=1234)
    backend = "torch" if dry_run else "transformer_engine"
    set_default_backend(backend)
    model16, model32, settings = _models(dry_run, shape, max_seq_len)
    settings.update(reuse_attention_backend=backend, dense_core_attention=(
        "Megatron local DotProductAttention (dry run)" if dry_run else
        "TEDotProductAttention on cuDNN fused attention (NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=1)"))
    batch = make_batch(**work, vocab_size=shape["vocab_size"], seed=5)
    budget = work["group_size"] * work["suffix_len"]
    plan = plan_microbatches(batch, token_budget=budget, max_seq_len=max_seq_len)
    loss = PolicyLossConfig(**LOSS_KW)
    phases, grads = [], {}
    for name, model, fn in (
            ("reference_fp32_dense", model32, lambda: dense_step(model32, batch, loss)),
            ("dense_bf16", model16, lambda: dense_step(model16, batch, loss)),
            ("reuse_bf16", model16, lambda: reuse_step(model16, batch, plan, loss)),
            ("reuse_bf16_offload_prefix_activations", model16,
             lambda: reuse_step(model16, batch, plan, loss, offload_prefix_activations=True))):
        row, grads[name] = _phase(name, model, fn, device, warmup, repeats)
        phases.append(row)
    _add_model_peaks(phases, model16, batch, plan, loss)
    ref = grads["reference_fp32_dense"]
    errors = {name: max_relative_diff(ref, grads[name]) for name in grads if name != "reference_fp32_dense"}
    losses = {row["phase"]: row["loss"] for row in phases}
    dense_err, reuse_err = errors["dense_bf16"], errors["reuse_bf16"]
    ok = (0 < dense_err < 0.2 and reuse_err <= 1.5 * dense_err
          and errors["reuse_bf16_offload_prefix_activations"] <= 1.5 * dense_err
          and abs(losses["reuse_bf16"] - losses["dense_bf16"]) <= 2e-2 * max(1.0, abs(losses["dense_bf16"])))
    return dict(
        claim=f"{settings['spec']}, bf16: one dense and one prefix-reuse step (hooks + "
              f"{backend} backend; also with offloaded prefix activations) are equally close to "
              "an fp32 dense reference of the same weights (reuse error <= 1.5 x dense error), "
              "losses agree; time and peak memory per phase",
        ok=ok, settings=settings, model=shape, workload=dict(work, token_budget=budget,
                                                             suffix_microbatches=len(plan.microbatches)),
        grad_rel_err_vs_fp32=errors, grad_rel_diff_reuse_vs_dense=max_relative_diff(
            grads["dense_bf16"], grads["reuse_bf16"]), losses=losses, phases=phases)
