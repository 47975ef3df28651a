"""The MoE fields of TransformerConfig, classified for prefix reuse (part of config_support.py).

Reuse equals dense for MoE when routing is token-local and dropless and every router statistic
counts prefix tokens with their multiplicity ([Note: logical prefix tokens],
prefix_schedule/runtime/router_stats.py; megatron_patches/runtime/moe.py). Token dropping (expert
capacity) keeps the top tokens of a microbatch, so a prefix token's dense copies could be kept in
one microbatch and dropped in another; sinkhorn and quantile balancing couple all tokens of a
microbatch; jitter and forced random logits draw per routed copy; routing replay replays dense
tokens: all refused. Run-time checks that need the process groups are in moe.check_moe_supported.
"""

from __future__ import annotations

from typing import Dict

from megatron_patches.config.config_rules import Rule, group, refuse

__all__ = ["MOE_RULES", "SUPPORTED_LOAD_BALANCING"]

_TEST = "tests/test_moe.py (reuse == stock dense with the same packing, fp32)"
SUPPORTED_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_BATCH_COUPLED = ("routing couples the tokens of a microbatch (or draws per routed copy), so a "
                  "prefix routed once cannot equal its dense copies")


def _load_balancing_ok(value) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(v in SUPPORTED_LOAD_BALANCING for v in values)


def _merge(*parts: Dict[str, Rule]) -> Dict[str, Rule]:
    merged: Dict[str, Rule] = {}
    for part in parts:
        merged.update(part)
    return merged


MOE_RULES: Dict[str, Rule] = _merge(
    group("supported", _TEST, "num_moe_experts moe_ffn_hidden_size moe_router_topk "
          "moe_aux_loss_coeff moe_z_loss_coeff moe_router_enable_expert_bias "
          "moe_router_bias_update_rate moe_layer_freq moe_shared_expert_intermediate_size "
          "moe_router_score_function"),
    {"moe_router_load_balancing_type": Rule(
        "supported", _TEST, allowed=_load_balancing_ok, example="sinkhorn",
        fix="only " + ", ".join(SUPPORTED_LOAD_BALANCING) + " load balancing equals dense "
            "with a shared prefix: sinkhorn and quantile_balancing " + _BATCH_COUPLED)},
    {"moe_token_dispatcher_type": Rule(
        "supported", _TEST, allowed=lambda v: v in ("allgather", "alltoall"),
        example="flex", fix="use the allgather or alltoall token dispatcher (flex / DeepEP / "
                            "HybridEP are not verified with prefix reuse)")},
    group("supported", "tests/test_moe_parallel.py (EP=2; EP=2 x PP=2; gloo)",
          "expert_model_parallel_size"),
    group("irrelevant", "per-token math: the same function of each routed token (expert "
          "kernels, group-limited top-k of one token, permutation fusion)", "moe_grouped_gemm "
          "moe_single_grouped_weight moe_single_grouped_bias moe_permute_fusion "
          "moe_router_pre_softmax moe_router_topk_scaling_factor moe_router_dtype "
          "moe_shared_expert_gate "
          "moe_router_num_groups moe_router_group_topk moe_mlp_glu_interleave_size "
          "use_grouped_gemm_for_shared_expert moe_shared_expert_glu_interleave_size "
          "moe_router_topk_limited_devices"),
    group("irrelevant", "logging, scheduling and communication overlap knobs",
          "moe_per_layer_logging moe_grad_scale_func overlap_moe_expert_parallel_comm "
          "overlap_dispatch_backward_with_experts_wgrad ep_overlap_early_attn_memory_release "
          "high_priority_a2a_comm_stream moe_shared_expert_overlap moe_flex_dispatcher_num_sms "
          "moe_deepep_num_sms moe_hybridep_num_sms moe_hybridep_num_blocks_permute "
          "moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms_preprocessing "
          "moe_ncclep_static_shape moe_ncclep_zero_copy moe_permute_fusion_into_hybridep "
          "moe_hybridep_pad_uneven_dispatch_inputs moe_flex_dispatcher_backend"),
    group("irrelevant", "only read with token dropping (refused) or paged stash (refused)",
          "moe_token_drop_policy moe_expert_rank_capacity_factor "
          "moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda "
          "moe_paged_stash_buffer_size_factor_cpu moe_router_quantile_balancing_ema"),
    group("irrelevant", "inference only", "moe_pad_experts_for_cuda_graph_inference"),
    refuse("moe_expert_capacity_factor", "token dropping", "token dropping keeps the top "
           "tokens per expert within a microbatch, so a prefix token's dense copies can be kept "
           "in one microbatch and dropped in another: use dropless MoE "
           "(moe_expert_capacity_factor=None)", 1.0, allowed=lambda v: v is None),
    refuse("moe_pad_expert_input_to_capacity", "token dropping", "padding to capacity needs "
           "a capacity factor (token dropping), which prefix reuse refuses", True),
    refuse("moe_token_dropping", "token dropping", "token dropping cannot equal dense with a "
           "shared prefix; use dropless MoE", True),
    refuse("moe_input_jitter_eps", "jitter", "input jitter draws noise per routed copy: dense "
           "draws G for a prefix token, reuse one; set moe_input_jitter_eps=None", 0.01,
           allowed=lambda v: v is None),
    refuse("moe_router_force_load_balancing", "random routing", "forced random logits are "
           "drawn per routed copy; benchmark-only, turn it off for reuse", True),
    refuse("moe_router_force_biased", "random routing", "forced biased logits are "
           "not verified with prefix reuse; set moe_router_force_biased=None", 0.1,
           allowed=lambda v: v is None),
    refuse("moe_enable_routing_replay", "routing replay", "routing replay replays routes "
           "recorded for dense tokens; not verified with prefix reuse", True),
    refuse("moe_router_padding_for_quantization", "routing-map padding", "padding the "
           "routing map per expert couples the tokens of a microbatch", True),
    refuse("moe_router_padding_for_fp8", "routing-map padding", "padding the routing map per "
           "expert couples the tokens of a microbatch", True),
    refuse("moe_router_fusion", "fused router", "the fused (Transformer Engine) router kernels "
           "are not verified with logical prefix-token accounting; set moe_router_fusion=False",
           True),
    refuse("moe_layer_recompute", "recompute", "recomputing MoE layers would re-run the prefix "
           "router outside Phase A; set moe_layer_recompute=False", True),
    refuse("moe_enable_deepep", "DeepEP", "the DeepEP dispatcher is not verified with prefix "
           "reuse; use allgather or alltoall", True),
    refuse("moe_apply_probs_on_input", "probs on input", "moe_apply_probs_on_input is not "
           "verified with prefix reuse", True),
    refuse("moe_latent_size", "latent MoE", "latent MoE is not verified with prefix reuse",
           64, allowed=lambda v: v is None),
    refuse("moe_paged_stash", "paged stash", "the paged-stash kernels need CUDA and are not "
           "verified with prefix reuse", True),
    group("supported", "tests/test_moe_parallel.py (TP=2 x ETP=2; EP=2 x TP=2 x ETP=2; gloo): "
          "experts split over the expert-tensor-parallel ranks are a per-token function; the "
          "executor checks that those ranks run the same plan; moe.check_moe_supported refuses "
          "expert TP other than TP",
          "expert_tensor_parallel_size"),
    group("irrelevant", "read only with MoE; moe.check_moe_supported refuses expert GTP (weight "
          "shards beyond expert_tensor_parallel_size; Megatron-LM sets it to ETP for dense models "
          "too)", "expert_tensor_parallel_num_weight_shards expert_gtp_weight_remat_size"),
)
