"""Stop a step whose gradients are not finite before the optimizer touches the weights.

[Note: non-finite gradients stop the step]
A NaN or inf gradient that reaches an optimizer step makes the weights NaN for good (AdamW's
moments keep it); the loss and every later difference are then NaN, and a `max()` fold over
NaN reports 0 (issue 22: a replay printed `reuse vs dense | 0.000e+00`, exit 0). So the dense
and the reuse path check the step's reduced gradients (`main_grad` under Megatron's DDP, else
`.grad`) after the forward-backward and before the optimizer, and raise `NonFiniteGradients`
(a ValueError) naming the step, the first parameter with a non-finite entry and how many there
are. Nothing is skipped silently. `check_finite_grads` is this rank's check (one pass over the
gradients on their device, one host sync); `agree_finite_grads` runs it on every rank and
raises on all of them together ([Note: agreed refusal] in agreement.py): ranks hold different
parameters (TP shards, PP stages), and the optimizer's step is collective.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["NonFiniteGradients", "check_finite_grads", "agree_finite_grads"]


class NonFiniteGradients(ValueError):
    """A step's gradients hold NaN or inf; the optimizer has not run."""


def _grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def check_finite_grads(model, *, step: Optional[int] = None, run: Optional[str] = None) -> None:
    """Raise `NonFiniteGradients` if any gradient of `model` (a module, a Megatron wrapper or a
    list of model chunks) holds NaN or inf; `step` and `run` name the step in the message."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    named = [(f"{i}." if len(chunks) > 1 else "") + name
             for i, chunk in enumerate(chunks) for name, _ in chunk.named_parameters()]
    grads = [_grad(p) for chunk in chunks for p in chunk.parameters()]
    present = [(n, g) for n, g in zip(named, grads) if g is not None]
    if not present:
        return
    flags = torch.stack([torch.isfinite(g).all() for _, g in present]).cpu()  # one sync
    if bool(flags.all()):
        return
    bad = [n for (n, _), ok in zip(present, flags.tolist()) if not ok]
    first = dict(present)[bad[0]]
    nan, inf = int(torch.isnan(first).sum()), int(torch.isinf(first).sum())
    where = " ".join(w for w in (f"step {step}:" if step is not None else "",
                                 f"run {run}:" if run else "") if w)
    raise NonFiniteGradients(
        f"{where + ' ' if where else ''}the gradient of {bad[0]} holds {nan} NaN and {inf} inf "
        f"entries ({len(bad)} parameter(s) with non-finite gradients); the optimizer was not "
        "run and the weights are unchanged. Check the step's data (log-probs, advantages) and "
        "the learning rate ([Note: non-finite gradients stop the step] in "
        "megatron_patches/runtime/finite_grads.py)")


def agree_finite_grads(model, *, step: Optional[int] = None) -> None:
    """`check_finite_grads` on every rank, refused on all ranks together if any rank's
    gradients are not finite (one tiny flag all-reduce: agreement.agree)."""
    from megatron_patches.runtime.agreement import StepChecks

    chunks = model if isinstance(model, (list, tuple)) else [model]
    checks = StepChecks(chunks[0])
    checks.run(check_finite_grads, chunks, step=step)
    checks.agree()
