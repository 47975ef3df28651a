"""The predicted device bytes (planning/memory_model.py), the budget planner (memory_plan.py) and
tools/capacity.py: predictions against the bytes the saved-tensor accounting (tools/memory_probe.py,
not an allocator) counts on the tiny Llama3-8B twin, a planner-chosen configuration under a
tight budget against stock dense (fp32, 1e-5), and the planner's choices and refusals."""

import pytest
import torch

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning import memory_model
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model import (ActivationModel, MemoryOptions,
                                                   dense_peak_bytes, reuse_phase_peaks)
from prefix_schedule.planning.planner import plan_microbatches
from test_equivalence import TOL, make_batch
from tools_import import tool

BENCH_LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
SMALL_DIMS = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                       num_query_groups=2, vocab_size=256, gated_linear_unit=True)
SMALL = ActivationModel(dims=SMALL_DIMS, act_bytes=4)  # test_memory_megatron's model, fp32
SHAPES = [(120, [20, 24, 16, 22]), (90, [18, 30])]


def _plan(budget, **kw):
    batch = make_batch(7, SHAPES)
    return batch, plan_microbatches(batch, token_budget=96, max_seq_len=512,
                                    memory_budget_bytes=budget, memory_model=SMALL, **kw)


def test_planner_fits_the_budget_and_says_what_it_chose():
    _, loose = _plan(10 ** 9)
    assert loose.memory.options == MemoryOptions() and loose.memory.token_budget == 96
    assert loose.memory.prefix_chunk_tokens is None and not loose.memory.rejected
    plain = loose.memory.peaks["step"]
    _, tight = _plan(int(plain * 0.6))
    assert tight.memory.options != MemoryOptions(), "a tighter budget must change the options"
    assert tight.memory.peaks["step"] <= plain * 0.6
    assert reuse_phase_peaks(SMALL, tight, tight.memory.options)["step"] <= plain * 0.6
    text = tight.describe()
    assert "memory: budget" in text and "not no offload, no recompute: needs >=" in text


def test_infeasible_budget_names_the_smallest_that_fits():
    with pytest.raises(ValueError, match="smallest budget that fits is") as info:
        _plan(1000)
    smallest = int(str(info.value).split("fits is ")[1].split(" bytes")[0])
    _, plan = _plan(smallest)  # the budget the error names does fit
    assert plan.memory.peaks["step"] <= smallest
    with pytest.raises(ValueError, match="memory_model"):
        plan_microbatches(make_batch(7, SHAPES), token_budget=96, max_seq_len=512,
                          memory_budget_bytes=10 ** 6)
    with pytest.raises(ValueError, match="offload with full recompute"):
        MemoryOptions(offload=True, recompute="full")


def test_a_step_takes_the_offload_its_budget_plan_chose():
    from prefix_schedule.runtime.step import ReuseStep

    batch, plain = _plan(10 ** 9)
    batch, plan = _plan(int(plain.memory.peaks["step"] * 0.6),
                        memory_options=[MemoryOptions(offload=True)])
    assert plan.memory.options.offload
    assert ReuseStep(batch, plan).offload_prefix_activations  # the default: as planned
    assert not ReuseStep(batch, plan, offload_prefix_activations=False).offload_prefix_activations
    assert not ReuseStep(batch, plain).offload_prefix_activations


def test_capacity_tool_reports_every_path_and_the_ratio(tmp_path):
    capacity = tool("capacity")
    spec = capacity.MODELS["llama3-8b"]
    r = capacity.capacity(spec, memory_gib=80, group_size=2, prefix_share=0.75)
    dense, reuse = r["dense"], r["reuse"]
    assert dense["full"] > dense["none"] > 0
    # the paper's packing (a group per microbatch): the prompt's activations once, not G times
    assert reuse["no offload, no recompute"]["trajectory"] > dense["none"]
    best = max(v["trajectory"] for v in reuse.values())
    assert r["capacity_ratio"] == pytest.approx(best / max(dense.values()))
    # the distributed optimizer shards over DP x CP (experts over DP x CP / EP)
    moe = capacity.MODELS["qwen3-30b-a3b"]
    for model, ep in ((spec, 1), (moe, 8)):
        one = capacity.static_bytes(model, capacity.Layout(dp=8, cp=1, ep=ep))["optimizer"]
        two = capacity.static_bytes(model, capacity.Layout(dp=8, cp=2, ep=ep))["optimizer"]
        assert two == pytest.approx(one / 2)
    # CP shards rows, not the cache: a CP rank keeps the whole prefix's K/V and fp32 gK/gV
    models = capacity.activation_models(spec, capacity.Layout(dp=8, cp=2), act_bytes=2)
    option = capacity.REUSE_OPTIONS[0]
    plain = capacity.reuse_peak(models, 4096, 2, "group", option, 0.75, 1)[0]
    sharded = capacity.reuse_peak(models, 4096, 2, "group", option, 0.75, 2)[0]
    m = models[0]
    whole_cache = m.stage_layers * 3071 * (m.kv_copy() + m.gkv())
    assert plain / 2 + whole_cache / 2 < sharded < plain
    png = tmp_path / "frontier.png"
    assert capacity.main(["--model", "tiny", "--memory-gib", "0.05", "--dp", "1",
                          "--reserve-gib", "0", "--group-size", "2", "4", "--prefix-share",
                          "0.5", "0.9", "--frontier", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_refuses_full_recompute_where_reuse_does():
    """The executor refuses full recompute with CP (runtime/executor.py): capacity prints that
    row as refused (no trajectory) and the ratio from the other options. With MoE layers full
    recompute runs (tests/test_moe_recompute.py): capacity counts it, the memory model refuses
    no option."""
    from prefix_schedule.planning.memory_model import MemoryOptions

    capacity = tool("capacity")
    full = MemoryOptions(recompute="full").describe()
    moe = capacity.capacity(capacity.MODELS["qwen3-30b-a3b"], memory_gib=80, group_size=8,
                            prefix_share=0.9, layout=capacity.Layout(tp=2, dp=8, ep=8))
    assert "refused" not in moe["reuse"][full] and moe["reuse"][full]["trajectory"] > 0
    best = max(v["trajectory"] for v in moe["reuse"].values())
    assert best == moe["reuse"][full]["trajectory"]  # the longest of the options
    assert moe["capacity_ratio"] == pytest.approx(best / max(moe["dense"].values()))
    model = capacity.activation_models(capacity.MODELS["qwen3-30b-a3b"],
                                       capacity.Layout(tp=2, dp=8, ep=8), act_bytes=2)[0]
    assert model.refusal(MemoryOptions(recompute="full")) is None and \
        model.refusal(MemoryOptions(offload=True)) is None
    cp = capacity.capacity(capacity.MODELS["llama3-8b"], memory_gib=80, group_size=2,
                           prefix_share=0.75, layout=capacity.Layout(dp=8, cp=2))
    assert "context parallelism" in cp["reuse"][full]["refused"]
    dense = capacity.capacity(capacity.MODELS["llama3-8b"], memory_gib=80, group_size=2,
                              prefix_share=0.75)
    assert dense["reuse"][full]["trajectory"] > 0 and "refused" not in dense["reuse"][full]


# ---- against measured bytes (Megatron)

def _tiny_model(recompute, fused=False):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    spec = tool("capacity").MODELS["llama3-8b-tiny"]
    cfg = TinyLlamaConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                          ffn_hidden_size=spec.ffn_hidden_size,
                          num_attention_heads=spec.num_attention_heads,
                          num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
                          vocab_size=spec.vocab_size, max_seq_len=1024)
    options = (dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1) if recompute == "full" else {})
    model = build_model(cfg, fused_attention=fused, **options)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


@pytest.mark.megatron
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_predictions_match_measured_bytes_on_the_tiny_model(megatron_env, recompute):
    """The capacity tool's model of llama3-8b-tiny (fp32 here) within 10% of the accounting
    model's measured bytes: dense peak, reuse suffix phase and whole step, at three lengths (one
    and two trajectories per microbatch), with and without offload."""
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.runtime.step import ReuseStep

    probe, capacity = tool("memory_probe"), tool("capacity")
    spec = capacity.MODELS["llama3-8b-tiny"]
    model = capacity.activation_models(spec, capacity.Layout(), act_bytes=4)[0]
    local, fused = _tiny_model(recompute), _tiny_model(recompute, fused=True)
    offloads = [False, True] if recompute == "none" else [False]
    # (600, 30): gK/gV large next to the row: full recompute peaks at the first layer's re-run
    for prefix, suffix, group, budget in ((200, 40, 3, 40), (400, 80, 2, 160), (600, 30, 2, 60)):
        batch = make_batch(3, [(prefix, [suffix] * group)], vocab=spec.vocab_size)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=1024)
        dense = probe.measure_dense(fused, lambda: dense_step(fused, batch, BENCH_LOSS))
        predicted = dense_peak_bytes(model, [prefix + suffix - 1], recompute)
        print(f"dense P={prefix} n={suffix}: predicted / measured "
              f"{predicted / dense.peak_saved_bytes:.3f}")
        assert predicted == pytest.approx(dense.peak_saved_bytes, rel=0.10)
        for offload in offloads:
            step = ReuseStep(batch, plan, offload_prefix_activations=offload)
            reuse = probe.measure_reuse(
                local, step, lambda s: reuse_step(local, batch, plan, BENCH_LOSS, step=s))
            peaks = reuse_phase_peaks(model, plan, MemoryOptions(offload=offload,
                                                                 recompute=recompute))
            where = f"P={prefix} n={suffix} G={group} offload={offload}"
            print(f"reuse {where}: predicted / measured suffix phase "
                  f"{peaks['suffix'] / reuse.suffix_phase_peak_bytes:.3f}, step "
                  f"{peaks['step'] / reuse.peak_saved_bytes:.3f}")
            assert peaks["suffix"] == pytest.approx(reuse.suffix_phase_peak_bytes, rel=0.10), where
            assert peaks["step"] == pytest.approx(reuse.peak_saved_bytes, rel=0.10), where
        local.zero_grad(set_to_none=True)
        fused.zero_grad(set_to_none=True)


def _tiny_activation_model():
    capacity = tool("capacity")
    return capacity.activation_models(capacity.MODELS["llama3-8b-tiny"], capacity.Layout(),
                                      act_bytes=4)[0]


def _measure(local, batch, plan, options):
    from megatron_patches.training import reuse_step
    from prefix_schedule.runtime.step import ReuseStep

    step = ReuseStep(batch, plan, offload_prefix_activations=options.offload)
    report = tool("memory_probe").measure_reuse(
        local, step, lambda s: reuse_step(local, batch, plan, BENCH_LOSS, step=s))
    local.zero_grad(set_to_none=True)
    return report


def _unit_batch(kind):
    vocab = tool("capacity").MODELS["llama3-8b-tiny"].vocab_size
    if kind == "tree":  # depth 2: every reader reads the root and its leaf (two units)
        from tree_batches import make_tree_batch

        return make_tree_batch(5, [dict(depth=2, branching=2, node_len=200, suffix_len=30,
                                        per_leaf=2)], vocab=vocab)
    prefix, suffix = {"chunks": (600, 30), "chunks, n=40": (400, 40)}[kind]
    return make_batch(3, [(prefix, [suffix] * 2)], vocab=vocab)


# (batch, token budget, prefix_chunk_tokens, options): prefixes of several units, whose reads
# concatenate K/V the attention saves; the old model under-counted the chunked full-recompute
# suffix phase by 17% and the offload one by 10%
SEVERAL_UNITS = [("chunks", 60, 100, MemoryOptions()), ("chunks", 60, 100, MemoryOptions(offload=True)),
                 ("chunks", 60, 100, MemoryOptions(recompute="full")),
                 ("chunks, n=40", 40, 100, MemoryOptions(offload=True)),
                 ("chunks, n=40", 40, 100, MemoryOptions(recompute="full")),
                 ("tree", 40, None, MemoryOptions()), ("tree", 40, None, MemoryOptions(offload=True)),
                 ("tree", 40, 100, MemoryOptions()), ("tree", 40, 100, MemoryOptions(offload=True))]


@pytest.mark.megatron
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_predictions_match_measured_bytes_with_prefixes_of_several_units(megatron_env, recompute):
    """As above for prefix chunks and prefix trees (full recompute refuses trees): every phase
    within 10% of the measured bytes."""
    model, local = _tiny_activation_model(), _tiny_model(recompute)
    for kind, budget, chunk, options in SEVERAL_UNITS:
        if options.recompute != recompute:
            continue
        batch = _unit_batch(kind)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=1024,
                                 prefix_chunk_tokens=chunk)
        assert any(len(chain) > 1 for chains in memory_model.unit_reads(plan)[0].values()
                   for chain in chains)  # a suffix reads (and the attention saves) a copy
        measured = _measure(local, batch, plan, options)
        peaks = reuse_phase_peaks(model, plan, options)
        where = f"{kind}, token budget {budget}, chunks {chunk}, {options.describe()}"
        print(f"{where}: predicted / measured " + ", ".join(
            f"{p} {peaks[p] / measured.phase_peaks[p]:.3f}" for p in ("PF", "suffix", "PB")))
        for phase in ("PF", "suffix", "PB"):
            assert peaks[phase] == pytest.approx(measured.phase_peaks[phase], rel=0.10), \
                (where, phase)
        assert peaks["step"] == pytest.approx(measured.peak_saved_bytes, rel=0.10), where


@pytest.mark.megatron
@pytest.mark.parametrize("recompute", ["full"])
def test_a_budget_plan_with_chunks_stays_within_its_budget(megatron_env, recompute):
    """A budget 5% under the measured peak of 75-token chunks: the planner chooses smaller
    chunks, and the step it plans, measured, stays within the budget (the old model, blind to
    the concatenated K/V, took the 75-token chunks and ran over it)."""
    model, local = _tiny_activation_model(), _tiny_model(recompute)
    options = MemoryOptions(recompute=recompute)
    batch = make_batch(3, [(600, [30, 30]), (300, [24, 20])],
                       vocab=tool("capacity").MODELS["llama3-8b-tiny"].vocab_size)
    chunked = plan_microbatches(batch, token_budget=60, max_seq_len=1024, prefix_chunk_tokens=75)
    budget = int(0.95 * _measure(local, batch, chunked, options).peak_saved_bytes)
    plan = plan_microbatches(batch, token_budget=60, max_seq_len=1024, memory_model=model,
                             memory_budget_bytes=budget, memory_options=[options])
    assert plan.memory.prefix_chunk_tokens is not None  # it chose chunks
    measured = _measure(local, batch, plan, options).peak_saved_bytes
    print(f"budget {budget}: chose {plan.memory.token_budget}-token microbatches, "
          f"{plan.memory.prefix_chunk_tokens}-token chunks; measured / budget "
          f"{measured / budget:.3f}")
    assert measured <= budget


@pytest.mark.megatron
@pytest.mark.parametrize("fraction, recompute", [(0.6, "none"), (0.25, "full")])
def test_planner_chosen_configuration_equals_dense(megatron_env, fraction, recompute):
    """Under a tight budget the planner changes packing, chunking and offload or recompute; the
    step it plans, run with what it chose, equals stock Megatron dense (fp32 grads, 1e-5)."""
    from test_memory_megatron import FULL, _compare, _model

    batch = make_batch(7, SHAPES)
    plain = plan_microbatches(batch, token_budget=96, max_seq_len=512)
    budget = int(reuse_phase_peaks(SMALL, plain)["step"] * fraction)
    allowed = [MemoryOptions(), MemoryOptions(offload=True)] if recompute == "none" \
        else [MemoryOptions(recompute="full")]
    plan = plan_microbatches(batch, token_budget=96, max_seq_len=512, memory_budget_bytes=budget,
                             memory_model=SMALL, memory_options=allowed)
    choice = plan.memory
    assert choice.options.recompute == recompute and choice.peaks["step"] <= budget
    assert (choice.token_budget, choice.prefix_chunk_tokens) != (96, None) or choice.options.offload
    model = _model(**(dict(FULL["uniform"], recompute_num_layers=1) if recompute == "full" else {}))
    vs_dense, _, _ = _compare(model, batch, plan, offload_prefix_activations=choice.options.offload)
    assert vs_dense <= TOL
    if recompute == "full":  # the plan needs the recompute it chose: refused without it
        from megatron_patches.training import reuse_step

        with pytest.raises(ValueError, match="only with full activation recompute"):
            reuse_step(_model(), batch, plan, BENCH_LOSS)
    torch.manual_seed(0)
