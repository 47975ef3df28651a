"""Dense AND prefix-reuse training against an independent float64 reference (tests/reference_impl.py).

Every other equivalence test compares reuse with our own dense path; both share the loss code,
the row construction and the model builder, so a bug there cancels out. Here the loss and every
parameter gradient of both paths are compared with a model and a loss written again from their
definitions (sharing no project code), for a Llama-style model with GQA, Llama 3.1 RoPE scaling
and a Qwen3-style model (per-head q/k RMSNorm, head_dim != hidden / heads), on odd shapes:
prefix length 1, suffix length 1, a group of one (through the cache), loss masks with zeros, and
tokens clipped on both sides; reuse also with prefix chunks (RoPE offsets inside the
prefix). Each loss term is checked on its own (advantages 0 switch the
surrogate off), so a small term cannot hide under a large one.

Metrics: per-tensor max|a-b| / max|a|, a the float64 reference (megatron_patches.training.
max_relative_diff, <= 1e-5)
and the elementwise one (training.max_elementwise_error), both printed per case (pytest -s).
"""

import math
import random

import pytest
import torch

import reference_impl as ref
from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.planning.planner import plan_microbatches

pytestmark = pytest.mark.megatron

TOL = 1e-5
ELEMENTWISE_TOL = 5e-3  # |a-b| / max(|a|, 1e-3 max|a|): fp32 rounding is ~1e-6 of max|a|
VOCAB, MAX_SEQ = 256, 128
BASE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
            num_query_groups=2, vocab_size=VOCAB, max_seq_len=MAX_SEQ)
LLAMA31_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)

MODELS = {
    "llama-gqa": dict(),
    "llama3.1-rope-scaling": dict(rotary_base=500000, rope_scaling_factor=8.0),
    "qwen3-qk-norm-head-dim": dict(kv_channels=24, qk_layernorm=True, rotary_base=1000000,
                                   layernorm_epsilon=1e-6, num_query_groups=1),
}

# (prefix length, [suffix lengths]) per group: prefix 1, suffix 1, a group of one
SHAPES = [(1, [5, 3]), (9, [1, 4, 1]), (7, [6]), (12, [3, 7])]

LOSSES = {  # name -> (PolicyLossConfig, advantages on?)
    "clipped-surrogate": (PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28), True),
    "kl-k1": (PolicyLossConfig(kl_coef=1.0, kl_estimator="k1"), False),
    "kl-k2": (PolicyLossConfig(kl_coef=1.0, kl_estimator="k2"), False),
    "kl-k3": (PolicyLossConfig(kl_coef=1.0, kl_estimator="k3"), False),
    "entropy": (PolicyLossConfig(entropy_coef=1.0), False),
    "all-terms": (PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05,
                                   entropy_coef=0.01), True),
}


def ref_model_config(name):
    from megatron_patches.models.tiny import TinyLlamaConfig

    cfg = TinyLlamaConfig(**{**BASE, **MODELS[name]})
    return cfg, ref.RefModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size, norm_eps=cfg.layernorm_epsilon,
        rope_theta=float(cfg.rotary_base), qk_norm=cfg.qk_layernorm,
        llama3_scaling=LLAMA31_SCALING if cfg.rope_scaling_factor else None)


def randomize(model, seed):
    """Weights far from init (norm weights != 1, sharp attention) so every term has a gradient."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * noise)
            elif "word_embeddings" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, megatron_env):
    from megatron_patches.models.tiny import build_model
    from megatron_patches.training import scale_grads_by_token_count

    cfg, rcfg = ref_model_config(request.param)
    model = build_model(cfg)
    randomize(model, seed=7)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return request.param, model, ref.ReferenceLM(rcfg, model.state_dict())


def make_data(reference, seed, with_advantages):
    """Batch + the same data for the reference; old/ref log-probs set around the reference's
    current log-probs so that ratios land clipped low, clipped high and unclipped."""
    rng = random.Random(seed)
    groups, sequences = [], []
    for prefix_len, suffix_lens in SHAPES:
        prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
        trajectories = []
        for n in suffix_lens:
            suffix = [rng.randrange(VOCAB) for _ in range(n)]
            mask = [0.0 if (i % 3 == 2) else 1.0 for i in range(n)]  # zeros inside the mask
            seq = ref.RefSequence(prefix=prefix, suffix=suffix, loss_mask=mask, advantages=[0.0] * n)
            with torch.no_grad():
                logp, _ = ref.suffix_logprobs_and_entropy(reference, seq)
            shift = [rng.choice([-0.5, 0.5, -0.05, 0.05]) for _ in range(n)]
            seq.old_logprobs = [float(lp) + d for lp, d in zip(logp, shift)]
            seq.ref_logprobs = [float(lp) + rng.gauss(0.0, 0.4) for lp in logp]
            if with_advantages:
                seq.advantages = [rng.choice([-1.0, 1.0]) * (0.5 + rng.random()) for _ in range(n)]
            sequences.append(seq)
            trajectories.append(Trajectory(suffix=suffix, loss_mask=mask, advantages=seq.advantages,
                                           old_logprobs=seq.old_logprobs,
                                           ref_logprobs=seq.ref_logprobs))
        groups.append(Group(prefix=prefix, trajectories=trajectories))
    return GroupBatch(groups=groups), sequences


def reference_step(reference, sequences, loss: PolicyLossConfig):
    cfg = ref.RefLossConfig(clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high,
                            kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator,
                            entropy_coef=loss.entropy_coef)
    reference.zero_grad()
    value, scale = ref.batch_loss(reference, sequences, cfg)
    value.backward()
    return (float(value), scale), reference.grads_in_megatron_layout()


def project_steps(model, batch, loss):
    from megatron_patches.training import dense_step, param_grads, reuse_step

    out = {}
    model.zero_grad(set_to_none=True)
    out["dense"] = (dense_step(model, batch, loss), param_grads(model))
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=MAX_SEQ, run_singletons_dense=False)
    assert len(plan.microbatches) > 2 and len(plan.prefixes) == len(SHAPES) - 1  # prefix 1 caches nothing
    out["reuse"] = (reuse_step(model, batch, plan, loss), param_grads(model))
    model.zero_grad(set_to_none=True)
    chunked = plan_microbatches(batch, token_budget=8, max_seq_len=MAX_SEQ,
                                run_singletons_dense=False, prefix_chunk_tokens=4)
    out["reuse-prefix-chunks"] = (reuse_step(model, batch, chunked, loss), param_grads(model))
    model.zero_grad(set_to_none=True)
    return out


def compare(name, ref_loss_and_scale, ref_grads, result, grads):
    from megatron_patches.training import max_elementwise_error, max_relative_diff

    ref32 = {k: v.float() for k, v in ref_grads.items()}
    assert set(grads) == set(ref32), set(grads) ^ set(ref32)
    per_tensor = max_relative_diff(ref32, grads)
    elementwise = max_elementwise_error(ref32, grads)
    ref_loss, scale = ref_loss_and_scale  # scale: mean |per-token loss| (terms may cancel)
    loss_err = abs(result.loss - ref_loss) / max(abs(ref_loss), scale)
    print(f"{name}: loss {result.loss:.7g} vs {ref_loss:.7g} (rel {loss_err:.1e}); grads "
          f"per-tensor {per_tensor:.1e}, elementwise {elementwise:.1e}")
    assert loss_err <= TOL, (name, result.loss, ref_loss)
    assert per_tensor <= TOL, (name, per_tensor)
    assert elementwise <= ELEMENTWISE_TOL, (name, elementwise)


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_dense_and_reuse_equal_the_reference(setup, loss_name):
    from megatron_patches.training import missing_grads

    model_name, model, reference = setup
    loss, with_advantages = LOSSES[loss_name]
    batch, sequences = make_data(reference, seed=len(loss_name), with_advantages=with_advantages)
    ref_loss, ref_grads = reference_step(reference, sequences, loss)
    assert not missing_grads(reference=ref_grads), "a parameter got no gradient"
    for path, (result, grads) in project_steps(model, batch, loss).items():
        assert not missing_grads(**{path: grads}), missing_grads(**{path: grads})[:5]
        compare(f"{model_name}/{loss_name}/{path}", ref_loss, ref_grads, result, grads)
        if loss_name == "clipped-surrogate":
            low = sum(float(r["clip_frac_low"][0]) for r in result.reports)
            high = sum(float(r["clip_frac_high"][0]) for r in result.reports)
            assert low > 0 and high > 0, "the data must clip tokens on both sides"


def test_reference_can_tell_a_wrong_model(setup):
    """The comparison is sensitive: the reference with the default RoPE theta and no q/k norm
    (what build_model silently did before) misses by far more than the tolerance."""
    import dataclasses

    model_name, model, reference = setup
    if model_name == "llama-gqa":
        pytest.skip("the default model is the wrong model of the others")
    loss, _ = LOSSES["all-terms"]
    batch, sequences = make_data(reference, seed=3, with_advantages=True)
    wrong_cfg = dataclasses.replace(reference.cfg, rope_theta=10000.0, llama3_scaling=None,
                                    qk_norm=False)
    state = {k: v for k, v in model.state_dict().items()}
    wrong = ref.ReferenceLM(wrong_cfg, state)
    _, wrong_grads = reference_step(wrong, sequences, loss)
    result, grads = project_steps(model, batch, loss)["reuse"]
    from megatron_patches.training import max_relative_diff

    common = {k: v.float() for k, v in wrong_grads.items()}
    assert max_relative_diff(common, {k: grads[k] for k in common}) > 100 * TOL


def test_megatron_rope_frequencies_equal_the_definition(megatron_env):
    """Llama 3 theta and Llama 3.1 scaling: Megatron's inv_freq equals the definition, and the
    scaling really changes it (so the end-to-end test cannot pass with scaling ignored)."""
    from megatron_patches.models.tiny import build_model

    cfg, rcfg = ref_model_config("llama3.1-rope-scaling")
    model = build_model(cfg)
    expected = ref.inv_frequencies(rcfg)
    got = model.rotary_pos_emb.inv_freq.double()
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    import dataclasses
    unscaled = ref.inv_frequencies(dataclasses.replace(rcfg, llama3_scaling=None))
    assert (unscaled / expected).max() > 7.9  # the lowest frequencies are divided by 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_leaves_the_logits_alone(megatron_env, dtype):
    """Megatron's vocab_parallel_cross_entropy works in place on its input; for fp32 logits
    `.float()` is the same tensor, so the logits used to become probabilities and the entropy
    read afterwards was that of softmax(probabilities) (~log V). Values and gradients of both
    against float64 definitions."""
    from megatron_patches.rl import token_entropy, token_logprobs

    gen = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(1, 5, VOCAB, generator=gen, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, VOCAB, (1, 5), generator=gen)
    logits = base.clone().requires_grad_(True)
    untouched = logits.detach().clone()
    logp = token_logprobs(logits, labels)
    entropy = token_entropy(logits)
    assert torch.equal(logits.detach(), untouched), "token_logprobs changed its input"
    (logp.sum() + 0.5 * entropy.sum()).backward()

    x = base.double().requires_grad_(True)
    logp_all = torch.log_softmax(x, dim=-1)
    ref_logp = logp_all.gather(-1, labels[..., None])[..., 0]
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1)
    (ref_logp.sum() + 0.5 * ref_entropy.sum()).backward()
    assert torch.allclose(logp.double(), ref_logp, rtol=1e-6, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, rtol=1e-6, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(logits.grad.double(), x.grad, rtol=tol, atol=tol)
