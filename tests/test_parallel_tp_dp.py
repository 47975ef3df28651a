"""Prefix reuse under Megatron tensor and data parallelism: multi-process gloo runs on CPU.

Comparisons are fp32, relative max-abs error <= 1e-5 (training.max_relative_diff; weights after
AdamW: 1e-4, see ADAM_TOL):
- TP=2: reuse == stock Megatron TP=2 dense, each rank's shard (loss and every gradient), and the
  gathered shards == a TP=1 single-process dense reference; also GQA with fewer K/V heads than
  TP ranks (Megatron gathers QKV and gives each rank a copy of its K/V head).
- DP=2: groups placed by place_groups (unequal loss-token counts per rank), Megatron DDP +
  finalize_model_grads + no_sync: reuse == DP=2 dense == single-process dense over the whole
  batch; a per-rank token mean would be visibly different (the test can fail); two AdamW steps,
  the second on one group that place_groups splits over both ranks (prefix run on each).
- TP=2 with an entropy bonus (vocab-parallel entropy): same comparisons.
- TP=2 with sequence parallelism: tests/test_sequence_parallel.py (padded rows of any length).
- TP=2 x DP=2 (4 processes): reuse == dense per shard, gathered == TP=1 reference.
Rank functions are module-level so the harness can run them in fresh processes.
"""

import dataclasses

import pytest
import torch

from dist_harness import run_distributed
from prefix_schedule.losses import PolicyLossConfig
from test_equivalence import make_batch

TOL = 1e-5
# Weights after AdamW: its first update is lr * g / (|g| + eps) per element, so an element whose
# gradient is near eps (1e-8) turns fp32 rounding noise of ~1e-7 x max|g| into a visible part of
# lr. Measured (DP=2, lr 1e-3): reuse vs single-process 3.4e-5, DP dense vs single-process 2e-6
# (the same row computations, only the reduction order differs). A wrong gradient moves a weight
# by ~lr (relative ~1e-2), far above this bound; the step-2 gradients are held to TOL.
ADAM_TOL = 1e-4
TIMEOUT_S = 150
# entropy_coef is 0 except in the test of the vocab-parallel entropy (rl.token_entropy).
LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05)
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)
SHAPES = [(33, [6, 9, 4]), (17, [8, 3]), (50, [5, 7, 6, 2]), (9, [4, 4, 6])]
BUDGET = 16
# one group over two DP ranks: place_groups splits it, its prefix runs on both ranks
SHAPES_ONE_GROUP = [(40, [6, 9, 4, 7, 5])]


# ---- helpers that run inside a rank ---------------------------------------------------------

def _setup(tp: int) -> None:
    import megatron_patches
    from megatron_patches.models.tiny import initialize_distributed

    megatron_patches.install()
    initialize_distributed(seed=1234, tp=tp)


def _build(ddp: bool = False, sequence_parallel: bool = False, **model_overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import prepare_for_training

    model = build_model(TinyLlamaConfig(**{**MODEL, **model_overrides}),
                        sequence_parallel=sequence_parallel)
    return prepare_for_training(model, ddp=ddp)


def _zero(model) -> None:
    from megatron_patches.training import zero_grads

    zero_grads(model)


def _grads(model):
    from megatron_patches.training import param_grads

    return {name.removeprefix("module."): g for name, g in param_grads(model).items()}


def _dense_and_reuse(model, batch):
    """(dense result, dense grads, reuse result, reuse grads) of `batch` on this rank."""
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches

    _zero(model)
    dense = dense_step(model, batch, LOSS)
    dense_grads = _grads(model)
    _zero(model)
    plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"])
    reuse = reuse_step(model, batch, plan, LOSS)
    return dense, dense_grads, reuse, _grads(model)


def _global_loss(result, group) -> float:
    """Token mean over the DP group of a StepResult (sum of losses / sum of tokens)."""
    totals = torch.tensor([result.loss * result.num_tokens, float(result.num_tokens)],
                          dtype=torch.float64)
    torch.distributed.all_reduce(totals, group=group)
    return float(totals[0] / totals[1])


def _gather_tp(model, tensors):
    """Full (TP=1 layout) tensors from this rank's shards: params with `tensor_model_parallel`
    are all-gathered over TP and reassembled along `partition_dim`, honouring `partition_stride`
    (Megatron's CPU init gives rank r the chunks r, r+tp, ... of `stride * tp` chunks)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    params = {name.removeprefix("module."): p for name, p in model.named_parameters()}
    full = {}
    for name, shard in tensors.items():
        param = params[name]
        if not getattr(param, "tensor_model_parallel", False) or tp == 1:
            full[name] = shard.clone()
            continue
        shards = [torch.empty_like(shard) for _ in range(tp)]
        torch.distributed.all_gather(shards, shard.contiguous(), group=group)
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        pieces = [s.chunk(stride, dim=dim) for s in shards]
        full[name] = torch.cat([pieces[r][i] for i in range(stride) for r in range(tp)], dim=dim)
    return full


def _weights(model):
    return {name.removeprefix("module."): p.detach().float().clone()
            for name, p in model.named_parameters()}


def _tp1_reference(batch, full_weights, full_grads, reuse_loss, model_overrides):
    """Rebuild at TP=1 (collective), then global rank 0 alone runs stock dense on `batch` and
    compares with the gathered TP>1 weights and reuse gradients."""
    from megatron_patches.training import dense_step, max_relative_diff

    _setup(tp=1)
    if torch.distributed.get_rank() != 0:
        return None
    model = _build(**model_overrides)
    result = dense_step(model, batch, LOSS)
    return {
        "weights_vs_tp1": max_relative_diff(_weights(model), full_weights),
        "grads_vs_tp1": max_relative_diff(_grads(model), full_grads),
        "loss_vs_tp1": abs(result.loss - reuse_loss) / abs(result.loss),
    }


def _step_diffs(dense, dense_grads, reuse, reuse_grads) -> dict:
    from megatron_patches.training import max_relative_diff, missing_grads

    return {
        "tokens": (dense.num_tokens, reuse.num_tokens),
        "loss": abs(dense.loss - reuse.loss) / abs(dense.loss),
        "grads": max_relative_diff(dense_grads, reuse_grads),
        "missing_grads": missing_grads(dense=dense_grads, reuse=reuse_grads),
    }


# ---- rank functions ---------------------------------------------------------------------------

class _HeadRecorder:
    """Wraps the installed core-attention hook; records (query heads, K/V heads) it is given."""

    def __init__(self):
        from megatron.core.transformer import attention

        self.seen, self._module, self._hook = set(), attention, attention._core_attention_hook

    def __call__(self, module, query, key, value, *args, **kwargs):
        self.seen.add((query.shape[2], key.shape[2]))
        return self._hook(module, query, key, value, *args, **kwargs)

    def __enter__(self):
        self._module._core_attention_hook = self
        return self

    def __exit__(self, *exc):
        self._module._core_attention_hook = self._hook


def tp_rank(num_query_groups: int, entropy_coef: float = 0.0) -> dict:
    """TP=2: reuse vs dense on this rank's shard, then gathered vs a TP=1 reference."""
    global LOSS
    LOSS = dataclasses.replace(LOSS, entropy_coef=entropy_coef)  # this rank process only
    _setup(tp=2)
    model = _build(num_query_groups=num_query_groups)
    batch = make_batch(31, SHAPES)
    with _HeadRecorder() as heads:
        dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(model, batch)
    out = _step_diffs(dense, dense_grads, reuse, reuse_grads)
    out["hook_heads"] = sorted(heads.seen)
    out["entropy_sum"] = sum(float(r["entropy"][0]) for r in reuse.reports if "entropy" in r)
    full_grads = _gather_tp(model, reuse_grads)
    full_weights = _gather_tp(model, _weights(model))
    out["reference"] = _tp1_reference(batch, full_weights, full_grads, reuse.loss,
                                      dict(num_query_groups=num_query_groups))
    return out


def _local_mean_control(model, local_batch, dp_group, reference_grads) -> float:
    """How far a per-rank token mean (averaged over DP) is from the global token mean."""
    from megatron_patches.training import dense_step, max_relative_diff

    _zero(model)
    dense_step(model, local_batch, LOSS)
    grads = _grads(model)
    for g in grads.values():
        torch.distributed.all_reduce(g, group=dp_group)
        g.div_(torch.distributed.get_world_size(dp_group))
    return max_relative_diff(reference_grads, grads)


def _adamw_step(model, optimizer) -> None:
    for p in model.parameters():  # DDP keeps the reduced gradient in main_grad
        p.grad = getattr(p, "main_grad", p.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a stale alias of main_grad would double the next one


def dp_rank() -> dict:
    """DP=2: placed groups, DDP reuse vs DDP dense vs single-process dense; two AdamW steps."""
    from megatron.core import parallel_state

    from megatron_patches.training import dense_step, max_relative_diff
    from prefix_schedule.planning.placement import place_groups

    _setup(tp=1)
    rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    ddp, reference = _build(ddp=True), _build()
    out = {"steps": []}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (ddp, reference)]
    for step, (seed, shapes) in enumerate(((41, SHAPES), (42, SHAPES_ONE_GROUP))):
        batch = make_batch(seed, shapes)
        placement = place_groups(batch, dp_size=dp, token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"])
        local = placement.ranks[rank].batch
        _zero(reference)
        whole = dense_step(reference, batch, LOSS)
        reference_grads = _grads(reference)
        dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(ddp, local)
        record = _step_diffs(dense, dense_grads, reuse, reuse_grads)
        record.update(
            placement=placement.describe(),
            split_groups=placement.split_groups,
            local_tokens=[r.num_loss_tokens for r in placement.ranks],
            reuse_vs_single=max_relative_diff(reference_grads, reuse_grads),
            global_loss_vs_single=abs(_global_loss(reuse, dp_group) - whole.loss) / abs(whole.loss),
        )
        if step == 0:
            record["local_mean_control"] = _local_mean_control(reference, local, dp_group,
                                                               reference_grads)
            for name, p in reference.named_parameters():  # back to the whole-batch gradient
                p.grad = reference_grads[name].clone()
        for model, optimizer in zip((ddp, reference), optimizers):
            _adamw_step(model, optimizer)
        record["weights_vs_single"] = max_relative_diff(_weights(reference), _weights(ddp))
        out["steps"].append(record)
    out["weights_checksum"] = float(sum(p.double().sum() for p in _weights(ddp).values()))
    return out


def tp_dp_rank() -> dict:
    """TP=2 x DP=2: DDP reuse vs DDP dense per shard; gathered vs a TP=1 reference on rank 0."""
    from megatron.core import parallel_state

    from prefix_schedule.planning.placement import place_groups

    _setup(tp=2)
    dp_rank_ = parallel_state.get_data_parallel_rank()
    batch = make_batch(51, SHAPES)
    placement = place_groups(batch, dp_size=parallel_state.get_data_parallel_world_size(),
                             token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"])
    ddp = _build(ddp=True)
    dense, dense_grads, reuse, reuse_grads = _dense_and_reuse(ddp, placement.ranks[dp_rank_].batch)
    out = _step_diffs(dense, dense_grads, reuse, reuse_grads)
    global_loss = _global_loss(reuse, parallel_state.get_data_parallel_group())
    full_grads = _gather_tp(ddp, reuse_grads)
    full_weights = _gather_tp(ddp, _weights(ddp))
    out["reference"] = _tp1_reference(batch, full_weights, full_grads, global_loss, {})
    return out


# ---- tests ------------------------------------------------------------------------------------

def _assert_step(record) -> None:
    assert record["tokens"][0] == record["tokens"][1]
    assert not record["missing_grads"], f"no (or a non-finite) gradient: {record['missing_grads'][:5]}"
    assert record["loss"] <= TOL, record
    assert record["grads"] <= TOL, record


def _assert_reference(reference) -> None:
    assert reference["weights_vs_tp1"] == 0.0, "TP=2 shards are not the TP=1 weights split"
    assert reference["grads_vs_tp1"] <= TOL, reference
    assert reference["loss_vs_tp1"] <= TOL, reference


@pytest.mark.megatron
def test_tp2_reuse_equals_tp2_dense_and_tp1_reference():
    results = run_distributed(tp_rank, world_size=2, kwargs={"num_query_groups": 2},
                              timeout_s=TIMEOUT_S)
    for rank, record in enumerate(results):
        assert record["hook_heads"] == [(2, 1)], record  # 4 query heads, 2 K/V heads over 2 ranks
        _assert_step(record)
    _assert_reference(results[0]["reference"])


@pytest.mark.megatron
def test_tp2_entropy_bonus_is_vocab_parallel():
    """entropy_coef > 0 under TP: rl.token_entropy all-reduces the vocabulary sums; reuse ==
    TP=2 dense == TP=1 dense (which uses the plain full-vocabulary entropy). The coefficient is
    large because a fresh model's near-uniform logits have a tiny entropy gradient; at 2.0 an
    all-reduce with a summing backward (gradient x2) is off by 4e-4, at 0.05 only by 1.1e-5."""
    results = run_distributed(tp_rank, world_size=2,
                              kwargs={"num_query_groups": 2, "entropy_coef": 2.0},
                              timeout_s=TIMEOUT_S)
    for record in results:
        _assert_step(record)
        assert record["entropy_sum"] > 1.0, record  # the bonus was computed (about log V per token)
    assert results[0]["entropy_sum"] == results[1]["entropy_sum"]
    _assert_reference(results[0]["reference"])


@pytest.mark.megatron
def test_tp2_with_fewer_kv_heads_than_ranks():
    """num_query_groups=1 < TP=2: Megatron gathers QKV, each rank keeps its 2 query heads and a
    copy of the one K/V head; the hook sees exactly that, and reuse still equals dense."""
    results = run_distributed(tp_rank, world_size=2, kwargs={"num_query_groups": 1},
                              timeout_s=TIMEOUT_S)
    for record in results:
        assert record["hook_heads"] == [(2, 1)], record
        _assert_step(record)
    _assert_reference(results[0]["reference"])


@pytest.mark.megatron
def test_dp2_placed_reuse_equals_dense_and_single_process():
    results = run_distributed(dp_rank, world_size=2, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        for record in result["steps"]:
            _assert_step(record)
            tokens = record["local_tokens"]
            assert tokens[0] != tokens[1] and tokens[rank] == record["tokens"][1], record["placement"]
            assert record["reuse_vs_single"] <= TOL, record
            assert record["global_loss_vs_single"] <= TOL, record
            assert record["weights_vs_single"] <= ADAM_TOL, record
        assert [r["split_groups"] for r in result["steps"]] == [{}, {0: (0, 1)}]
        # normalising by each rank's own tokens would be wrong by far more than the tolerance
        assert result["steps"][0]["local_mean_control"] > 1e-3, result["steps"][0]
    assert results[0]["weights_checksum"] == results[1]["weights_checksum"]


@pytest.mark.megatron
def test_tp2_dp2_reuse_equals_dense_and_tp1_reference():
    results = run_distributed(tp_dp_rank, world_size=4, timeout_s=TIMEOUT_S)
    for record in results:
        _assert_step(record)
    _assert_reference(results[0]["reference"])
