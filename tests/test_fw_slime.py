"""slime (THUDM/slime 624b824) through its REAL code, `--prefix-reuse` vs slime's own dense step
(make test-frameworks).

Both sides run slime's `train_one_step` (slime/backends/megatron_utils/model.py) on the same
weights and the same rollout: slime's argument parser (Megatron's + slime's provider +
`--prefix-reuse` through `add_custom_arguments`), slime's `compute_advantages_and_returns`
(its advantage estimators), `DataIterator` / `get_batch` (THD packing, pad to 128), and
`loss.py::loss_function` with its sample-mean normalisers, `--calculate-per-token-loss` on and
off. The only difference: with `--prefix-reuse` the hook (megatron_patches/frameworks/slime.py,
SLIME_HOOK) replaces slime's `get_forward_backward_func`. Compared: every gradient (Megatron
DDP main_grad, just before the optimizer step), slime's reduced loss dict, fp32 1e-5 relative,
NaN/inf fail. `train` (slime's per-rollout loop) runs 2 steps each way, and so does slime's
Megatron actor, `MegatronTrainRayActor.train`, without Ray (its log-prob recompute, advantages,
train loop; the actor object made without its Ray/NCCL/checkpoint __init__). Stubs:
tests/slime_support.py (wandb, SGLang's CLI argument classes and engine internals,
torch_memory_saver, a CPU accelerator backend, `ray.get` as the identity, Transformer Engine's
THD attention for the dense side).
"""
import pytest
import torch

import slime_support as support
from framework_data import SMALL

pytestmark = pytest.mark.megatron
GROUPS = ((40, (6, 9, 5, 11)), (33, (8, 4, 10, 7)), (45, (5, 12, 6, 9)))
"""Per prompt: its length and its 4 responses' lengths (n_samples_per_prompt=4)."""
RTOL = 1e-5


@pytest.fixture(scope="module")
def slime_model_module():
    if support.REQUIRE:
        import ray  # noqa: F401  (the frameworks venv; slime imports it)
    return support.import_slime()


def _rollout_data(args, seed, steps=1):
    """slime's rollout_data for `steps` training steps of 12 samples (3 prompts x 4)."""
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    gen = torch.Generator().manual_seed(seed)
    data = {k: [] for k in ("tokens", "total_lengths", "response_lengths", "loss_masks",
                            "rewards", "log_probs", "ref_log_probs")}
    for _ in range(steps):
        for prompt_len, responses in GROUPS:
            prompt = torch.randint(1, SMALL["vocab_size"], (prompt_len,), generator=gen)
            for r in responses:
                resp = torch.randint(1, SMALL["vocab_size"], (r,), generator=gen)
                data["tokens"].append(torch.cat([prompt, resp]))
                data["total_lengths"].append(prompt_len + r)
                data["response_lengths"].append(r)
                mask = torch.ones(r, dtype=torch.int)  # slime keeps loss masks as ints
                if r > 8:
                    mask[2:4] = 0  # tool-output tokens inside the response
                data["loss_masks"].append(mask)
                data["rewards"].append(float(torch.rand((), generator=gen)))
                data["log_probs"].append(-0.5 - 3 * torch.rand(r, generator=gen))
                data["ref_log_probs"].append(-0.5 - 3 * torch.rand(r, generator=gen))
    compute_advantages_and_returns(args, data)
    n = len(data["tokens"])
    data["micro_batch_indices"] = [list(range(i, min(i + 5, n))) for i in range(0, n, 5)]
    return data


def _step_microbatches(data, steps):
    """Per step, slime's microbatch count: micro batches of 5 within each 12-sample step."""
    per_step = len(data["tokens"]) // steps
    out, indices = [], []
    for s in range(steps):
        lo, hi = s * per_step, (s + 1) * per_step
        step_mbs = [list(range(i, min(i + 5, hi))) for i in range(lo, hi, 5)]
        out.append(len(step_mbs))
        indices += step_mbs
    data["micro_batch_indices"] = indices
    return out


def _train_one_step(module, args, data, prefix_reuse):
    from slime.backends.megatron_utils.data import DataIterator
    from megatron_patches.frameworks import slime as slime_reuse
    args.prefix_reuse = prefix_reuse
    model = support.slime_model()
    optimizer, scheduler = support.slime_optimizer(args, model)
    grads = []
    support.record_grads(optimizer, model, grads)
    num_mbs = _step_microbatches(data, 1)
    config = model[0].config
    from megatron.core.distributed import finalize_model_grads
    config.finalize_model_grads_func = finalize_model_grads  # as slime's train() sets them
    config.grad_scale_func = optimizer.scale_loss
    slime_reuse.install(module)
    slime_reuse.last_call = None
    iterator = [DataIterator(data, data["micro_batch_indices"])]
    losses, _ = module.train_one_step(args, 0, 0, iterator, model, optimizer, scheduler,
                                      num_mbs[0], len(data["tokens"]))
    call = slime_reuse.last_call
    if prefix_reuse:  # the reuse schedule ran: its own microbatch count, prompts shared
        assert call is not None and call.num_microbatches != num_mbs[0], call
        assert "saved by sharing" in call.last_report, call.last_report
    else:
        assert call is None
    return losses, grads[0]


def _assert_close(dense: dict, reuse: dict, what: str):
    assert dense.keys() == reuse.keys(), (what, dense.keys(), reuse.keys())
    for name, d in dense.items():
        r = reuse[name]
        d, r = torch.as_tensor(d, dtype=torch.float64), torch.as_tensor(r, dtype=torch.float64)
        assert torch.isfinite(d).all() and torch.isfinite(r).all(), (what, name)
        scale = d.abs().max().clamp(min=1e-12)
        err = (d - r).abs().max() / scale
        assert err <= RTOL, f"{what} {name}: relative error {float(err):.2e}"


def test_prefix_reuse_is_a_slime_argument(slime_model_module):
    assert support.slime_args().prefix_reuse is False
    assert support.slime_args("--prefix-reuse").prefix_reuse is True


CASES = [("grpo", False, ()), ("grpo", True, ()),
         ("grpo", False, ("--use-kl-loss", "--kl-loss-coef", "0.05", "--entropy-coef", "0.01")),
         ("gspo", False, ()), ("cispo", True, ()), ("reinforce_plus_plus", True, ()),
         ("reinforce_plus_plus_baseline", False, ("--normalize-advantages",))]


@pytest.mark.parametrize("estimator,per_token,extra", CASES,
                         ids=[f"{e}-{'per_token' if p else 'sample_mean'}{'-kl' if x and 'kl' in x[0] else ''}"
                              for e, p, x in CASES])
def test_train_one_step_reuse_equals_slime_dense(megatron_env, slime_model_module, estimator,
                                                 per_token, extra):
    argv = ["--advantage-estimator", estimator, *(["--calculate-per-token-loss"] if per_token
                                                  else []), *extra]
    args = support.slime_args(*argv)
    data = _rollout_data(args, seed=7)
    dense_loss, dense_grads = _train_one_step(slime_model_module, args, data, False)
    reuse_loss, reuse_grads = _train_one_step(slime_model_module, args, data, True)
    assert dense_loss["loss"] != 0
    _assert_close(dense_loss, reuse_loss, "loss dict")
    _assert_close(dense_grads, reuse_grads, "grad")


def test_slime_train_two_steps_reuse_equals_dense(megatron_env, slime_model_module):
    """slime's `train` (the per-rollout loop its actor runs): 2 optimizer steps each way."""
    from megatron.core.distributed import finalize_model_grads  # noqa: F401
    from slime.backends.megatron_utils.data import DataIterator
    from megatron_patches.frameworks import slime as slime_reuse
    slime_reuse.install(slime_model_module)
    args = support.slime_args("--advantage-estimator", "grpo")
    data = _rollout_data(args, seed=9, steps=2)
    num_mbs = _step_microbatches(data, 2)
    runs = {}
    for reuse in (False, True):
        args.prefix_reuse = reuse
        model = support.slime_model()
        optimizer, scheduler = support.slime_optimizer(args, model)
        grads = []
        support.record_grads(optimizer, model, grads)
        iterator = [DataIterator(data, data["micro_batch_indices"])]
        slime_reuse.last_call = None
        slime_model_module.train(0, model, optimizer, scheduler, iterator, num_mbs, [12, 12])
        assert (slime_reuse.last_call is not None) == reuse
        assert not reuse or slime_reuse.last_call.num_microbatches is not None  # a train step
        runs[reuse] = grads, {n: p.detach().clone() for n, p in model[0].named_parameters()}
    assert len(runs[False][0]) == len(runs[True][0]) == 2
    for step in range(2):
        _assert_close(runs[False][0][step], runs[True][0][step], f"step {step} grad")
    _assert_close(runs[False][1], runs[True][1], "weights after 2 steps")


def test_refusals_before_compute(megatron_env, slime_model_module):
    from megatron_patches.frameworks.slime import check_slime_args
    args = support.slime_args("--prefix-reuse")
    check_slime_args(args)
    args.allgather_cp = True
    with pytest.raises(ValueError, match="allgather-cp"):
        check_slime_args(args)
    args.allgather_cp, args.rollout_top_p = False, 0.9
    with pytest.raises(ValueError, match="rollout-top-p"):
        check_slime_args(args)


def test_slime_actor_train_two_steps_reuse_equals_dense(megatron_env, slime_model_module,
                                                        monkeypatch):
    """slime's Megatron actor: `MegatronTrainRayActor.train(rollout_id, rollout_data_ref)`
    without Ray (slime_support.slime_actor; `ray.get` of the rollout's object reference is the
    identity here: Ray's object store). One rollout of 2 training steps: slime's
    process_rollout_data, its log-prob recompute (`forward_only`, dense either way),
    compute_advantages_and_returns, `train` -> 2 x train_one_step."""
    import ray
    from slime.utils.misc import Box
    from megatron_patches.frameworks import slime as slime_reuse
    slime_reuse.install(slime_model_module)
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    args = support.slime_args("--advantage-estimator", "grpo")
    base = _rollout_data(args, seed=5, steps=2)
    num_mbs = _step_microbatches(base, 2)
    runs = {}
    for reuse in (False, True):
        args.prefix_reuse = reuse
        model = support.slime_model()
        optimizer, scheduler = support.slime_optimizer(args, model)
        grads = []
        support.record_grads(optimizer, model, grads)
        actor = support.slime_actor(args, model, optimizer, scheduler)
        n = len(base["tokens"])
        rollout = {k: list(base[k]) for k in ("tokens", "total_lengths", "response_lengths",
                                              "loss_masks", "rewards")}
        rollout.update(partition=list(range(n)), num_microbatches=num_mbs,
                       global_batch_sizes=[n // 2, n // 2],
                       micro_batch_indices=base["micro_batch_indices"])
        slime_reuse.last_call = None
        actor.train(0, [Box(rollout)])
        assert (slime_reuse.last_call is not None) == reuse
        assert not reuse or slime_reuse.last_call.num_microbatches is not None  # a train step
        runs[reuse] = grads, {n_: p.detach().clone() for n_, p in model[0].named_parameters()}
    assert len(runs[False][0]) == len(runs[True][0]) == 2
    for step in range(2):
        _assert_close(runs[False][0][step], runs[True][0][step], f"actor step {step} grad")
    _assert_close(runs[False][1], runs[True][1], "actor weights after 2 steps")
