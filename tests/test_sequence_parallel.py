"""Prefix reuse under TP=2 with sequence parallelism, rows of any length (2 gloo processes).

Megatron scatters every row along the sequence over the TP ranks, so every row must be a
multiple of TP: reuse plans pad their rows (`plan_microbatches(..., row_multiple=2)`, [Note: row
padding] in prefix_schedule/planning/planner.py) and stock dense right-pads its rows (loss mask
0). The data has odd prompt and suffix lengths, groups spanning several microbatches, a dense
singleton, a 1-token prefix, and (one case) odd prefix chunks. fp32, relative max-abs error
<= 1e-5: reuse == stock Megatron SP dense on each rank's shard (loss and every gradient); the
gathered shards == a TP=1 single-process unpadded dense reference; a plan whose rows are not
multiples of TP is refused before any compute.
"""

import pytest

from dist_harness import run_distributed
from test_equivalence import make_batch
from test_parallel_tp_dp import (BUDGET, LOSS, MODEL, TIMEOUT_S, _assert_reference, _assert_step,
                                 _build, _gather_tp, _grads, _setup, _step_diffs, _tp1_reference,
                                 _weights, _zero)

pytestmark = pytest.mark.megatron

# P-1 = 33, 17, 0 (dense rows), 9 (a singleton run dense); suffixes of both parities
SHAPES_ANY = [(34, [7, 9, 4, 5, 11]), (18, [8, 3, 6]), (1, [5, 4]), (10, [3])]
CASES = {"whole prefixes": {}, "odd prefix chunks": {"prefix_chunk_tokens": 7}}


class _RowLengths:
    """Wraps the installed core-attention hook; records the sequence length of q it is given."""

    def __init__(self):
        from megatron.core.transformer import attention

        self.seen, self._module, self._hook = set(), attention, attention._core_attention_hook

    def __call__(self, module, query, *args, **kwargs):
        self.seen.add(query.shape[0])
        return self._hook(module, query, *args, **kwargs)

    def __enter__(self):
        self._module._core_attention_hook = self
        return self

    def __exit__(self, *exc):
        self._module._core_attention_hook = self._hook


def _refusal(model, batch) -> str:
    """A plan whose rows are not multiples of TP is refused before any compute."""
    from megatron_patches.training import reuse_step
    from prefix_schedule.planning.planner import plan_microbatches

    plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"])
    calls = []
    hook = model.module.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        reuse_step(model, batch, plan, LOSS)
    except ValueError as exc:
        assert not calls, "the model ran before the refusal"
        return str(exc)
    finally:
        hook.remove()
    return "not refused"


def sp_rank() -> dict:
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches

    _setup(tp=2)
    model = _build(ddp=True, sequence_parallel=True)  # finalize sums the norms' grads over TP
    batch = make_batch(37, SHAPES_ANY)
    _zero(model)
    dense = dense_step(model, batch, LOSS)  # rows right-padded to even lengths
    dense_grads = _grads(model)
    out = {"sequence_parallel": model.config.sequence_parallel, "cases": {}}
    for name, plan_kwargs in CASES.items():
        _zero(model)
        plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=MODEL["max_seq_len"],
                                 row_multiple=2, **plan_kwargs)
        with _RowLengths() as lengths:
            reuse = reuse_step(model, batch, plan, LOSS)
        reuse_grads = _grads(model)
        record = _step_diffs(dense, dense_grads, reuse, reuse_grads)
        record.update(
            hook_lengths=sorted(lengths.seen),
            row_lengths=sorted({mb.row_length for mb in plan.microbatches}
                               | {c.row_length for c in plan.prefix_units().values()}),
            padded_rows=sum(mb.padding > 0 for mb in plan.microbatches),
            padded_units=sum(c.padding > 0 for c in plan.prefix_units().values()),
            max_microbatches_per_group=max(
                sum(g in mb.groups for mb in plan.microbatches) for g in range(len(SHAPES_ANY))),
        )
        out["cases"][name] = record
    out["refused"] = _refusal(model, batch)
    # the last case's gathered shards against TP=1 stock dense without any padding
    out["reference"] = _tp1_reference(batch, _gather_tp(model, _weights(model)),
                                      _gather_tp(model, reuse_grads), reuse.loss, {})
    return out


def test_tp2_sequence_parallel_rows_of_any_length_equal_dense_and_tp1_reference():
    results = run_distributed(sp_rank, world_size=2, timeout_s=TIMEOUT_S)
    for result in results:
        assert result["sequence_parallel"]
        for name, record in result["cases"].items():
            _assert_step(record)
            # the hook sees full (gathered) padded rows, every one even; odd rows were padded
            assert record["hook_lengths"] == record["row_lengths"], (name, record)
            assert all(length % 2 == 0 for length in record["row_lengths"]), record
            assert record["padded_rows"] >= 2 and record["padded_units"] >= 1, (name, record)
            assert record["max_microbatches_per_group"] >= 3, record
        assert "row_multiple=2" in result["refused"], result["refused"]
    _assert_reference(results[0]["reference"])
