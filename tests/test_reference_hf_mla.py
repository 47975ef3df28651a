"""Outside reference of the MLA REUSE path: transformers' DeepseekV3ForCausalLM in float64 with
the weights of our Megatron MLA model (DeepSeek-V3 tiny twin: q LoRA, KV latent, Q/K head dim
24 vs V 12, yarn RoPE with factor 40 and mscale_all_dim 1, interleaved rope dims) computes full
sequences [prefix; suffix]; a float64 prefix-reuse step of the Megatron model (Phase A once per
group, suffix microbatches over the cached per-head K/V, Phase C) must give the same loss and
every parameter gradient. The loss, written out here on HF's log-probs: per masked suffix
token -A * exp(logp - old_logp) (PolicyLossConfig with clipping out of reach, no KL, no
entropy), summed and divided by the masked token count. Weight layout: Megatron's
linear_q_down_proj / q_layernorm / linear_q_up_proj / linear_kv_down_proj / kv_layernorm /
linear_kv_up_proj / linear_proj are HF's q_a_proj / q_a_layernorm / q_b_proj /
kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj, row for row (per head [nope; rope]
for q, [nope; v] for kv_b); linear_fc1 is [gate; up]. MoE layers: Megatron's router (sigmoid,
expert bias, grouped top-k, scaling 2.5) is HF's gate with e_score_correction_bias (no load-balancing loss here: HF computes none).
Both models run in float64 but build their RoPE tables in float32 (Megatron's inv_freq and yarn
ramp, HF's rotary embedding), so agreement is at that level (~1e-7 relative seen); a layout
slip is off by O(1e-3) or more."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_equivalence import make_batch  # noqa: E402

pytestmark = pytest.mark.megatron

SHAPES = [(21, [6, 9, 4]), (13, [5, 3])]
REL = 1e-6  # float64 models, fp32 RoPE tables on both sides (see the module docstring)


def _hf(spec, moe: bool):
    fields = spec.hf_config()
    fields.pop("model_type")
    if not moe:
        fields["first_k_dense_replace"] = spec.num_layers
    config = transformers.DeepseekV3Config(**fields, experts_implementation="eager")
    config._attn_implementation = "eager"  # grouped_mm experts take no float64
    return transformers.DeepseekV3ForCausalLM(config).to(torch.float64)


def _to_hf(megatron: dict, spec, moe: bool) -> dict:
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    attn = {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
            "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
            "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj",
            "linear_proj": "o_proj"}
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = megatron[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = megatron[m + "pre_mlp_layernorm.weight"]
        for ours, theirs in attn.items():
            out[h + f"self_attn.{theirs}.weight"] = megatron[m + f"self_attention.{ours}.weight"]
        dense = not moe or i < spec.first_k_dense_replace
        mlps = [("mlp.", "mlp.")] if dense else [("mlp.shared_experts.", "mlp.shared_experts.")]
        for ours, theirs in mlps:
            gate, up = megatron[m + ours + "linear_fc1.weight"].chunk(2)
            out[h + theirs + "gate_proj.weight"], out[h + theirs + "up_proj.weight"] = gate, up
            out[h + theirs + "down_proj.weight"] = megatron[m + ours + "linear_fc2.weight"]
        if not dense:
            out[h + "mlp.gate.weight"] = megatron[m + "mlp.router.weight"]
            out[h + "mlp.gate.e_score_correction_bias"] = megatron[m + "mlp.router.expert_bias"]
            experts = range(spec.num_experts)
            fc1 = [megatron[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
            fc2 = [megatron[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
            out[h + "mlp.experts.down_proj"] = torch.stack(fc2)
    return out


def _hf_step(hf, batch):
    """HF full sequences: the loss of the module docstring and its gradients."""
    total, tokens = 0.0, 0
    hf.zero_grad(set_to_none=True)
    losses = []
    for group in batch.groups:
        p = group.prefix.numel()
        for t in group.trajectories:
            ids = torch.cat([group.prefix, t.suffix])[None]
            logits = hf(input_ids=ids).logits[0].to(torch.float64)
            logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            suffix = logp[p - 1:]
            mask = t.loss_mask > 0
            per_token = -t.advantages.double() * torch.exp(suffix - t.old_logprobs.double())
            losses.append(per_token[mask].sum())
            tokens += int(mask.sum())
    total = torch.stack(losses).sum() / tokens
    total.backward()
    return float(total), {n: p.grad for n, p in hf.named_parameters()}


@pytest.mark.parametrize("moe", [False, True], ids=["dense MLA layers", "deepseek-v3-tiny MoE"])
def test_reuse_step_equals_transformers_deepseek_v3(megatron_env, moe):
    from mla_models import mla_model
    from megatron_patches.models.model_configs_mla import MLA_MODELS
    from megatron_patches.training import param_grads, reuse_step, scale_grads_by_token_count
    from prefix_schedule.losses import PolicyLossConfig
    from prefix_schedule.planning.planner import plan_microbatches

    spec = MLA_MODELS["deepseek-v3-tiny"]
    # no load-balancing loss: HF's forward has none (its gradient is Megatron's alone)
    model = mla_model(moe=moe, params_dtype=torch.float64, moe_aux_loss_coeff=0.0,
                      moe_router_load_balancing_type="none")
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():  # norms away from 1 and a nonzero expert bias: a layout slip shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen, dtype=buf.dtype))
    megatron = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    hf = _hf(spec, moe)
    state = _to_hf({n: t.detach() for n, t in megatron.items()}, spec, moe)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    batch = make_batch(4, SHAPES, vocab=spec.vocab_size)
    batch = type(batch)(groups=[type(g)(prefix=g.prefix, trajectories=[
        type(t)(suffix=t.suffix, loss_mask=t.loss_mask, advantages=t.advantages.double(),
                old_logprobs=t.old_logprobs.double(), ref_logprobs=None)
        for t in g.trajectories]) for g in batch.groups])
    loss = PolicyLossConfig(clip_eps_low=0.999, clip_eps_high=1e9)
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
    assert len(plan.prefixes) == 2 and len(plan.microbatches) >= 3
    model.zero_grad(set_to_none=True)
    reuse = reuse_step(model, batch, plan, loss)
    ours = param_grads(model)
    hf_loss, hf_grads = _hf_step(hf, batch)
    assert abs(reuse.loss - hf_loss) <= REL * abs(hf_loss), (reuse.loss, hf_loss)
    theirs = _to_hf({n: ours[n] if n in ours else torch.zeros_like(t)
                     for n, t in megatron.items()}, spec, moe)
    worst = {}
    for name, grad in hf_grads.items():
        if name.endswith("e_score_correction_bias"):
            continue
        assert grad is not None and torch.isfinite(grad).all(), name
        mine = theirs[name]
        assert torch.isfinite(mine).all(), name
        worst[name] = float((mine - grad).abs().max() / grad.abs().max().clamp_min(1e-300))
    assert max(worst.values()) <= REL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
