"""NeMo-RL (NVIDIA-NeMo/RL 7ea279a) through its REAL code, `policy.megatron_cfg.prefix_reuse` vs
NeMo-RL's own dense step (make test-frameworks).

Both sides run NeMo-RL's `megatron_forward_backward` (nemo_rl/models/megatron/train.py) on the
same weights and BatchedDataDict: its `get_microbatch_iterator` (sequence packing on and off),
`forward_with_post_processing_fn`, `apply_temperature_scaling`, `LossPostProcessor` (the
`x num_microbatches / cp_size` factor) and `ClippedPGLossFn` (token-level and sequence-level
normalisation, global_valid_toks / global_valid_seqs), temperature / top-k / top-p
`TrainingSamplingParams`. The only difference: `prefix_reuse: true` under `policy.megatron_cfg`
with the hook (megatron_patches/frameworks/nemo_rl.py, NEMO_RL_HOOK) installed. Compared: loss
(sum over microbatches) and every gradient, fp32 1e-5 relative, NaN/inf fail.

Stubs, named (tests/fw_nemo_support.py): modules NeMo-RL imports at load that need a GPU,
an inference engine or are loggers (zmq, pynvml, mlflow, swanlab, wandb, matplotlib), Megatron-Bridge (model providers; its CP partition helper, CP=1 here),
`BatchedDataDict.to("cuda")` kept on CPU, and Transformer Engine's THD attention on the dense
packed side (tests/slime_support.py ThdCoreAttention).
"""
import pytest
import torch

import fw_nemo_support as support
from framework_data import SMALL, grads_of

pytestmark = pytest.mark.megatron
GROUPS = ((30, (6, 9, 5, 11)), (26, (8, 4, 10, 7)))


@pytest.fixture(scope="module")
def nemo():
    return support.import_nemo_rl()


def _data(seed):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for prompt_len, responses in GROUPS:
        prompt = torch.randint(1, SMALL["vocab_size"], (prompt_len,), generator=gen)
        for r in responses:
            seqs.append((torch.cat([prompt, torch.randint(1, SMALL["vocab_size"], (r,),
                                                          generator=gen)]), prompt_len))
    B, S = len(seqs), max(t.numel() for t, _ in seqs)
    ids = torch.zeros(B, S, dtype=torch.int64)
    token_mask = torch.zeros(B, S)
    for b, (t, p) in enumerate(seqs):
        ids[b, :t.numel()] = t
        token_mask[b, p:t.numel()] = 1
    token_mask[1, 33:35] = 0  # tool-output tokens inside a response
    rand = lambda: -0.5 - 3 * torch.rand(B, S, generator=gen)  # noqa: E731
    sample_mask = torch.ones(B)
    sample_mask[5] = 0  # a filtered sample
    return BatchedDataDict({
        "input_ids": ids, "input_lengths": torch.tensor([t.numel() for t, _ in seqs]),
        "token_mask": token_mask, "sample_mask": sample_mask,
        "advantages": torch.randn(B, 1, generator=gen).expand(B, S).clone() * token_mask,
        "prev_logprobs": rand() * token_mask, "generation_logprobs": rand() * token_mask,
        "reference_policy_logprobs": rand() * token_mask})


def _step(nemo, model, data, cfg, loss_cfg, sampling):
    from nemo_rl.algorithms.loss import ClippedPGLossFn
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import LossPostProcessor, megatron_forward_backward
    mbs = 2
    if cfg["sequence_packing"]["enabled"]:  # as NeMo-RL's policy shards a batch for packing
        sharded = data.shard_by_batch_size(1, sequence_packing_args={
            "max_tokens_per_microbatch": 100, "input_key": "input_ids",
            "input_lengths_key": "input_lengths", "algorithm": "modified_first_fit_decreasing",
            "sequence_length_pad_multiple": 1})
        data = (sharded[0] if isinstance(sharded, tuple) else sharded)[0]
    iterator, n_mb, mb_size, seq_dim, padded = get_microbatch_iterator(
        data, cfg, mbs, straggler_timer=support.no_timer())
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    post = LossPostProcessor(loss_fn=ClippedPGLossFn(loss_cfg), cfg=cfg, num_microbatches=n_mb,
                             sampling_params=sampling)
    losses = megatron_forward_backward(
        model=model, data_iterator=iterator, num_microbatches=n_mb, seq_length=padded,
        mbs=mb_size, post_processing_fn=post, global_valid_seqs=data["sample_mask"].sum(),
        global_valid_toks=mask.sum(), sampling_params=sampling)
    return sum(float(m["loss"]) for m in losses), n_mb


CASES = [(False, True, None), (True, True, None), (False, False, None),
         (True, False, (0.7, None, 1.0)), (False, True, (1.0, 20, 0.9)), (True, "gspo", None)]


@pytest.mark.parametrize("packing,token_level,sampling", CASES,
                         ids=["unpacked-token", "packed-token", "unpacked-seq",
                              "packed-seq-temperature", "unpacked-token-topk-topp",
                              "packed-sequence-level-ratios"])
def test_megatron_forward_backward_reuse_equals_nemo_dense(megatron_env, nemo, packing,
                                                          token_level, sampling):
    from megatron_patches.frameworks import nemo_rl as nemo_reuse
    from megatron_patches.training import zero_grads
    nemo_reuse.install()
    model = support.nemo_model(packed=packing)
    data = _data(3)
    loss_cfg = (support.clipped_pg_cfg(token_level_loss=False, sequence_level_importance_ratios=True)
                if token_level == "gspo" else support.clipped_pg_cfg(token_level_loss=token_level))
    params = support.sampling_params(sampling)
    dense_loss, dense_mbs = _step(nemo, model, data, support.policy_cfg(packing, False), loss_cfg,
                                  params)
    dense = grads_of(model)
    zero_grads(model)
    nemo_reuse.last_call = None
    reuse_loss, _ = _step(nemo, model, data, support.policy_cfg(packing, True), loss_cfg, params)
    call = nemo_reuse.last_call
    assert call is not None and call.num_microbatches != dense_mbs
    assert "saved by sharing" in call.last_report
    assert torch.isfinite(torch.tensor([dense_loss, reuse_loss])).all()
    assert abs(dense_loss - reuse_loss) <= 1e-5 * abs(dense_loss), (dense_loss, reuse_loss)
    support.assert_grads_close(dense, grads_of(model))


def test_refusal_before_compute(megatron_env, nemo):
    from megatron_patches.frameworks.nemo_rl import check_nemo_cfg
    cfg = support.policy_cfg(True, True)
    check_nemo_cfg(cfg, {})
    cfg["sequence_packing"]["fuse_loss"] = True
    with pytest.raises(ValueError, match="fuse_loss"):
        check_nemo_cfg(cfg, {})
    with pytest.raises(ValueError, match="draft"):
        check_nemo_cfg(support.policy_cfg(False, True), {"draft_model": object()})
