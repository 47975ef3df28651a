"""Context parallelism with a shared prefix ([Note: zigzag CP layout], runtime/cp.py).

- Layout: Megatron's zigzag sharding (2*CP chunks per sequence, rank r holds r and 2CP-1-r).
- Attention: every CP rank's zigzag_attention, put back together, equals the float64 dense-mask
  oracle over the whole packed row (outputs and gradients, cached prefix included).
- Megatron (gloo, strict p2p): reuse at CP=2 equals STOCK Megatron dense at CP=1 on the same
  data and weights (loss, every gradient, fp32 within 1e-5), with prefix and suffix lengths not
  divisible by 2*CP, groups over several microbatches, a group run dense, prefix chunks; also
  CP=2 x TP=2 and CP=2 x PP=2 (4 processes, tiny models).
"""

import pytest
import torch

from dist_harness import run_distributed
from prefix_schedule.attention import PackedMeta, reference_attention
from prefix_schedule.attention.cp import all_ranks_attention
from prefix_schedule.runtime.cp import ZigzagLayout

TOL = 1e-5
TIMEOUT_S = 240
# cached prefixes P-1 = 33, 17, 22 and suffix rows 6, 9, 3, 5, 7, ...: most not multiples of 4;
# group 3 runs dense (dense_groups: no cache), in the same packed rows as cached ones. Phase B
# rows of every kind ([Note: whole suffixes per CP rank]): all zigzag-split ([6, 9], [3, 5, 7]),
# all whole ([4, 6, 2]) and mixed ([12, 2, 2]: the 12 split, the 2s whole on ranks 0 and 1).
SHAPES = [(34, [6, 9, 3]), (18, [5, 7]), (23, [4, 6, 2, 5]), (9, [6]), (13, [12, 2, 2])]
BUDGET = 16


# ---- layout and attention, one process ---------------------------------------------------------

def test_zigzag_layout_is_megatrons():
    layout = ZigzagLayout((5, 8), cp_size=2, rank=0)
    assert layout.padded == (8, 8) and layout.local_len == 8
    # chunks of 2: rank 0 holds chunks 0 and 3 of each sequence, rank 1 chunks 1 and 2
    assert layout.local_index().tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert ZigzagLayout((5, 8), 2, 1).local_index().tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    assert sorted(layout.gather_index().tolist()) == list(range(16))
    assert layout.real_index().tolist() == [0, 1, 2, 3, 4] + list(range(8, 16))
    row = torch.arange(1, 14)
    assert layout.shard(row).tolist() == [1, 2, 0, 0, 6, 7, 12, 13]  # padding 0 at 5..7
    assert layout.positions([10, 0]).tolist() == [10, 11, 14, 14, 0, 1, 6, 7]  # padding: 14
    with pytest.raises(ValueError, match="13 entries"):
        layout.shard(torch.arange(12))


def test_balance_owners_whole_sequences_then_split_longest():
    from prefix_schedule.runtime.cp import balance_owners

    assert balance_owners([64] * 8, [1023] * 8, 2) == (0, 1, 0, 1, 0, 1, 0, 1)
    assert balance_owners([12, 2, 2], [12] * 3, 2) == (-1, 0, 1)  # the long one split
    assert balance_owners([7], [5], 2) == ()  # one sequence: Megatron's zigzag
    assert balance_owners([3, 5, 7], [33, 17, 17], 2) == ()  # no balance within 5%
    # equal tokens but unequal prefixes: attention pairs must balance too
    assert balance_owners([4, 4], [100, 0], 2) == ()
    layout = ZigzagLayout((5, 3, 8), 2, 1, owners=(1, 0, -1))
    assert layout.padded == (6, 4, 8) and layout.split  # whole ones padded to even length
    assert not ZigzagLayout((5, 3), 2, 0, owners=(1, 0)).split  # the hook gathers nothing
    assert layout.chunks(1) == [(0, 0, 6), (2, 2, 4), (2, 4, 6)]
    assert layout.local_len == 10 and layout.split_rows().tolist() == [6, 7, 8, 9]
    assert sorted(layout.gather_index().tolist()) == list(range(10, 18))
    assert layout.shard(torch.arange(1, 17)).tolist() == [1, 2, 3, 4, 5, 0, 11, 12, 13, 14]
    with pytest.raises(ValueError, match="owners"):
        ZigzagLayout((5, 3), 2, 0, owners=(2, 0))
    # sequence parallelism (TP=3): every local row a multiple of lcm(2, 3) on every rank
    for owners in ((), (1, 0, -1), (0, 0, 1)):
        for rank in range(2):
            local = ZigzagLayout((5, 3, 8), 2, rank, owners, multiple=3).local_len
            assert local % 6 == 0 and local > 0, (owners, rank, local)


@pytest.mark.parametrize("cp,owners", [(2, ()), (3, ()), (2, (1, -1, 0, -1)), (3, (2, 0, 1, 1)),
                                        (4, (0, 1, 2, 0))],
                         ids=["cp2", "cp3", "cp2_mixed", "cp3_whole", "cp4_rank_without_rows"])
def test_zigzag_attention_of_all_ranks_equals_dense_oracle(cp, owners):
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 8
    # slots: two sequences share group 0's prefix, one has none (a dense row), one group 2's
    meta = PackedMeta.from_lengths((7, 1, 3, 10), (0, 0, 1, 2))
    prefixes = (5, 0, 9)
    q, k, v = (torch.randn(meta.total_len, h, d, dtype=torch.float64, requires_grad=True)
               for h in (hq, hkv, hkv))
    pk = [torch.randn(p, hkv, d, dtype=torch.float64, requires_grad=True) for p in prefixes]
    pv = [torch.randn(p, hkv, d, dtype=torch.float64, requires_grad=True) for p in prefixes]
    leaves = [q, k, v, *pk, *pv]
    reference = reference_attention(q, k, v, pk, pv, meta, scale=0.3)
    grad_out = torch.randn_like(reference)
    expected = torch.autograd.grad(reference, leaves, grad_out)
    got = all_ranks_attention(q, k, v, pk, pv, meta, cp=cp, scale=0.3, owners=owners)
    assert torch.allclose(got, reference, atol=1e-12)
    grads = torch.autograd.grad(got, leaves, grad_out, allow_unused=True)
    for i, (e, g) in enumerate(zip(expected, grads)):
        g = torch.zeros_like(e) if g is None else g
        assert torch.allclose(g, e, atol=1e-12), i


# ---- Megatron, multi-process --------------------------------------------------------------------

def _cp_rank(tp=1, pp=1, cp=2, prefix_chunk_tokens=None, seed=7, ddp=False, overrides=None,
             dense_ddp=False, shapes=None):
    """Reuse at CP=`cp` (x TP, x PP), then stock dense at CP=1 with the same TP/PP and weights
    on the whole batch (every rank: each pipeline / TP group runs it), compared on this rank.
    `ddp`: the reuse model in Megatron's DDP with finalize_model_grads (gradients and the token
    count reduced over the DP x CP group), else the plain CP-summing finalize; `dense_ddp`: the
    dense model too (sequence parallelism needs DDP's finalize for the norms' TP-partial grads)."""
    import megatron_patches
    from megatron.core import parallel_state
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (dense_step, max_relative_diff, missing_grads,
                                           param_grads, prepare_for_training, reuse_step)
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch

    megatron_patches.install()
    cfg = TinyLlamaConfig(num_layers=2 * pp, hidden_size=32, ffn_hidden_size=64,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=256)
    batch = make_batch(seed, shapes or SHAPES)
    plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=cfg.max_seq_len,
                             prefix_chunk_tokens=prefix_chunk_tokens,
                             dense_groups=() if shapes else (3,))

    def run(cp_size, reuse):
        initialize_distributed(seed=1234, tp=tp, pp=pp, cp=cp_size)
        model = build_model(cfg, **(overrides or {}))
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        model = prepare_for_training(model, ddp=ddp and (reuse or dense_ddp))
        result = (reuse_step(model, batch, plan, LOSS) if reuse else dense_step(model, batch, LOSS))
        grads = {n.removeprefix("module."): g for n, g in param_grads(model).items()}
        return result, grads, weights

    reuse, reuse_grads, reuse_weights = run(cp, True)
    from megatron_patches.training import context_parallel_group
    from prefix_schedule.runtime.step import ReuseStep

    step = ReuseStep(batch, plan, num_stages=pp, cp_group=context_parallel_group())
    packed = [(len(step.prefix_members(u)), step.prefix_layout(u).owners)
              for u in range(step.num_prefix_units) if len(step.prefix_members(u)) > 1]
    cp_group = parallel_state.get_context_parallel_group()
    totals = torch.tensor([reuse.loss * reuse.num_tokens, float(reuse.num_tokens)],
                          dtype=torch.float64)
    torch.distributed.all_reduce(totals, group=cp_group)  # the loss of the CP ranks' parts
    last = parallel_state.is_pipeline_last_stage()
    dense, dense_grads, dense_weights = run(1, False)
    return dict(
        last_stage=last, tokens=(dense.num_tokens, int(totals[1])),
        loss=abs(float(totals[0] / totals[1]) - dense.loss) / abs(dense.loss) if last else 0.0,
        weights=max_relative_diff(dense_weights, reuse_weights),
        grads=max_relative_diff(dense_grads, reuse_grads),
        missing=missing_grads(dense=dense_grads, reuse=reuse_grads),
        num_microbatches=len(plan.microbatches), num_units=len(plan.prefix_units()),
        packed=packed)


def _check(results, min_units=None, packed=None):
    """`packed`: the (members, owners) of the step's packed prefix rows ([Note: packed CP
    prefix rows]) every rank must report."""
    for r in results:
        if packed is not None:
            assert r["packed"] == packed, r
        assert r["weights"] == 0.0, "the CP and dense models do not hold the same weights"
        assert not r["missing"], f"no (or a non-finite) gradient: {r['missing'][:5]}"
        assert r["grads"] <= TOL, r
        if r["last_stage"]:
            assert r["tokens"][0] == r["tokens"][1] > 0, r
            assert r["loss"] <= TOL, r
        assert r["num_microbatches"] > 2
        if min_units:
            assert r["num_units"] >= min_units, r


@pytest.mark.megatron
@pytest.mark.parametrize("overrides", [None, {"recompute_granularity": "selective",
                                              "recompute_modules": ["core_attn"]}],
                         ids=["plain", "core_attn_recompute"])
def test_cp2_reuse_equals_stock_dense_cp1(overrides):
    """Also with selective core-attention recompute: the hook then runs again inside backward,
    its K/V all-gather and that gather's reduce-scatter included, on every CP rank alike. The
    four cached prefixes (33, 17, 22, 12) run as one packed row that cannot balance whole: all
    zigzag-split ([Note: packed CP prefix rows])."""
    _check(run_distributed(_cp_rank, world_size=2, kwargs={"overrides": overrides},
                           timeout_s=TIMEOUT_S), packed=[(4, ())])


@pytest.mark.megatron
@pytest.mark.parametrize("shapes,owners", [
    ([(21, [5, 7, 9]), (21, [6, 4, 3, 8])], (0, 1)),
    ([(41, [5, 7]), (11, [6, 4]), (11, [3, 9]), (11, [2, 5]), (11, [8])], (-1, 0, 1, 0, 1))],
    ids=["whole", "mixed"])
def test_cp2_packed_whole_prefixes_equal_stock_dense(shapes, owners):
    """Prefixes that balance whole (20 | 20): each rank runs its own prefix in Phase A with no
    attention all-gather, the K/V gathered asynchronously for Phase B, Phase C reduces their
    gK/gV to the owner; mixed (40 split, four 10s whole, two per rank): both kinds in one
    row."""
    _check(run_distributed(_cp_rank, world_size=2, kwargs={"shapes": shapes},
                           timeout_s=TIMEOUT_S), packed=[(len(shapes), owners)])


@pytest.mark.megatron
def test_cp2_reuse_with_prefix_chunks():
    _check(run_distributed(_cp_rank, world_size=2, kwargs={"prefix_chunk_tokens": 10},
                           timeout_s=TIMEOUT_S), min_units=8, packed=[])


@pytest.mark.megatron
def test_cp2_packed_row_beside_chunked_prefixes():
    """Chunks of 20: the 33- and 22-token prefixes run as chunk units, the 17- and 12-token
    ones as one packed row (split); unit numbering and Phase C order hold."""
    _check(run_distributed(_cp_rank, world_size=2, kwargs={"prefix_chunk_tokens": 20},
                           timeout_s=TIMEOUT_S), min_units=6, packed=[(2, ())])


@pytest.mark.megatron
def test_cp2_x_tp2_reuse_equals_stock_dense_tp2_cp1():
    _check(run_distributed(_cp_rank, world_size=4, kwargs={"tp": 2}, timeout_s=TIMEOUT_S))


@pytest.mark.megatron
def test_cp2_x_tp2_sequence_parallel_reuse_equals_stock_dense():
    """TP=2 with sequence parallelism x CP=2: each CP rank's local row is padded to a multiple
    of TP by the layout (context_parallel_group(config)); dense SP rows right-padded."""
    _check(run_distributed(_cp_rank, world_size=4, timeout_s=TIMEOUT_S, kwargs={
        "tp": 2, "ddp": True, "dense_ddp": True, "overrides": {"sequence_parallel": True}}))


@pytest.mark.megatron
def test_cp2_x_pp2_reuse_equals_stock_dense_pp2_cp1():
    _check(run_distributed(_cp_rank, world_size=4, timeout_s=TIMEOUT_S, kwargs={
        "pp": 2, "prefix_chunk_tokens": 10, "overrides": {"deallocate_pipeline_outputs": True}}))


@pytest.mark.megatron
def test_cp2_reuse_in_megatron_ddp_equals_stock_dense_cp1():
    """Megatron's DDP + finalize_model_grads reduce gradients and the token count over DP x CP."""
    _check(run_distributed(_cp_rank, world_size=2, kwargs={"ddp": True}, timeout_s=TIMEOUT_S))


def _refusals_rank():
    import megatron_patches
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed
    from megatron_patches.training import (context_parallel_group, dense_step,
                                           prepare_for_training, reuse_step)
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import LOSS, make_batch

    megatron_patches.install()
    initialize_distributed(seed=1234, cp=2)
    cfg = TinyLlamaConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, vocab_size=256, max_seq_len=256)
    model = prepare_for_training(build_model(cfg), ddp=False)
    batch = make_batch(7, SHAPES)
    plan = plan_microbatches(batch, token_budget=BUDGET, max_seq_len=256)
    errors = {}
    for name, call in {
        "step_without_cp": lambda: reuse_step(model, batch, plan, LOSS,
                                              step=ReuseStep(batch, plan)),
        "row_multiple": lambda: ReuseStep(batch, plan_microbatches(
            batch, token_budget=BUDGET, max_seq_len=256, row_multiple=2),
            cp_group=context_parallel_group()),
        "dense_at_cp2": lambda: dense_step(model, batch, LOSS),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    errors["untouched"] = all(p.grad is None for p in model.parameters())
    return errors


@pytest.mark.megatron
def test_cp_refusals_are_value_errors_before_compute():
    for errors in run_distributed(_refusals_rank, world_size=2, timeout_s=TIMEOUT_S):
        assert "the step runs CP=1" in errors["step_without_cp"], errors
        assert "row_multiple=1" in errors["row_multiple"], errors
        assert "Transformer Engine" in errors["dense_at_cp2"], errors
        assert errors["untouched"], errors


# ---- tools/bench.py --cp 2 ------------------------------------------------------------------------

@pytest.mark.megatron
def test_bench_cp2_records_layout_and_bytes_per_phase(tmp_path):
    """A tiny `bench.py --cp 2` (prompt and response lengths not multiples of 4): reuse's
    gradients equal stock dense's, the JSON names the layout, and Phase A's K/V all-gather moves
    exactly its ring share: the two 42-token prefixes run as one packed row, one whole prefix
    per rank ([Note: packed CP prefix rows]), so 2 layers x (K, V) x 2 x 42 rows x 2 heads x
    16 dims x 4 bytes x (CP-1)/CP (split per group, 44 padded rows each, it was 2 x 44)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cp.json"
    flags = ["--cp", "2", "--prefix-len", "43", "--suffix-len", "9", "--group-size", "3",
             "--num-groups", "2", "--num-layers", "2", "--hidden-size", "64",
             "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
             "--vocab-size", "256", "--steps", "1", "--warmup", "0", "--skip-stock",
             "--timeout", "200", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "tools" / "bench.py"), *flags], cwd=root,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == {"pp": 1, "tp": 1, "dp": 1, "cp": 2}
    assert result["max_grad_rel_diff"] <= TOL
    assert abs(result["loss_dense"] - result["loss_reuse"]) <= TOL * abs(result["loss_dense"])
    reuse = result["cp_traffic"]["reuse_bytes_per_rank"]
    assert reuse["A.all_gather"] == 2 * 2 * 2 * 42 * 2 * 16 * 4 // 2
    assert reuse["B.all_gather"] == reuse["B.reduce_scatter"] > 0
    assert reuse["C.reduce_scatter"] > 0
    dense = result["cp_traffic"]["dense_cp_bytes_per_rank_model"]
    # 6 dense rows of 51 tokens, padded to 52
    assert dense["all_gather"] == dense["reduce_scatter"] == 6 * 2 * 52 * 2 * 16 * 4 * 2 // 2
    assert "cp 2 = 2 process(es)" in proc.stdout and "CP MiB per rank" in proc.stdout
    reference = result["cp_reference"]  # the same reuse at CP=1 x DP=2, timed alongside
    assert len(reference["reuse_cp1_seconds_all"]) == 1 and reference["cp_overhead"] > 0
    assert "reuse at CP=1 x DP=2" in proc.stdout


def test_bench_cp_config():
    from tools_import import tool

    bench = tool("bench")
    config, _ = bench.parse_args(["--cp", "2", "--tp", "2"])
    assert config.world_size == 4
    with pytest.raises(ValueError, match="--cp > 1 with --dp > 1"):
        bench.parse_args(["--cp", "2", "--dp", "2"])
    with pytest.raises(ValueError, match="--cp=0"):
        bench.parse_args(["--cp", "0"])
