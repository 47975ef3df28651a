"""Row padding ([Note: row padding] in prefix_schedule/planning/planner.py): every row a multiple
of `row_multiple` (TP under sequence parallelism), exactly.

Plan level (no Megatron): padded lengths, the budget counts padding, inert padding tokens, the
padding is its own sequence of the packed row, refusals. Megatron (one process, TP=1, so the
padding is the only change): padded reuse -- suffix rows, whole prefixes and prefix chunks --
and right-padded dense rows both equal unpadded stock dense, fp32 within 1e-5. The TP=2 +
sequence-parallel runs are in tests/test_sequence_parallel.py.
"""

import pytest
import torch

from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims, reuse_flops
from prefix_schedule.planning.inputs import (build_dense_inputs, build_prefix_inputs,
                                             build_suffix_inputs)
from prefix_schedule.planning.planner import StepPlan, plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS, assert_equal_step, make_batch, run_both

# P-1 odd and even, suffixes of every parity, a prefix of length 1 (dense rows), a singleton
SHAPES = [(34, [7, 9, 4, 5]), (18, [8, 3, 6]), (1, [5, 4]), (10, [3])]


@pytest.mark.parametrize("multiple", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [None, 7])
def test_every_row_is_a_padded_multiple_within_the_budget(multiple, chunk):
    batch = make_batch(3, SHAPES)
    plan = plan_microbatches(batch, token_budget=17, max_seq_len=512, row_multiple=multiple,
                             prefix_chunk_tokens=chunk)
    step = ReuseStep(batch, plan)
    assert plan.row_multiple == multiple and len(plan.microbatches) > 3
    for mb in plan.microbatches:
        assert mb.row_length == mb.num_tokens + mb.padding <= 17
        assert step.microbatch_length(mb.index) == mb.row_length
        assert mb.row_length % multiple == 0 and mb.padding < multiple
    for unit, c in plan.prefix_units().items():
        assert step.prefix_length(unit) == c.row_length == c.length + c.padding
        assert c.row_length % multiple == 0 and c.padding < multiple
    real = [(s.group, s.trajectory) for mb in plan.microbatches for s in mb.segments]
    assert real == [(g, t) for g, (_, lens) in enumerate(SHAPES) for t in range(len(lens))]


def test_padding_tokens_are_inert_and_the_real_tokens_unchanged():
    batch = make_batch(4, SHAPES)
    plain = plan_microbatches(batch, token_budget=16, max_seq_len=512)
    padded = plan_microbatches(batch, token_budget=16, max_seq_len=512, row_multiple=3)
    # budget 16 with multiple 3: real tokens per row <= 15, so the packing may differ; compare
    # per microbatch of the padded plan with the same segments built without padding
    for mb in padded.microbatches:
        row = build_suffix_inputs(batch, mb)
        unpadded = build_suffix_inputs(batch, type(mb)(index=mb.index, segments=mb.segments))
        n, p = mb.num_tokens, mb.padding
        assert row["tokens"].shape == (1, n + p)
        for name, value in unpadded.items():
            assert torch.equal(row[name][:, :n], value), name
            expected = torch.arange(p) if name == "position_ids" else torch.zeros(p)
            assert torch.equal(row[name][0, n:].to(expected.dtype), expected), name
    assert any(mb.padding for mb in padded.microbatches)
    chunked = plan_microbatches(batch, token_budget=16, max_seq_len=512, row_multiple=4,
                                prefix_chunk_tokens=7)
    for c in chunked.prefix_units().values():
        row = build_prefix_inputs(batch, c)
        real = batch.groups[c.group].prefix[c.start:c.start + c.length]
        assert torch.equal(row["tokens"][0, :c.length], real)
        assert torch.equal(row["position_ids"][0, :c.length], torch.arange(c.start, c.start + c.length))
        assert row["tokens"].shape[1] == c.row_length and not row["tokens"][0, c.length:].any()
    assert plain.row_multiple == 1 and not any(mb.padding for mb in plain.microbatches)


def test_dense_rows_right_padded_with_no_loss():
    batch = make_batch(5, [(6, [3])])  # P+n-1 = 8
    plain = build_dense_inputs(batch, 0, 0)
    padded = build_dense_inputs(batch, 0, 0, row_multiple=3)
    assert plain["tokens"].shape == (1, 8) and padded["tokens"].shape == (1, 9)
    for name, value in plain.items():
        assert torch.equal(padded[name][:, :8], value)
    assert padded["loss_mask"][0, 8] == 0 and padded["labels"][0, 8] == 0


def test_padding_is_a_sequence_of_its_own_in_the_suffix_context():
    batch = make_batch(6, [(9, [3, 4]), (1, [2])])  # the dense row of group 1 is 2 tokens long
    plan = plan_microbatches(batch, token_budget=12, max_seq_len=512, row_multiple=4)
    (mb,) = plan.microbatches
    assert (mb.num_tokens, mb.padding) == (9, 3)
    ctx = ReuseStep(batch, plan).suffix_context(0)
    assert ctx.meta.cu_seqlens == (0, 3, 7, 9, 12)
    assert ctx.slot_groups == (0, None, None)  # group 0's cache; the dense row; the padding
    assert ctx.meta.seq_slot == (0, 0, 1, 2)
    assert ctx.position_ids.tolist() == [8, 9, 10, 8, 9, 10, 11, 0, 1, 0, 1, 2]
    assert ctx.max_position == 11


def test_budget_counts_padding_and_refusals():
    batch = make_batch(7, [(9, [5, 5])])
    with pytest.raises(ValueError, match="needs 6 tokens padded to a multiple of 2"):
        plan_microbatches(batch, token_budget=5, max_seq_len=512, row_multiple=2)
    # budget 9: at most 8 real tokens per row (9 would pad to 10), so 5 + 5 do not share one
    plan = plan_microbatches(batch, token_budget=9, max_seq_len=512, row_multiple=2)
    assert [(mb.num_tokens, mb.row_length) for mb in plan.microbatches] == [(5, 6), (5, 6)]
    assert [mb.row_length for mb in plan_microbatches(
        batch, token_budget=10, max_seq_len=512, row_multiple=2).microbatches] == [10]
    with pytest.raises(ValueError, match="row_multiple=0"):
        plan_microbatches(batch, token_budget=10, max_seq_len=512, row_multiple=0)
    mb = plan.microbatches[0]
    with pytest.raises(ValueError, match="its padding must be 1"):
        StepPlan(microbatches=(type(mb)(index=0, segments=mb.segments),), prefixes=plan.prefixes,
                 token_budget=9, row_multiple=2)


def test_flops_count_padding_as_overhead():
    dims = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, gated_linear_unit=True)
    batch = make_batch(8, SHAPES)
    plans = [plan_microbatches(batch, token_budget=24, max_seq_len=512, row_multiple=m,
                               prefix_chunk_tokens=7) for m in (1, 4)]
    assert reuse_flops(dims, plans[1]) > reuse_flops(dims, plans[0])


# ---- real Megatron, one process: padding alone (TP=1) changes nothing -------------------------

@pytest.fixture(scope="module")
def model(megatron_env):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    built = build_model(TinyLlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176,
                                        num_attention_heads=4, num_query_groups=2,
                                        vocab_size=256, max_seq_len=512))
    built.config.finalize_model_grads_func = scale_grads_by_token_count
    return built


@pytest.mark.megatron
@pytest.mark.parametrize("multiple,chunk", [(2, None), (3, 7), (4, 5)])
def test_padded_reuse_equals_unpadded_dense(model, multiple, chunk):
    batch = make_batch(10 + multiple, SHAPES)
    dense, dense_grads, reuse, reuse_grads, plan = run_both(
        model, batch, 16, row_multiple=multiple, prefix_chunk_tokens=chunk)
    assert any(mb.padding for mb in plan.microbatches)
    assert any(c.padding for c in plan.prefix_units().values())
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)


@pytest.mark.megatron
def test_right_padded_dense_equals_unpadded_dense(model):
    from megatron_patches.training import dense_step, param_grads

    batch = make_batch(20, SHAPES)
    results = []
    for multiple in (1, 4):
        model.zero_grad(set_to_none=True)
        results += [dense_step(model, batch, LOSS, row_multiple=multiple), param_grads(model)]
    model.zero_grad(set_to_none=True)
    assert_equal_step(*results)


def test_a_plan_that_does_not_cover_the_batch_is_still_refused():
    batch = make_batch(9, SHAPES)
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512, row_multiple=2)
    other = GroupBatch(groups=batch.groups[:1])
    with pytest.raises(ValueError, match="does not belong to this batch|is not in the batch"):
        for mb in plan.microbatches:
            build_suffix_inputs(other, mb)
