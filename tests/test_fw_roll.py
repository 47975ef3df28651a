"""ROLL (alibaba/ROLL 8eb27cc) through its REAL code, `actor_train.prefix_reuse` vs ROLL's own
dense step (make test-frameworks).

Both sides run ROLL's `MegatronTrainStrategy.train_step` (roll/distributed/strategy/
megatron_strategy.py) on the same weights and the same DataProto batch (left-padded prompts,
right-padded responses, rows shuffled as ROLL's actor dataloader does): its `batch.chunk`
micro-batching, `loss_scale = num_microbatches x dp`, `_get_batch_num_tokens` /
`_get_global_valid_samples`, `inner_forward_step` and its loss_wrapper, and the RLVR
`ActorWorker.loss_func` (roll/pipeline/rlvr/actor_worker.py: PPO clip, dual clip, token / seq
importance sampling, k3 KL loss, entropy, every `loss_agg_mode` of `agg_loss`). The only
difference: `prefix_reuse: true` on ROLL's WorkerConfig with the hook (megatron_patches/
frameworks/roll.py, ROLL_HOOK) installed. Compared: loss (ROLL's `actor/total_loss@sum` summed
over micro-batches) and every gradient, fp32 1e-5 relative, NaN/inf fail.

Stubs, named in tests/fw_roll_support.py: inert modules for what ROLL imports at load and a
training step never calls (transfer_queue, OpenTelemetry, inference engines), the strategy /
worker objects made without Ray's actor init, the model (`RollGPTStandIn`: a megatron-core
GPTModel taking ROLL's model call with its 2-D left-padded attention mask, in Megatron's DDP in
mcore_adapter's VirtualModels), the optimizer (records gradients), the scheduler step.
"""
import numpy as np
import pytest
import torch

import fw_roll_support as support
from framework_data import SMALL, assert_grads_equal

pytestmark = pytest.mark.megatron
GROUPS = ((30, (6, 9, 5, 11)), (26, (8, 4, 10, 7)))
PER_DEVICE, ACCUMULATION = 2, 4


@pytest.fixture(scope="module")
def roll():
    ms, aw = support.import_roll()
    from megatron_patches.frameworks import roll as roll_reuse
    roll_reuse.install(ms)
    return ms, aw


def _batch(seed):
    """ROLL's actor batch: [B, S] left-padded prompt + right-padded response, `response_mask`
    token-aligned, advantages / log-probs [B, S-1] (entry t: predicting token t+1)."""
    from roll.distributed.scheduler.protocol import DataProto
    gen = torch.Generator().manual_seed(seed)
    P = max(p for p, _ in GROUPS)
    R = max(max(rs) for _, rs in GROUPS)
    rows = []
    for prompt_len, responses in GROUPS:
        prompt = torch.randint(1, SMALL["vocab_size"], (prompt_len,), generator=gen)
        for r in responses:
            rows.append((prompt, torch.randint(1, SMALL["vocab_size"], (r,), generator=gen)))
    B, S = len(rows), P + R
    ids = torch.zeros(B, S, dtype=torch.int64)
    attention, response = torch.zeros(B, S, dtype=torch.int64), torch.zeros(B, S, dtype=torch.int64)
    for b, (prompt, resp) in enumerate(rows):
        lo = P - prompt.numel()
        ids[b, lo:P], ids[b, P:P + resp.numel()] = prompt, resp
        attention[b, lo:P + resp.numel()] = 1
        response[b, P:P + resp.numel()] = 1
    response[1, P + 2:P + 4] = 0  # tool-output tokens inside a response
    mask = response[:, 1:].float()
    adv = torch.randn(B, 1, generator=gen) * mask
    near = -torch.log(torch.tensor(float(SMALL["vocab_size"])))  # the tiny model's log-probs
    old = (near + 0.3 * torch.randn(B, S - 1, generator=gen)) * mask  # ratios both sides of clip
    ref = (near + 0.3 * torch.randn(B, S - 1, generator=gen)) * mask
    infer = old + 0.05 * torch.randn(B, S - 1, generator=gen) * mask  # the rollout engine's
    order = torch.randperm(B, generator=gen)  # ROLL's actor dataloader shuffles
    uuids = np.array([f"sample-{int(i)}" for i in order], dtype=object)
    data = DataProto.from_dict(non_tensors={"sample_uuid": uuids}, tensors={
        "infer_logprobs": infer[order],
        "input_ids": ids[order], "attention_mask": attention[order],
        "response_mask": response[order], "advantages": adv[order],
        "old_log_probs": old[order], "ref_log_probs": ref[order],
        "train_infer_is_weight": torch.ones(B, S - 1)},  # the pipeline's, IS weights off
        meta_info={"loss_mask_keys": ["response_mask", "final_response_mask"], "global_step": 0,
                   "is_offload_optimizer_states_in_train_step": False})
    return data, S


def _train(roll, *, prefix_reuse, loss_settings, seed=7, **worker):
    ms, aw = roll
    batch, S = _batch(seed)
    wc = support.worker_config(prefix_reuse=prefix_reuse, per_device=PER_DEVICE,
                               accumulation=ACCUMULATION, **worker)
    actor, strategy = support.roll_actor(ms, aw, wc=wc, pc=support.pipeline_config(
        **loss_settings), seq_length=S)
    metrics = strategy.train_step(batch=batch, loss_func=actor.loss_func)
    loss = sum(metrics["actor/total_loss@sum"])
    return loss, strategy.optimizer.grads[-1], len(metrics["actor/total_loss@sum"])


def _check(roll, loss_settings):
    from megatron_patches.frameworks import roll as roll_reuse
    d_loss, d_grads, d_mbs = _train(roll, prefix_reuse=False, loss_settings=loss_settings)
    roll_reuse.last_call = None
    r_loss, r_grads, _ = _train(roll, prefix_reuse=True, loss_settings=loss_settings)
    call = roll_reuse.last_call
    assert call is not None and call.dense_num_microbatches == d_mbs == ACCUMULATION
    assert call.num_microbatches != d_mbs and "saved by sharing" in call.report, call.report
    assert torch.isfinite(torch.tensor([d_loss, r_loss])).all() and d_loss != 0
    assert abs(d_loss - r_loss) <= 1e-5 * abs(d_loss), (d_loss, r_loss)
    assert_grads_equal(d_grads, r_grads)


CASES = {
    "token-mean": dict(loss_agg_mode="token-mean"),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean-kl": dict(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True,
                                   kl_loss_coef=0.1),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm"),
    "seq-importance-dual-clip": dict(loss_agg_mode="token-mean", importance_sampling="seq",
                                     dual_clip_loss=True),
    "on-policy-cache-train-infer-correction": dict(
        loss_agg_mode="seq-mean-token-mean", enable_old_logprobs_recompute=False,
        train_infer_correction="token-is-weight-and-sequence-filter"),
    "pg-clip-range": dict(loss_agg_mode="token-mean", use_pg_clip_range=True, pg_clip_low=0.1,
                          pg_clip_high=0.28),
}


@pytest.mark.parametrize("case", list(CASES))
def test_roll_train_step_reuse_equals_roll_dense(megatron_env, roll, case):
    _check(roll, CASES[case])


def test_mutation_wrong_loss_scale_is_caught(megatron_env, roll, monkeypatch):
    """The check can fail: reuse with ROLL's DENSE loss_scale (num_microbatches of the dense
    chunking, not of the reuse plan) must not pass."""
    from megatron_patches.frameworks import roll as roll_reuse
    real = roll_reuse.RollReuseCall._loss

    def wrong_scale(self, batch, firsts, lengths, b, loss_scale):
        return real(self, batch, firsts, lengths, b, self.dense_num_microbatches)
    monkeypatch.setattr(roll_reuse.RollReuseCall, "_loss", wrong_scale)
    with pytest.raises(AssertionError, match="relative gradient difference"):
        _check(roll, CASES["token-mean"])


def test_roll_entropy_loss_fails_in_its_own_fp32_dense_step(megatron_env, roll):
    """Why `entropy_loss_coef > 0` is refused with reuse: ROLL's own dense step cannot run it in
    fp32 here (its non-fused vocab_parallel_entropy backward edits the fp32 logits in place,
    which mcore_adapter's log-prob backward saved), so reuse == dense is not verified. When this
    test fails, ROLL has fixed it: check the mode and lift the refusal."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _train(roll, prefix_reuse=False, loss_settings=dict(entropy_loss_coef=0.01))


@pytest.mark.parametrize("setting", ["apply_loss_scale", "length_loss_weight",
                                     "entropy_loss_coef"])
def test_refusal_before_compute(megatron_env, roll, setting):
    ms, aw = roll
    batch, S = _batch(3)
    worker = {"apply_loss_scale": False} if setting == "apply_loss_scale" else {}
    loss = {"length_loss_weight": dict(length_loss_weight=True),
            "entropy_loss_coef": dict(entropy_loss_coef=0.01)}.get(setting, {})
    wc = support.worker_config(prefix_reuse=True, per_device=PER_DEVICE,
                               accumulation=ACCUMULATION, **worker)
    actor, strategy = support.roll_actor(ms, aw, wc=wc, pc=support.pipeline_config(**loss),
                                         seq_length=S)
    with pytest.raises(ValueError, match=setting):
        strategy.train_step(batch=batch, loss_func=actor.loss_func)
    assert not strategy.optimizer.grads
    for p in strategy.models_unwrapped[0].parameters():
        assert p.main_grad is None or not p.main_grad.any(), "a refused step computed"


def test_switch_is_a_worker_config_field(roll):
    from roll.configs.worker_config import WorkerConfig
    from megatron_patches.frameworks.roll import reuse_enabled, with_prefix_reuse
    cls = with_prefix_reuse(WorkerConfig)
    assert issubclass(cls, WorkerConfig) and not cls().prefix_reuse
    assert reuse_enabled(cls(prefix_reuse=True)) and not reuse_enabled(WorkerConfig())


def test_stubs_are_the_named_ones(roll):
    """Only the modules docs/FRAMEWORKS.md and fw_roll_support name are stubbed."""
    assert {n.split(".")[0] for n in support.STUBS_USED} <= {"transfer_queue", "imageio",
                                                             "opentelemetry"}
    assert "roll" not in {n.split(".")[0] for n in support.STUBS_USED}


def test_log_prob_passes_and_switch_off_reach_megatron_unchanged(megatron_env, roll):
    """The hook hands ROLL's forward_only calls (its `forward_step` log-prob passes) and every
    call with the switch off to Megatron's own function."""
    from functools import partial
    from megatron_patches.frameworks.roll import _Dispatch
    ms, aw = roll
    for reuse, forward_only in ((True, True), (False, False), (False, True)):
        wc = support.worker_config(prefix_reuse=reuse, per_device=PER_DEVICE,
                                   accumulation=ACCUMULATION)
        actor, strategy = support.roll_actor(ms, aw, wc=wc, pc=support.pipeline_config(),
                                             seq_length=8)
        dispatch = _Dispatch(lambda **kw: "megatron")
        step = partial(strategy.inner_forward_step, actor.loss_func)
        assert dispatch(forward_step_func=step, forward_only=forward_only) == "megatron"
