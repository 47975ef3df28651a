"""GRPO/PPO policy loss as a token SUM plus a token count, shared by the dense and the reuse path.

`policy_loss_sum` follows Megatron's 3-tuple loss contract with `calculate_per_token_loss=True`:
it returns the loss summed over the masked tokens of one microbatch and their number; the trainer
divides the sum over all microbatches (and data-parallel ranks) by the global token count. That
is why the result cannot depend on how groups are split into microbatches (exactness.md, "Loss
normalisation"); metrics are sums for the same reason.

Per masked token, with r = exp(logp - old_logp) (old = logp.detach() when not given, so r = 1
with the on-policy gradient of logp * A):

    loss = -min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)
           + kl_coef * KL(logp || ref_logp) - entropy_coef * entropy

KL estimators of KL(pi || ref) from one sample, with d = ref_logp - logp (Schulman's k1/k2/k3):
k1 = -d, k2 = d**2 / 2, k3 = exp(d) - d - 1.

Tokens outside the loss mask contribute exactly 0 to the loss and to its gradient, even if their
log-probs are unusual (their log-ratio is zeroed before exp, so nothing can overflow).

[Note: log-ratio clamp]
The log-ratio logp - old_logp (and k3's d) is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]
before exp, as verl's policy losses and k3 KL do (Megatron-LM's megatron/rl does not clamp). Without
it one stale old_logprob (say -100 on a loss token) makes exp overflow to inf; the clipped branch
then carries the loss but autograd still multiplies its zero gradient by exp's inf: NaN weights.
Inside the range the clamp is the identity (same bits, same gradient), so dense and reuse agree
exactly as before; outside it the ratio saturates at e**20 ~ 4.9e8 and the token's gradient
through the ratio is 0 (as in verl: with a positive advantage the clip zeroes it anyway; with a
negative one the unclamped gradient, -A * e**x, is what overflows). With |advantage| <= 1e6 (Trajectory's bound) every per-token term stays
below ~5e14, so the loss is finite for any finite input (k1/k2 are polynomial in d: finite for
log-probs of magnitude below ~1e18).
Arithmetic is float32, or float64 when the log-probs are float64 (for oracle tests).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PolicyLossConfig", "policy_loss_sum", "entropy_from_logits", "grpo_advantages",
           "LOG_RATIO_CLAMP"]

LOG_RATIO_CLAMP = 20.0
"""|log-ratio| bound before exp ([Note: log-ratio clamp]); verl's value."""

_KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Coefficients of the clipped surrogate, the KL penalty and the entropy bonus."""

    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_eps_low (0 <= value < 1)."""
    clip_eps_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + clip_eps_high (>= 0; DAPO's clip-higher uses > low)."""
    kl_coef: float = 0.0
    """Weight of the per-token KL penalty against the reference policy (>= 0; needs ref_logprobs)."""
    kl_estimator: str = "k3"
    """Which single-sample KL estimator: "k1", "k2" or "k3" (see the module docstring)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, subtracted from the loss (needs entropy when nonzero)."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"PolicyLossConfig.{name}={value!r}; give a finite float")
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low={self.clip_eps_low}; it must be in [0, 1) so that "
                             "1 - clip_eps_low stays positive")
        if self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high}; it must be >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef}; it must be >= 0 (0 disables the KL term)")
        if self.kl_estimator not in _KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r}; choose one of {_KL_ESTIMATORS}")


def _check_like(name: str, value: torch.Tensor | None, shape: torch.Size) -> None:
    if value is not None and (not torch.is_tensor(value) or value.shape != shape):
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"{name} has shape {got} but logprobs has {tuple(shape)}; give one value per "
                         "token, shaped like logprobs")


def _check_inputs(logprobs, loss_mask, advantages, old_logprobs, ref_logprobs, entropy, config) -> None:
    if not torch.is_tensor(logprobs) or not logprobs.dtype.is_floating_point:
        raise ValueError("logprobs must be a floating-point tensor of per-token log-probabilities")
    for name, value in (("loss_mask", loss_mask), ("advantages", advantages),
                        ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs),
                        ("entropy", entropy)):
        _check_like(name, value, logprobs.shape)
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs; pass the reference policy's "
                         "log-probs or set kl_coef=0")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy; pass "
                         "entropy_from_logits(logits) or set entropy_coef=0")


def _kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [Note: log-ratio clamp]
    return torch.expm1(d) - d  # k3 = exp(d) - 1 - d, expm1 keeps it >= 0 for small d


def policy_loss_sum(
    logprobs: torch.Tensor,
    *,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Return (loss summed over masked tokens [0-d float], masked token count [0-d int64], metric sums).

    Metrics (detached 0-d sums over masked tokens): pg_loss, clip_frac (tokens where the clipped
    branch is taken), clip_frac_low / clip_frac_high (by side), kl (when ref_logprobs is given),
    entropy (when entropy is given). Divide any of them by the global token count for a mean.
    """
    _check_inputs(logprobs, loss_mask, advantages, old_logprobs, ref_logprobs, entropy, config)
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    mask = loss_mask > 0
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    logp = logprobs.to(dtype)
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)
    adv = advantages.to(dtype)
    log_ratio = torch.where(mask, logp - old, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [Note: log-ratio clamp]
    clipped = ratio.clamp(1 - config.clip_eps_low, 1 + config.clip_eps_high)
    surrogate, surrogate_clipped = ratio * adv, clipped * adv
    pg = -torch.minimum(surrogate, surrogate_clipped)
    took_clip = mask & (surrogate_clipped < surrogate)
    per_token = pg
    metrics = {
        "pg_loss": torch.where(mask, pg, zero).sum().detach(),
        "clip_frac": took_clip.sum().to(dtype),
        "clip_frac_low": (took_clip & (ratio < 1)).sum().to(dtype),
        "clip_frac_high": (took_clip & (ratio > 1)).sum().to(dtype),
    }
    if ref_logprobs is not None:
        kl = _kl(logp, torch.where(mask, ref_logprobs.to(dtype), logp.detach()), config.kl_estimator)
        metrics["kl"] = torch.where(mask, kl, zero).sum().detach()
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    if entropy is not None:
        ent = entropy.to(dtype)
        metrics["entropy"] = torch.where(mask, ent, zero).sum().detach()
        if config.entropy_coef != 0:
            per_token = per_token - config.entropy_coef * ent
    loss_sum = torch.where(mask, per_token, zero).sum()
    return loss_sum, mask.sum(), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of softmax(logits) over the last dim [..., V] -> [...], differentiable.

    Computed in float32 (float64 for float64 logits). Needs the full vocabulary on this rank; with
    a vocab-parallel output layer the sum over V must be reduced across tensor-parallel ranks.
    """
    if not torch.is_tensor(logits) or logits.dim() < 1 or not logits.dtype.is_floating_point:
        raise ValueError("logits must be a floating-point tensor shaped [..., vocab_size]")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def grpo_advantages(rewards, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one group's rewards [G] (or groups [..., G]): (r - mean) / (std + eps).

    The baseline is the group mean over the last dim; the std is the unbiased sample std (as TRL
    and verl). A group of one, or of all-equal rewards, gets advantage 0. Returns float32.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() < 1 or r.shape[-1] < 1:
        raise ValueError(f"rewards has shape {tuple(r.shape)}; give one reward per trajectory, [G] or [..., G]")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; every reward must be finite")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps={eps}; give a finite value >= 0")
    centred = r - r.mean(dim=-1, keepdim=True)
    if normalize_std and r.shape[-1] > 1:
        centred = centred / (r.std(dim=-1, keepdim=True) + eps)
    # All-equal rewards carry no signal; exact zeros also avoid 0/0 (and rounding noise) when eps=0.
    all_equal = (r == r[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, 0.0, centred).to(torch.float32)
