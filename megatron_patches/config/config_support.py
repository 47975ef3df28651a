"""Every TransformerConfig field, classified for prefix reuse: supported / irrelevant / refused.

`check_config_supported(config)` runs in the reuse path before any compute (executor.
check_reuse_supported). A field is
- "supported": reuse honours it and a test holds reuse to dense (or to the float64 reference)
  with it; `allowed` may still exclude some values (e.g. recompute_granularity="full");
- "irrelevant": it cannot make reuse differ from dense: per-token math that runs identically
  on a prefix, suffix or dense row (norms, MLP, fusions, init), options read only by features
  that are refused here (MoE, MTP, CP, fp8, ...), or performance / logging / inference knobs;
- "refused": any value but the harmless one is a ValueError naming the field and what to do.
The table is checked against the dataclass fields (tests/test_config_support.py), so a field a
newer Megatron adds fails that test until someone classifies it; at run time an unclassified
field is refused unless it holds its default.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from megatron_patches.config.config_rules import Rule, group as _group, refuse as _refuse
from megatron_patches.config.config_support_moe import MOE_RULES

GDN_VARIANTS = ("gated_delta_net", "gdn")
"""experimental_attention_variant values that build Megatron's GatedDeltaNet layer, which the
gdn-state-hook hooks: 'gated_delta_net' (megatron-core 0.19.x; a deprecated alias on main) and
'gdn' (Megatron-LM main, 0.20.0, which normalises the alias to it). Main's 'gdn2'
(GatedDeltaNet2) is another layer, not hooked."""


def is_gdn_variant(value) -> bool:
    """Whether an experimental_attention_variant value builds hooked GatedDeltaNet layers."""
    return value in GDN_VARIANTS

__all__ = ["Rule", "FIELD_RULES", "MLA_RULES", "check_config_supported", "mla_problems",
           "unclassified_fields"]


def _merge(*parts: Dict[str, Rule]) -> Dict[str, Rule]:
    merged: Dict[str, Rule] = {}
    for part in parts:
        twice = merged.keys() & part.keys()
        if twice:
            raise AssertionError(f"classified twice: {sorted(twice)}")
        merged.update(part)
    return merged


_REF = "tests/test_reference.py (float64 reference, Llama / Llama 3.1 / Qwen3)"
_VARIANTS = "tests/test_config_support.py::test_supported_option_reuse_equals_dense"
_UNVERIFIED = "not verified against dense training yet"
_MLA = "tests/test_mla.py (MLA reuse == stock dense: PP=1/2, TP=2, prefix chunks, MoE EP=2, yarn)"
_MTP_WHY = (
    "multi-token prediction (mtp_num_layers) is not supported with prefix reuse: Megatron's MTP "
    "block runs after the last decoder layer on every position of the row (its inputs are the "
    "final hidden states and the embeddings of the next tokens, rolled along the sequence), so "
    "a suffix's MTP depth k needs the prefix's last k positions' final hidden states and the "
    "prefix's own MTP loss terms, which a reuse step never computes (Phase A stops after the "
    "last K/V); train with mtp_num_layers=None (the MTP weights stay as loaded)")
_DSA_WHY = (
    "its core attention (DSAttention) computes the indexer's keys from the row's own hidden "
    "states (the x and qr arguments MLA hands it) and keeps the top-k keys per query "
    "(dsa_indexer_topk) before the sparse attention and the indexer loss; a suffix row holds no "
    "prefix hidden states and the reuse cache keeps no prefix index keys, so the top-k set over "
    "the prefix would not be dense's; train DSA models without prefix reuse")
_SINKS_WINDOWS = ("tests/test_attention_sinks_windows.py (float64 reference), "
                  "tests/test_gptoss.py (reuse == stock dense, HF gpt_oss float64)")


def _causal_window(value) -> bool:
    return value is None or (len(value) == 2 and int(value[1]) == 0 and int(value[0]) >= -1)

FIELD_RULES: Dict[str, Rule] = _merge(
    _group("supported", _REF, "num_layers hidden_size num_attention_heads num_query_groups "
             "ffn_hidden_size kv_channels layernorm_epsilon qk_layernorm params_dtype"),
    _group("supported", _VARIANTS, "add_bias_linear add_qkv_bias gated_linear_unit "
             "activation_func normalization qk_l2_norm rotary_interleaved softmax_scale "
             "apply_residual_connection_post_layernorm attention_output_gate"),
    _group("supported", "tests/test_equivalence.py (bf16)", "bf16"),
    _group("supported", "tests/test_parallel_tp_dp.py, test_parallel_matrix.py",
             "tensor_model_parallel_size sequence_parallel"),
    _group("supported", "tests/test_pipeline.py", "pipeline_model_parallel_size "
             "pipeline_dtype"),
    _group("supported", "tests/test_reuse_megatron.py (DDP)", "finalize_model_grads_func "
             "no_sync_func"),
    _group("supported", "tests/test_pipeline_vpp.py (Megatron's interleaved schedule)",
             "virtual_pipeline_model_parallel_size"),
    _group("supported", "tests/test_production_settings.py (Megatron-LM's parser)",
             "deallocate_pipeline_outputs grad_sync_func"),
    _group("supported", "tests/test_executor_contract.py (buffers cleared and drained as "
             "Megatron's schedules; the fused wgrad kernels themselves need CUDA)",
             "defer_embedding_wgrad_compute"),
    _group("irrelevant", "overlap timing only: DDP's forward pre-hooks gather every parameter "
             "not gathered yet", "param_sync_func"),
    {"recompute_granularity": Rule(
        "supported", "tests/test_reuse_megatron.py (selective), tests/test_memory_megatron.py "
        "(full: uniform and block, PP=1 and PP=2), tests/test_moe_recompute.py (full, MoE)")},
    _group("supported", "tests/test_memory_megatron.py (full recompute, uniform and block)",
             "recompute_method recompute_num_layers"),
    _refuse("distribute_saved_activations", "full recompute with TP", "distribute_saved_"
              "activations=True is not verified with prefix reuse; leave it False", True),
    {"recompute_modules": Rule(
        "supported", _VARIANTS + " (core_attn, mlp)",
        allowed=lambda v: v is None or set(v) <= {"core_attn", "mlp"}, example=["layernorm"],
        fix="only recompute_modules 'core_attn' and 'mlp' are verified with prefix reuse")},
    {"context_parallel_size": Rule(
        "supported",
        "tests/test_context_parallel.py (CP=2 reuse == CP=1 stock dense; x TP, x TP/SP, x PP)",
        allowed=lambda v: isinstance(v, int) and v >= 1, example=0,
        fix="context_parallel_size must be an int >= 1")},
    {"calculate_per_token_loss": Rule(
        "supported", "every reuse test", allowed=bool, example=False,
        fix="prefix reuse needs calculate_per_token_loss=True (a token mean over the global "
            "batch that does not depend on how groups are packed into microbatches)")},
    # ---- refused: features whose math or bookkeeping the reuse path does not reproduce
    _refuse("hidden_dropout", "dropout masks", "dropout > 0: dense training draws a prefix "
              "dropout mask per trajectory, reuse one per group, so they are different "
              "estimators; set hidden_dropout=attention_dropout=0", 0.1),
    _refuse("attention_dropout", "dropout masks", "dropout > 0: dense training draws a prefix "
              "dropout mask per trajectory, reuse one per group, so they are different "
              "estimators; set hidden_dropout=attention_dropout=0", 0.1),
    {"multi_latent_attention": Rule(
        "supported", _MLA + "; in a HybridModel pattern ('+') it is refused "
        "(megatron_patches/runtime/layers.py)")},
    {"window_size": Rule(
        "supported", _SINKS_WINDOWS, allowed=_causal_window, example=(128, 4),
        fix="prefix reuse runs causal sliding windows only: window_size=(W, 0) with W >= 0 "
            "(or None)")},
    {"window_attn_skip_freq": Rule("supported", _SINKS_WINDOWS)},
    {"softmax_type": Rule(
        "supported", _SINKS_WINDOWS, allowed=lambda v: v in ("vanilla", "learnable"),
        example="off-by-one", fix="softmax_type must be 'vanilla' or 'learnable' (attention "
        "sinks) with prefix reuse; 'off-by-one' is not verified against dense training")},
    _refuse("apply_query_key_layer_scaling", "scale", "apply_query_key_layer_scaling "
              "divides the core attention's softmax scale by the layer number (and multiplies "
              "back inside its fp32 softmax); the reuse attention computes softmax in fp32 "
              "with the plain scale: set apply_query_key_layer_scaling=False (same math)", True),
    _refuse("qk_clip", "max logit", "qk_clip needs the max attention logit from the core "
              "attention, which the reuse hook replaces; set qk_clip=False", True),
    _refuse("log_max_attention_logit", "max logit", "log_max_attention_logit needs the core "
              "attention's logits, which the reuse hook replaces; set it False", True),
    _refuse("mtp_num_layers", "MTP", _MTP_WHY, 1, allowed=lambda v: not v),
    _refuse("no_rope_freq", "NoPE layers", "no_rope_freq (layers without RoPE) is "
              + _UNVERIFIED, 4, allowed=lambda v: v is None),
    _refuse("experimental_attention_variant", "attention variant", "experimental attention "
              "variants other than Gated DeltaNet ('gated_delta_net', main's 'gdn') are not hooked by "
              "prefix reuse. 'dsa' (DeepSeek sparse attention): " + _DSA_WHY, "dsa",
              allowed=lambda v: v is None or is_gdn_variant(v)),
    _refuse("use_mamba_mem_eff_path", "Mamba inference path", "use_mamba_mem_eff_path=False "
              "trains Mamba layers through their inference (prefill) path, which prefix reuse "
              "does not hook; keep the default True", False, allowed=lambda v: v),
    _refuse("heterogeneous_block_specs", "per-layer configs", "heterogeneous block specs "
              "(per-layer configs) are not classified for prefix reuse", True),
    _refuse("use_mup", "muP", "muP scaling is " + _UNVERIFIED, True),
    _refuse("fp16", "fp16", "fp16 training is " + _UNVERIFIED + "; use bf16 or fp32", True),
    _refuse("fp32_residual_connection", "residual dtype",
              "fp32_residual_connection is " + _UNVERIFIED, True),
    _refuse("fp8", "fp8", "fp8 amax statistics would see each prefix once instead of G "
              "times (not dense's scales); fp8 is " + _UNVERIFIED, "hybrid",
              allowed=lambda v: v is None),
    _refuse("fp4", "fp4", "fp4 is " + _UNVERIFIED, "nvfp4", allowed=lambda v: v is None),
    _refuse("quant_recipe", "quantization", "quant_recipe is " + _UNVERIFIED, "x",
              allowed=lambda v: v is None),
    _refuse("use_kitchen", "quantization", "kitchen quantized layers are " + _UNVERIFIED,
              True),
    _refuse("fused_single_qkv_rope", "fused RoPE", "fused_single_qkv_rope is " + _UNVERIFIED
              + " with the per-token RoPE table of reuse rows", True),
    _refuse("tp_comm_overlap", "static shapes", "tp_comm_overlap needs static row shapes "
              "(user buffers); reuse rows vary in length", True),
    _refuse("delay_wgrad_compute", "deferred wgrad", "delay_wgrad_compute needs the schedule "
              "to run the deferred weight gradients; the reuse executor does not", True),
    _refuse("enable_cuda_graph", "CUDA graphs", "CUDA graphs capture static shapes and no "
              "Python hooks; turn them off for reuse steps", True),
    _refuse("external_cuda_graph", "CUDA graphs", "CUDA graphs capture static shapes and no "
              "Python hooks; turn them off for reuse steps", True),
    _refuse("cuda_graph_impl", "CUDA graphs", "CUDA graphs capture static shapes and no "
              "Python hooks; set cuda_graph_impl='none'", "local",
              allowed=lambda v: v in (None, "none")),
    _refuse("cpu_offloading", "offload", "Megatron's cpu_offloading is " + _UNVERIFIED
              + "; ReuseStep(offload_prefix_activations=True) offloads prefix activations",
              True),
    _refuse("fine_grained_activation_offloading", "offload", "fine-grained activation "
              "offloading is " + _UNVERIFIED, True),
    _refuse("hybrid_context_parallel", "CP", "hybrid context parallelism is not supported",
              True),
    _refuse("max_seqlen_per_dp_cp_rank", "CP", "max_seqlen_per_dp_cp_rank (CP packing) is "
              "not supported", 4096, allowed=lambda v: v is None),
    # tensor_parallel_num_weight_shards = TP x gtp_weight_remat_size (ModelParallelConfig derives
    # the latter from it; Megatron-LM's arguments set it to TP): only gtp_weight_remat_size > 1
    # is weight sharding, and that is refused below.
    _group("irrelevant", "TP x gtp_weight_remat_size (the latter refused unless 1)",
           "tensor_parallel_num_weight_shards"),
    _refuse("gtp_weight_remat_size", "weight sharding", "weight-sharded tensor parallelism is "
              + _UNVERIFIED, 2, allowed=lambda v: v == 1),
    _refuse("num_layers_in_first_pipeline_stage", "uneven PP", "uneven pipeline splits are "
              + _UNVERIFIED, 1, allowed=lambda v: v is None),
    _refuse("num_layers_in_last_pipeline_stage", "uneven PP", "uneven pipeline splits are "
              + _UNVERIFIED, 1, allowed=lambda v: v is None),
    _refuse("pipeline_model_parallel_layout", "uneven PP", "custom pipeline layouts are "
              + _UNVERIFIED, "Et|tL", allowed=lambda v: v is None),
    _refuse("account_for_embedding_in_pipeline_split", "uneven PP", "uneven pipeline splits "
              "are " + _UNVERIFIED, True),
    _refuse("account_for_loss_in_pipeline_split", "uneven PP", "uneven pipeline splits are "
              + _UNVERIFIED, True),
    # ---- irrelevant
    _group("irrelevant", "per-token math: the same function of each token on a prefix, "
             "suffix or dense row", "layernorm_zero_centered_gamma glu_linear_offset "
             "activation_func_clamp_value disable_bf16_reduced_precision_matmul "
             "bias_activation_fusion masked_softmax_fusion persist_layer_norm "
             "memory_efficient_layer_norm bias_dropout_fusion apply_rope_fusion "
             "use_fused_weighted_squared_relu fused_residual_rmsnorm "
             "use_transformer_engine_op_fuser use_te_activation_func mlp_chunks_for_training "
             "use_grouped_gemm_for_dense_mlp gradient_accumulation_fusion "
             "attention_softmax_in_fp32 enable_autocast autocast_dtype grad_scale_func"),
    _group("irrelevant", "dense kernel choice: the reuse hook runs its own attention "
             "(prefix_schedule.attention.backends)", "attention_backend "
             "flash_attention_version transformer_impl"),
    _group("irrelevant", "initialisation", "perform_initialization use_cpu_initialization "
             "init_method output_layer_init_method init_method_std embedding_init_method "
             "embedding_init_method_std init_model_with_meta_device"),
    _group("irrelevant", "set by Megatron-LM for every --hybrid-layer-pattern model; read only "
             "by the output-layer init scaling (transformer_config.py). A HybridModel's layers "
             "are checked per pattern symbol before compute (layers.check_layers_supported)",
             "is_hybrid_model"),
    _group("irrelevant", "loss fusion of GPTModel(labels=...): the RL forward step computes "
             "its own log-probs", "cross_entropy_loss_fusion cross_entropy_fusion_impl"),
    _group("irrelevant", "pipeline p2p / memory knobs of the stock schedules (the reuse "
             "executor derives shapes from the plan and orders p2p itself)",
             "pipeline_model_parallel_comm_backend variable_seq_lengths overlap_p2p_comm "
             "batch_p2p_comm batch_p2p_sync use_ring_exchange_p2p "
             "wgrad_deferral_limit overlap_p2p_comm_warmup_flush "
             "microbatch_group_size_per_vp_stage num_microbatches_with_partial_activation_checkpoints"),
    _group("irrelevant", "only read with tp_comm_overlap (refused)", "tp_comm_bulk_wgrad "
             "tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad "
             "tp_comm_split_ag tp_comm_atomic_ag tp_comm_split_rs tp_comm_atomic_rs "
             "tp_comm_overlap_disable_qkv tp_comm_overlap_disable_fc1 tp_comm_bootstrap_backend"),
    _group("irrelevant", "the dense CP kernel's choice: reuse steps gather K/V over the CP "
             "group themselves (runtime/cp.py), whatever TE's cp_comm_type",
             "hierarchical_context_parallel_sizes cp_comm_type"),
    _group("irrelevant", "only read with MTP (refused)", "mtp_loss_scaling_factor "
             "mtp_use_repeated_layer mtp_detach_heads mtp_hybrid_override_pattern "
             "mtp_standalone mtp_grad_scale_func"),
    _group("irrelevant", "only read with fp8 / fp4 (refused)", "activation_func_fp8_input_store "
             "fp8_recipe fp8_param fp8_quantizer_factory fp8_margin fp8_interval "
             "fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad fp8_output_proj "
             "fp8_dot_product_attention fp8_multi_head_attention tp_only_amax_red "
             "first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 "
             "fp4_recipe fp4_param fp4_quantizer_factory"),
    _group("irrelevant", "only read with use_kitchen (refused)", "use_kitchen_attention "
             "kitchen_attention_backend"),
    _group("irrelevant", "only read with qk_clip / muP / attention variants / "
             "linear attention / Mamba / mrope (refused)", "qk_clip_alpha qk_clip_threshold "
             "mup_width_mult mup_base_hidden_size mup_embedding_mult "
             "mup_output_mult mup_base_head_dim mup_attn_scale_power "
             "experimental_attention_variant_loss_scale_func dsa_indexer_n_heads "
             "dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq "
             "dsa_indexer_skip_topk_offset dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss "
             "dsa_kernel_backend dsa_indexer_rope_interleaved dsa_indexer_rotate_activation "
             "dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 "
             "mrope_section hetereogenous_dist_checkpoint"),
    _group("supported", "Mamba-2 layers (HybridModel 'M'): each caches its SSD state and conv "
             "tail per group (megatron_patches/runtime/mamba_hooks.py)", "mamba_state_dim "
             "mamba_head_dim mamba_num_groups mamba_num_heads mamba_training_ssm_states_dtype"),
    _group("supported", "Gated DeltaNet layers (experimental_attention_variant="
             "'gated_delta_net', or 'gdn' on main): each caches its recurrent state and conv tail per group "
             "(megatron_patches/runtime/gdn_hooks.py)", "linear_attention_freq linear_conv_kernel_dim "
             "linear_key_head_dim linear_value_head_dim linear_num_key_heads "
             "linear_num_value_heads"),
    MOE_RULES,
    _group("irrelevant", "only read with CUDA graphs / offloading (refused)",
             "cuda_graph_use_single_mempool cuda_graph_retain_backward_graph "
             "cuda_graph_warmup_steps cuda_graph_modules inference_cuda_graph_scope "
             "cuda_graph_scope cpu_offloading_num_layers _cpu_offloading_context "
             "cpu_offloading_activations cpu_offloading_weights cpu_offloading_double_buffering "
             "cpu_offloading_retain_pinned_cpu_buffers offload_modules min_offloaded_tensor_size "
             "delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks "
             "activation_offload_fraction fine_grained_offloading_max_inflight_offloads"),
    _group("irrelevant", "inference only (a training step never reads it)", "flash_decode "
             "inference_rng_tracker inference_sampling_seed nccl_all_reduce_for_prefill "
             "use_inference_optimized_layers inference_fuse_tp_communication "
             "inference_disable_triton_nvls_kernels inference_grouped_gemm_backend "
             "inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type "
             "mlp_chunks_for_prefill"),
    _group("irrelevant", "logging, timing, determinism and communication knobs", "timers "
             "deterministic_mode use_te_rng_tracker test_mode clone_scatter_output_in_embedding "
             "disable_parameter_transpose_cache config_logger_dir batch_invariant_mode "
             "symmetric_ar_type barrier_with_L1_time"),
)


MLA_RULES: Dict[str, Rule] = _merge(
    _group("supported", _MLA, "q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim "
             "v_head_dim rope_type rotary_base rotary_percent rotary_scaling_factor "
             "original_max_position_embeddings beta_fast beta_slow mscale mscale_all_dim"),
    _group("irrelevant", "per-token math: fuses the q/kv down-projections (same products per "
             "token, before the reuse hooks)", "mla_down_proj_fusion"),
    _refuse("cache_mla_latents", "MLA inference", "cache_mla_latents is an inference option "
              "(Megatron refuses it in training); leave it False", True),
)
"""The fields MLATransformerConfig adds to TransformerConfig (multi_latent_attention=True)."""


def _rule(name: str):
    return FIELD_RULES.get(name) or MLA_RULES.get(name)


def unclassified_fields(config_cls) -> list:
    """Dataclass fields of `config_cls` that FIELD_RULES (and MLA_RULES) do not classify."""
    return sorted(f.name for f in dataclasses.fields(config_cls) if _rule(f.name) is None)


def mla_problems(config) -> list:
    """Cross-field rules of MLA in reuse steps (see megatron_patches/runtime/mla_hooks.py)."""
    if not getattr(config, "multi_latent_attention", False):
        return []
    problems = []
    if config.context_parallel_size > 1:
        problems.append("multi_latent_attention with context_parallel_size > 1: the reuse CP "
                        "path gathers K/V of one head dim and hands MLA no per-token RoPE table; "
                        "use context_parallel_size=1")
    if config.apply_rope_fusion:
        problems.append("multi_latent_attention with apply_rope_fusion=True: the fused MLA RoPE "
                        "kernel takes cos/sin of positions 0..L-1, not a suffix's positions "
                        "after its prefix; set apply_rope_fusion=False")
    if config.sequence_parallel:
        problems.append("multi_latent_attention with sequence_parallel=True is " + _UNVERIFIED
                        + " (MLA gathers its latent and k_pe over TP inside the layer); set "
                        "sequence_parallel=False")
    if config.virtual_pipeline_model_parallel_size:
        problems.append("multi_latent_attention with virtual pipeline stages is " + _UNVERIFIED
                        + "; use virtual_pipeline_model_parallel_size=None")
    if getattr(config, "rope_type", "rope") not in ("rope", "yarn"):
        problems.append(f"rope_type={config.rope_type!r}: MLA builds 'rope' or 'yarn'")
    return problems


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def check_config_supported(config, *, global_loss_contract: bool = False) -> None:
    """ValueError (before any compute) for every config value prefix reuse would not honour.
    `global_loss_contract`: the step's loss returns `(loss, report)` already normalised over the
    global batch and multiplied by the step's microbatch count (the framework adapter,
    megatron_patches/frameworks): then calculate_per_token_loss=False is exact too."""
    problems = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if global_loss_contract and field.name == "calculate_per_token_loss":
            continue
        rule = _rule(field.name)
        if rule is None:
            if value is not _default(field) and value != _default(field):
                problems.append(
                    f"{field.name}={value!r} is not classified for prefix reuse (a newer "
                    "Megatron field?); leave it at its default or classify it in "
                    "megatron_patches/config/config_support.py")
        elif rule.allowed is not None and not rule.allowed(value):
            problems.append(f"{field.name}={value!r}: {rule.fix}")
    problems += mla_problems(config)
    if config.context_parallel_size > 1 and (config.window_size is not None
                                             or config.softmax_type != "vanilla"):
        problems.append("context_parallel_size > 1 with window_size or softmax_type "
                        "'learnable': the zigzag CP attention of prefix reuse has no sinks or "
                        "windows; use context_parallel_size=1")
    if problems:
        raise ValueError("prefix reuse cannot honour this TransformerConfig:\n  - "
                         + "\n  - ".join(problems))
