"""PPO/GRPO token-sum loss: hand cases, clipping, KL, entropy, and normalisation invariance."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_schedule.losses import PolicyLossConfig, entropy_from_logits, grpo_advantages, policy_loss_sum

CFG = PolicyLossConfig()


def t(*values, grad=False):
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def run(logp, adv, *, old=None, mask=None, config=CFG, **kw):
    logp = t(*logp, grad=True)
    mask = torch.ones_like(logp) if mask is None else t(*mask)
    old = None if old is None else t(*old)
    loss, count, metrics = policy_loss_sum(logp, loss_mask=mask, advantages=t(*adv), old_logprobs=old,
                                           config=config, **kw)
    loss.backward()
    return loss.item(), int(count), metrics, logp.grad.tolist()


def test_on_policy_is_minus_advantage_with_reinforce_gradient():
    loss, count, metrics, grad = run([-1.0, -2.0], [1.0, -2.0])
    assert loss == pytest.approx(1.0) and count == 2
    assert grad == pytest.approx([-1.0, 2.0])  # descent raises logp where A > 0, lowers it where A < 0
    assert metrics["pg_loss"].item() == pytest.approx(1.0) and metrics["clip_frac"].item() == 0


@pytest.mark.parametrize("ratio, adv, loss, grad, clipped", [
    (1.5, 1.0, -1.2, 0.0, "high"),   # A > 0, ratio above 1 + eps: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5, None),     # A < 0, ratio above 1 + eps: unclipped (pessimistic side)
    (0.5, -1.0, 0.8, 0.0, "low"),    # A < 0, ratio below 1 - eps: clipped, no gradient
    (0.5, 1.0, -0.5, -0.5, None),    # A > 0, ratio below 1 - eps: unclipped
    (1.1, 2.0, -2.2, -2.2, None),    # inside the trust region
])
def test_clip_on_both_sides(ratio, adv, loss, grad, clipped):
    old = -1.0
    got_loss, _, metrics, got_grad = run([old + math.log(ratio)], [adv], old=[old])
    assert got_loss == pytest.approx(loss) and got_grad == pytest.approx([grad])
    assert metrics["clip_frac"].item() == (clipped is not None)
    assert metrics["clip_frac_high"].item() == (clipped == "high")
    assert metrics["clip_frac_low"].item() == (clipped == "low")


def test_asymmetric_clip():
    config = PolicyLossConfig(clip_eps_low=0.1, clip_eps_high=0.3)
    assert run([math.log(1.25)], [1.0], old=[0.0], config=config)[0] == pytest.approx(-1.25)
    assert run([math.log(1.5)], [1.0], old=[0.0], config=config)[0] == pytest.approx(-1.3)
    assert run([math.log(0.85)], [-1.0], old=[0.0], config=config)[0] == pytest.approx(0.9)


@pytest.mark.parametrize("estimator, value", [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1.0))])
def test_kl_estimators_by_hand(estimator, value):
    config = PolicyLossConfig(kl_coef=0.5, kl_estimator=estimator)
    loss, _, metrics, _ = run([-1.0], [0.0], config=config, ref_logprobs=t(-2.0))
    assert loss == pytest.approx(0.5 * value) and metrics["kl"].item() == pytest.approx(value)


def test_k3_gradient_pulls_towards_the_reference():
    config = PolicyLossConfig(kl_coef=1.0)
    # d k3 / d logp = 1 - exp(ref - logp): positive when logp > ref, so descent lowers logp.
    assert run([-1.0], [0.0], config=config, ref_logprobs=t(-2.0))[3][0] == pytest.approx(1 - math.exp(-1))
    assert run([-2.0], [0.0], config=config, ref_logprobs=t(-1.0))[3][0] < 0


def test_entropy_bonus_and_metrics():
    config = PolicyLossConfig(entropy_coef=0.1)
    loss, _, metrics, _ = run([-1.0, -1.0], [0.0, 0.0], config=config, entropy=t(2.0, 3.0),
                              mask=[1, 0])
    assert loss == pytest.approx(-0.2) and metrics["entropy"].item() == pytest.approx(2.0)


def test_masked_tokens_contribute_nothing_even_if_extreme():
    loss, count, metrics, grad = run([-1.0, -0.5], [1.0, 3.0], old=[-1.0, -1000.0], mask=[1, 0],
                                     config=PolicyLossConfig(kl_coef=1.0), ref_logprobs=t(-1.0, -900.0))
    assert count == 1 and loss == pytest.approx(-1.0) and grad == [pytest.approx(-1.0), 0.0]
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_zero_masked_tokens_gives_zero_sum_and_count():
    loss, count, _, grad = run([-1.0], [1.0], mask=[0])
    assert (loss, count, grad) == (0.0, 0, [0.0])


def test_float32_result_for_lower_precision_inputs():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    loss, count, _ = policy_loss_sum(logp, loss_mask=torch.ones(2), advantages=torch.ones(2), config=CFG)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and count.dtype == torch.int64


@pytest.mark.parametrize("kwargs, message", [
    (dict(config=PolicyLossConfig(kl_coef=0.1)), "kl_coef=0.1 needs ref_logprobs"),
    (dict(config=PolicyLossConfig(entropy_coef=0.1)), "needs entropy"),
    (dict(config=CFG, old_logprobs=torch.zeros(3)), r"old_logprobs has shape \(3,\) but logprobs has \(2,\)"),
])
def test_policy_loss_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        policy_loss_sum(torch.zeros(2), loss_mask=torch.ones(2), advantages=torch.ones(2), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(clip_eps_low=1.0), "clip_eps_low"), (dict(clip_eps_high=-0.1), "clip_eps_high"),
    (dict(kl_coef=-1.0), "kl_coef"), (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(entropy_coef=float("nan")), "entropy_coef"),
])
def test_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


@settings(max_examples=50, deadline=None)
@given(data=st.data(), n=st.integers(1, 24))
def test_token_mean_does_not_depend_on_the_split(data, n):
    floats = st.floats(-3.0, 0.0)
    logp, old, ref = (t(*data.draw(st.lists(floats, min_size=n, max_size=n))) for _ in range(3))
    adv = t(*data.draw(st.lists(st.floats(-2.0, 2.0), min_size=n, max_size=n)))
    mask = t(*data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    config = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05)

    def loss_and_grad(bounds):
        x = logp.clone().requires_grad_(True)
        parts = [policy_loss_sum(x[a:b], loss_mask=mask[a:b], advantages=adv[a:b], old_logprobs=old[a:b],
                                 ref_logprobs=ref[a:b], config=config)
                 for a, b in zip(bounds, bounds[1:])]
        total = sum(p[1] for p in parts)
        mean = sum(p[0] for p in parts) / total.clamp(min=1)
        mean.backward()
        return mean.item(), x.grad, sum(p[2]["kl"] for p in parts)

    whole = loss_and_grad([0, n])
    split = loss_and_grad([0, *cuts, n])
    assert split[0] == pytest.approx(whole[0], abs=1e-12)
    assert torch.allclose(split[1], whole[1], atol=1e-12)
    assert split[2].item() == pytest.approx(whole[2].item(), abs=1e-12)


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(3, 5)).tolist() == pytest.approx([math.log(5)] * 3)
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert entropy_from_logits(p.log()).item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert entropy_from_logits(torch.tensor([0.0, 100.0])).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(4, 7, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_grpo_advantages():
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]
    assert grpo_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0).tolist() == pytest.approx(expected)
    assert grpo_advantages([3.0, 1.0], normalize_std=False).tolist() == [1.0, -1.0]
    assert grpo_advantages([2.0]).tolist() == [0.0]
    assert grpo_advantages([0.1, 0.1, 0.1], eps=0.0).tolist() == [0.0, 0.0, 0.0]
    assert grpo_advantages([[1.0, 3.0], [5.0, 5.0]], normalize_std=False).tolist() == [[-1.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="NaN or inf"):
        grpo_advantages([1.0, float("nan")])


@pytest.mark.parametrize("adv", [1.0, -1.0, 1e6, -1e6])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_and_gradient_finite_for_any_finite_log_probs(adv, estimator):
    """[Note: log-ratio clamp]: a stale old_logprob of -100 on a loss token (issue 22: exp
    overflowed, the clipped branch's zero gradient times exp's inf gave NaN weights), and a
    reference far off, keep loss and gradient finite in float32."""
    logp = torch.tensor([-0.5, -200.0, -1.0], requires_grad=True)
    old = torch.tensor([-100.0, -0.1, -1.0])
    ref = torch.tensor([-300.0, -0.1, -1.0])
    config = PolicyLossConfig(kl_coef=0.5, kl_estimator=estimator)
    loss, count, metrics = policy_loss_sum(logp, loss_mask=torch.ones(3),
                                           advantages=torch.full((3,), adv), old_logprobs=old,
                                           ref_logprobs=ref, config=config)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_log_ratio_clamp_is_the_identity_inside_its_range():
    logp = t(-0.5, -3.0, -1.0, grad=True)
    old = t(-20.4, -3.0, -0.9)  # log-ratios 19.9, 0, -0.1: inside [-20, 20]
    loss, _, _ = policy_loss_sum(logp, loss_mask=t(1, 1, 1), advantages=t(-1.0, 2.0, 0.5),
                                 old_logprobs=old, config=CFG)
    loss.backward()
    ratio = torch.exp(t(-0.5, -3.0, -1.0) - old)
    expected = -torch.minimum(ratio * t(-1.0, 2.0, 0.5),
                              ratio.clamp(0.8, 1.2) * t(-1.0, 2.0, 0.5)).sum()
    assert loss.item() == expected.item()
    assert logp.grad[0].item() == pytest.approx(ratio[0].item())  # -A * r, A = -1: unclipped side
