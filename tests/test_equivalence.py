"""Prefix reuse vs stock Megatron dense training: same model, same data, same loss.

Dense = stock `forward_backward_no_pipelining` over full [prefix; suffix] rows with Megatron's
local (unfused) attention. Reuse = the prefix-reuse schedule. fp32: loss and every parameter
gradient within 1e-5 relative (max abs diff / max abs of the reference).
"""

import zlib

import pytest
import torch

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.planner import plan_microbatches

pytestmark = pytest.mark.megatron

TOL = 1e-5
LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01)


def make_batch(seed, shapes, vocab=256, with_old=True, with_ref=True):
    """shapes: list of (prefix_len, [suffix lengths]) per group."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for prefix_len, suffix_lens in shapes:
        prefix = torch.randint(0, vocab, (prefix_len,), generator=gen)
        trajs = []
        for n in suffix_lens:
            mask = (torch.rand(n, generator=gen) > 0.2).float()
            mask[0] = 1.0
            trajs.append(Trajectory(
                suffix=torch.randint(0, vocab, (n,), generator=gen),
                loss_mask=mask,
                advantages=torch.randn(n, generator=gen),
                old_logprobs=(-torch.rand(n, generator=gen) * 6 - 1) if with_old else None,
                ref_logprobs=(-torch.rand(n, generator=gen) * 6 - 1) if with_ref else None,
            ))
        groups.append(Group(prefix=prefix, trajectories=trajs))
    return GroupBatch(groups=groups)


@pytest.fixture(scope="module")
def models(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_model(cfg)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return cfg, model


def _grads(model):
    from megatron_patches.training import param_grads

    return param_grads(model)


def run_both(model, batch, token_budget, max_seq_len=512, loss=LOSS, **plan_kwargs):
    from megatron_patches.training import dense_step, reuse_step

    model.zero_grad(set_to_none=True)
    dense = dense_step(model, batch, loss)
    dense_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    plan = plan_microbatches(batch, token_budget=token_budget, max_seq_len=max_seq_len,
                             **plan_kwargs)
    reuse = reuse_step(model, batch, plan, loss)
    reuse_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return dense, dense_grads, reuse, reuse_grads, plan


def assert_equal_step(dense, dense_grads, reuse, reuse_grads):
    from megatron_patches.training import max_relative_diff, missing_grads

    assert dense.num_tokens == reuse.num_tokens
    assert abs(dense.loss - reuse.loss) <= TOL * max(abs(dense.loss), 1e-3), (dense.loss, reuse.loss)
    missing = missing_grads(dense=dense_grads, reuse=reuse_grads)
    assert not missing, f"parameters got no (or a non-finite) gradient: {missing[:5]}"
    diff = max_relative_diff(dense_grads, reuse_grads)
    assert diff <= TOL, f"max relative gradient difference {diff:.3e}"


CASES = {
    "one group over many microbatches": ([(40, [9, 7, 12, 5, 8, 11])], 16),
    "several groups, different prefix lengths": ([(33, [6, 9, 4]), (17, [8, 3]), (50, [5, 7, 6, 2])], 20),
    "suffix length 1": ([(24, [1, 1, 3, 1])], 8),
    "prefix length 1": ([(1, [7, 5]), (12, [4, 6])], 16),
    "group of one (runs dense)": ([(30, [6]), (20, [5, 4])], 64),
    "group of one forced through the cache": ([(30, [6])], 8),
    "budget forces splits, groups share microbatches": ([(21, [5, 5, 5]), (19, [5, 5, 5])], 11),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reuse_equals_dense(models, name):
    _, model = models
    shapes, budget = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) % 1000, shapes)
    dense, dg, reuse, rg, plan = run_both(model, batch, budget)
    if name == "one group over many microbatches":
        assert len(plan.microbatches) >= 3
    if name == "group of one (runs dense)":
        assert [w.group for w in plan.prefixes] == [1]
    if name == "group of one forced through the cache":
        assert [w.group for w in plan.prefixes] == [0]
    assert_equal_step(dense, dg, reuse, rg)


def test_split_does_not_change_the_update(models):
    _, model = models
    from megatron_patches.training import max_relative_diff, reuse_step

    batch = make_batch(7, [(25, [6, 4, 9, 3]), (18, [7, 7])])
    grads = []
    for budget in (9, 17, 64):
        model.zero_grad(set_to_none=True)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512)
        reuse_step(model, batch, plan, LOSS)
        grads.append(_grads(model))
    assert max_relative_diff(grads[0], grads[1]) <= TOL
    assert max_relative_diff(grads[0], grads[2]) <= TOL


def test_on_policy_without_reference(models):
    _, model = models
    batch = make_batch(11, [(30, [5, 8, 2])], with_old=False, with_ref=False)
    loss = PolicyLossConfig()
    assert_equal_step(*run_both(model, batch, 10, loss=loss)[:4])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_weights_match_after_optimizer_steps(megatron_env, models, optimizer):
    """Two optimizer steps; gradients before each step within 1e-5, then the weights.
    (AdamW: before its second step the weights differ by the noise explained next, so the
    gradients there get the same dense-spread bar as the weights.)

    SGD (with momentum) is linear in the gradients: weights within 1e-5. AdamW divides every
    entry by its own magnitude, so entries whose exact gradient is below float noise get
    noise-driven O(lr) updates in any two dense runs with different rounding too. Its bar is
    therefore dense's own spread: reuse may differ from stock dense by no more than 3x what a
    second dense run with another attention kernel (fused SDPA, same weights) differs by.
    """
    from megatron_patches.models.tiny import build_model
    from megatron_patches.training import (dense_step, max_relative_diff, reuse_step,
                                           scale_grads_by_token_count)

    cfg, base = models
    dense_model, reuse_model = build_model(cfg), build_model(cfg)
    control = build_model(cfg, fused_attention=True)
    trio = (dense_model, reuse_model, control)
    for m in trio:
        m.load_state_dict(base.state_dict())
        m.config.finalize_model_grads_func = scale_grads_by_token_count
    if optimizer == "sgd":
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in trio]
    else:
        # eps 1e-6, not 1e-8: AdamW's first update is lr * g / (|g| + eps), whose sensitivity to g
        # is lr / eps at g ~ 0; at 1e-8 a 1e-10 rounding difference of a 3e-9 gradient moved a
        # weight by 1e-4 of its tensor's scale (seen on another CPU's kernels), which measures the
        # optimizer's conditioning, not reuse
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6) for m in trio]
    weights = lambda m: {n: p.detach().clone() for n, p in m.named_parameters()}  # noqa: E731
    for step in range(2):
        batch = make_batch(100 + step, [(28, [6, 5, 7]), (15, [4, 9])])
        plan = plan_microbatches(batch, token_budget=12, max_seq_len=512)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        dense_step(dense_model, batch, LOSS)
        reuse_step(reuse_model, batch, plan, LOSS)
        dense_step(control, batch, LOSS)
        # after an AdamW step the weights already differ at dense's own noise level (below)
        grad_diff = max_relative_diff(_grads(dense_model), _grads(reuse_model))
        grad_spread = max_relative_diff(_grads(dense_model), _grads(control))
        grad_bar = TOL if optimizer == "sgd" or step == 0 else max(TOL, 3 * grad_spread)
        assert grad_spread < 1 and grad_diff <= grad_bar, (step, grad_diff, grad_spread)  # inf too
        for opt in opts:
            opt.step()
        reuse_diff = max_relative_diff(weights(dense_model), weights(reuse_model))
        spread = max_relative_diff(weights(dense_model), weights(control))
        bar = TOL if optimizer == "sgd" else max(TOL, 3 * spread)
        assert spread < 1 and reuse_diff <= bar, (step, reuse_diff, spread)  # inf spread: no bar
        moved = max((weights(dense_model)[n] - p).abs().max().item()
                    for n, p in base.named_parameters())
        assert moved > 0, "the optimizer step changed nothing"


def test_bf16_reuse_is_within_1_5x_of_bf16_dense_distance_to_fp32(megatron_env, models):
    """bf16: reuse's distance from the fp32 dense reference <= bf16 dense's distance x 1.5
    (here 1.1x: reuse rounds differently -- fp32 gK/gV, one prefix pass -- not always less)."""
    from megatron_patches.models.tiny import build_model
    from megatron_patches.training import dense_step, max_relative_diff, reuse_step

    cfg, base = models
    cfg16 = type(cfg)(**{**cfg.__dict__, "params_dtype": torch.bfloat16})
    model16 = build_model(cfg16)
    model16.load_state_dict({k: v.to(torch.bfloat16) for k, v in base.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    model32 = build_model(cfg)  # fp32 copy of the bf16-rounded weights: the reference
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    for m in (model16, model32):
        from megatron_patches.training import scale_grads_by_token_count
        m.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(21, [(48, [8, 6, 9, 5]), (30, [7, 7, 3])])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512)
    dense_step(model32, batch, LOSS)
    reference = _grads(model32)
    dense_step(model16, batch, LOSS)
    dense16 = _grads(model16)
    model16.zero_grad(set_to_none=True)
    reuse_step(model16, batch, plan, LOSS)
    reuse16 = _grads(model16)
    dense_err = max_relative_diff(reference, dense16)
    reuse_err = max_relative_diff(reference, reuse16)
    print(f"bf16 vs fp32 reference: dense {dense_err:.3e}, reuse {reuse_err:.3e}")
    assert 0 < dense_err < 0.2, dense_err
    assert reuse_err <= 1.5 * dense_err, (reuse_err, dense_err)
