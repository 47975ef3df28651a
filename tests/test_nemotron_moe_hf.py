"""An outside reference of the prefix-REUSE path for Nemotron-H MoE (Nemotron 3 Nano layout):
Hugging Face `NemotronHForCausalLM` (transformers 5.23: `mamba` / `attention` / `moe` layers; its
MoE: sigmoid router with `e_score_correction_bias` for the choice, top-k normalised and scaled by
`routed_scaling_factor`, non-gated relu^2 experts, a shared expert) in float64 with the Megatron
tiny twin's weights copied in (expert bias nonzero on both sides). Loss (tests/reference_impl.py's
GRPO loss over HF's full-sequence logits) and every Megatron parameter's gradient of a reuse step
(fp32) within 1e-5. HF's router computes in float32 (its own `.type(torch.float32)`)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import reference_impl as ref  # noqa: E402
from test_gptoss_hf import _HF  # noqa: E402
from test_nemotron_moe import MAMBA, build, nano_moe  # noqa: E402

pytestmark = pytest.mark.megatron

PATTERN = "MEM*EME"  # test_nemotron_moe.NANO_TINY_PATTERN
KINDS = {"M": "mamba", "*": "attention", "E": "moe"}
SHAPES = [(14, [5, 1, 4]), (3, [6, 2]), (9, [1, 3])]


def hf_model():
    moe = nano_moe()
    cfg = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=64, layers_block_type=[KINDS[s] for s in PATTERN],
        ssm_state_size=MAMBA["mamba_state_dim"], mamba_num_heads=MAMBA["mamba_num_heads"],
        mamba_head_dim=MAMBA["mamba_head_dim"], n_groups=MAMBA["mamba_num_groups"],
        conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5, use_bias=False,
        use_conv_bias=True, tie_word_embeddings=False, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=48, n_routed_experts=4,
        num_experts_per_tok=moe["moe_router_topk"], moe_intermediate_size=moe["moe_ffn_hidden_size"],
        moe_shared_expert_intermediate_size=moe["moe_shared_expert_intermediate_size"],
        routed_scaling_factor=moe["moe_router_topk_scaling_factor"], n_group=1, topk_group=1,
        norm_topk_prob=True, mlp_hidden_act="relu2")
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    hf = transformers.NemotronHForCausalLM(cfg).to(torch.float64)
    for layer in hf.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):  # Megatron's training path does not clamp dt
            layer.mixer.time_step_limit = (0.0, float("inf"))
    return hf


def megatron_to_hf(params):
    """{HF name: tensor} from {Megatron name: tensor} (TP = PP = 1)."""
    out = {"model.embeddings.weight": params["embedding.word_embeddings.weight"],
           "model.norm_f.weight": params["decoder.final_norm.weight"],
           "lm_head.weight": params["output_layer.weight"]}
    for i, symbol in enumerate(PATTERN):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == "M":
            out[h + "norm.weight"] = params[m + "norm.weight"]
            for name in ("dt_bias", "A_log", "D", "in_proj.weight", "norm.weight",
                         "out_proj.weight"):
                out[h + "mixer." + name] = params[m + "mixer." + name]
            out[h + "mixer.conv1d.weight"] = params[m + "mixer.conv1d_weight"]
            out[h + "mixer.conv1d.bias"] = params[m + "mixer.conv1d_bias"]
        elif symbol == "*":
            out[h + "norm.weight"] = params[m + "input_layernorm.weight"]
            qkv = params[m + "self_attention.linear_qkv.weight"].reshape(2, 4 // 2 + 2, 16, 64)
            q, k, v = qkv.split([2, 1, 1], dim=1)
            out[h + "mixer.q_proj.weight"] = q.reshape(-1, 64)
            out[h + "mixer.k_proj.weight"] = k.reshape(-1, 64)
            out[h + "mixer.v_proj.weight"] = v.reshape(-1, 64)
            out[h + "mixer.o_proj.weight"] = params[m + "self_attention.linear_proj.weight"]
        else:
            out[h + "norm.weight"] = params[m + "pre_mlp_layernorm.weight"]
            out[h + "mixer.gate.weight"] = params[m + "mlp.router.weight"]
            experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(4)]
            out[h + "mixer.experts.up_proj"] = torch.stack(
                [params[e + "linear_fc1.weight"] for e in experts])
            out[h + "mixer.experts.down_proj"] = torch.stack(
                [params[e + "linear_fc2.weight"] for e in experts])
            for a, b in (("up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
                out[h + f"mixer.shared_experts.{a}.weight"] = params[m + f"mlp.shared_experts.{b}.weight"]
    return out


def _data(gen):
    from prefix_schedule.planning.data import Group, GroupBatch, Trajectory

    groups, sequences = [], []
    for p, lens in SHAPES:
        prefix = torch.randint(0, 256, (p,), generator=gen).tolist()
        trajs = []
        for n in lens:
            suffix = torch.randint(0, 256, (n,), generator=gen).tolist()
            adv = torch.randn(n, generator=gen).tolist()
            old = (-torch.rand(n, generator=gen) * 4 - 3).tolist()
            refl = (-torch.rand(n, generator=gen) * 4 - 3).tolist()
            trajs.append(Trajectory(suffix=suffix, loss_mask=[1.0] * n, advantages=adv,
                                    old_logprobs=old, ref_logprobs=refl))
            sequences.append(ref.RefSequence(prefix=prefix, suffix=suffix, loss_mask=[1.0] * n,
                                             advantages=adv, old_logprobs=old, ref_logprobs=refl))
        groups.append(Group(prefix=prefix, trajectories=trajs))
    return GroupBatch(groups=groups), sequences


def test_reuse_step_equals_hf_nemotron_h_moe_float64(megatron_env):
    from megatron_patches.training import max_relative_diff, missing_grads, param_grads, reuse_step
    from prefix_schedule.losses import PolicyLossConfig
    from prefix_schedule.planning.planner import plan_microbatches

    ddp = build(nano_moe())
    model = ddp.module
    gen = torch.Generator().manual_seed(13)
    hf = hf_model()
    with torch.no_grad():
        for i, symbol in enumerate(PATTERN):  # a nonzero expert bias: it moves the choice
            if symbol == "E":
                bias = torch.randn(4, generator=gen) * 0.05
                model.decoder.layers[i].mlp.router.expert_bias.copy_(bias)
                hf.model.layers[i].mixer.gate.e_score_correction_bias.copy_(bias.double())
    params = dict(model.named_parameters())
    weights = megatron_to_hf(params)
    theirs = dict(hf.named_parameters())
    assert set(weights) == set(theirs), set(weights) ^ set(theirs)
    with torch.no_grad():
        for k, t in weights.items():
            theirs[k].copy_(t.detach().double())
    batch, sequences = _data(gen)
    loss = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01)
    plan = plan_microbatches(batch, token_budget=10, max_seq_len=512, run_singletons_dense=False)
    result = reuse_step(ddp, batch, plan, loss)
    grads = param_grads(ddp)
    cfg = ref.RefLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05,
                            kl_estimator=loss.kl_estimator, entropy_coef=0.01)
    value, _ = ref.batch_loss(_HF(hf), sequences, cfg)
    value.backward()
    proxies = {n: p.detach().double().requires_grad_() for n, p in params.items()}
    mapped = megatron_to_hf(proxies)
    torch.autograd.backward([mapped[k] for k in mapped], [theirs[k].grad for k in mapped])
    ref_grads = {"module." + n: t.grad.float() for n, t in proxies.items()}
    # an expert no token chose has a zero gradient on both sides; nothing else may miss one
    missing = missing_grads(reference=ref_grads, reuse=grads)
    assert plan.prefixes and all("local_experts" in m for m in missing), missing
    assert {m.split(": ")[1] for m in missing if m.startswith("reference")} == \
        {m.split(": ")[1] for m in missing if m.startswith("reuse")}
    assert abs(result.loss - float(value)) <= 1e-5 * abs(float(value)), (result.loss, float(value))
    assert max_relative_diff(ref_grads, grads) <= 1e-5
