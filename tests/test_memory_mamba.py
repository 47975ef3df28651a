"""What a Mamba-2 layer saves for backward (planning/memory_model_mamba.py): the formulas by hand,
and against the saved-tensor accounting (prefix_schedule.runtime.memory) of real Megatron
MambaLayer forwards on CPU whose kernels are fakes that save exactly what mamba-ssm's and
causal-conv1d's autograd Functions save (tests/mamba_saved_fake.py): stock dense rows (the fused
op), and in a reuse step prefix rows (whole layer, and stopping at the state), suffix rows from a
cached state and a group-of-one dense row (the state hook's conv + scan), fp32 and bf16, to the
byte (bf16: plus the CPU torch input norm's fp32 up-cast, which the formula does not model)."""
import dataclasses

import pytest

from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model_mamba import mamba_mixer_bytes, mamba_row_bytes
from prefix_schedule.planning.memory_model_mixers import MixerBytes

MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)
CHUNK = 16
DIMS = ModelDims(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, gated_linear_unit=True, hybrid_pattern="MM",
                 mamba_conv_kernel_dim=4, mamba_chunk_size=CHUNK, **MAMBA)
STATE_BYTES = 8 * 16 * 16 * 4  # the SSD state a prefix row stores in the cache (fp32)


def test_formulas_by_hand():
    # h 64; dim 8 x 16 = 128, B and C 2 x 2 x 16 = 64, conv channels 192, in_proj 328
    common = 4 * (3 * 64 + 328) + 4  # input norm (3h, rstd), zxBCdt
    after_scan = 4 * 2 * 128 + 4 * 2  # gated norm input + rstd per group, out_proj input
    stock = mamba_mixer_bytes(DIMS, 4, path="stock")
    assert stock == MixerBytes(per_token=common + 4 * 128 + after_scan,
                               to_state_per_token=common + 4 * 128 + after_scan,
                               per_sequence=2 * 4 * 8)  # exp(A_log), A
    reuse = mamba_mixer_bytes(DIMS, 4)
    # the hook's z and dt copies instead of zxBCdt; the conv window, x B C copies, out_x;
    # dA_cumsum
    to_state = 4 * 3 * 64 + 4 + 4 * (128 + 8) + 4 * (2 * 192 + 128) + 4 * 8
    assert reuse.to_state_per_token == to_state == 3396
    assert reuse.per_token == to_state + after_scan == 4428
    # per sequence: 3 more steps of the window, at most 15 padded dA_cumsum steps
    assert reuse.per_sequence == 3 * 192 * 4 + 15 * 4 * 8 + 2 * 4 * 8
    # bf16 parameters: dt_bias.float() is a new fp32 tensor too
    assert mamba_mixer_bytes(DIMS, 2, path="stock").per_sequence == 3 * 4 * 8
    assert mamba_row_bytes(DIMS, 4, [16, 5]) == 21 * 4428 + 2 * 2304 + 11 * 32 + 64
    assert mamba_row_bytes(DIMS, 4, [16], to_state=True) == 16 * 3396 + 2304 + 64
    assert mamba_row_bytes(DIMS, 4, [40], path="stock") == 40 * 3628 + 64
    # docs/MEMORY.md's Nemotron-H-8B-like widths, bf16: d_in 18560, ch 10240
    nemotron = dataclasses.replace(DIMS, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64,
                                   mamba_state_dim=128, mamba_num_groups=8, mamba_chunk_size=128)
    assert mamba_mixer_bytes(nemotron, 2, path="stock").per_token == \
        2 * (3 * 4096 + 18560 + 3 * 8192) + 4 * 9 == 110_884
    assert mamba_mixer_bytes(nemotron, 2).per_token == 110_884 + 2 * 10240 + 4 * 128 == 131_876


def test_mixer_bytes_bound_the_exact_count():
    """per_token x T + per_sequence x n >= the exact count; equal for the stock path's one row,
    and for the reuse path's one sequence of T = 1 (mod chunk) tokens (the most padding). The
    reuse path saves more than the stock one."""
    for path in ("reuse", "stock"):
        m = mamba_mixer_bytes(DIMS, 2, path=path)
        packings = [[1], [17], [16], [5, 9, 30], [64, 1]] if path == "reuse" else [[1], [40]]
        for lengths in packings:
            exact = mamba_row_bytes(DIMS, 2, lengths, path=path)
            bound = m.per_token * sum(lengths) + m.per_sequence * len(lengths)
            assert bound >= exact
            tight = path == "stock" or (len(lengths) == 1 and lengths[0] % CHUNK == 1)
            assert (bound == exact) == tight, (path, lengths)
    stock = mamba_mixer_bytes(DIMS, 2, path="stock")
    assert mamba_mixer_bytes(DIMS, 2).per_token > stock.per_token


@pytest.mark.parametrize("call,message", [
    (lambda: mamba_mixer_bytes("dims", 4), "give a flops.ModelDims"),
    (lambda: mamba_mixer_bytes(DIMS, 3), "act_bytes=3"),
    (lambda: mamba_mixer_bytes(DIMS, True), "act_bytes=True"),
    (lambda: mamba_mixer_bytes(DIMS, 2, path="fused"), "path='fused'"),
    (lambda: mamba_row_bytes(DIMS, 2, []), "lengths=\\[\\]"),
    (lambda: mamba_row_bytes(DIMS, 2, [4, 0]), "ints >= 1"),
    (lambda: mamba_row_bytes(DIMS, 2, [4, 5], path="stock"), "one unpacked dense row"),
    (lambda: mamba_row_bytes(DIMS, 2, [4], path="stock", to_state=True), "no prefix stop"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- against the saved-tensor accounting of real Megatron layers (CPU, fakes of the kernels)

def _model(dtype=None):
    """test_mamba's tiny `MM` HybridModel (chunk 16); `dtype` torch.bfloat16: bf16 parameters."""
    import torch

    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron_patches.models import tiny
    from test_mamba import _model as mamba_model

    if dtype is None:
        model = mamba_model("MM")
    else:
        with pytest.MonkeyPatch.context() as patch:
            config = tiny.TinyLlamaConfig
            patch.setattr(tiny, "TinyLlamaConfig",
                          lambda **kw: config(**kw, params_dtype=dtype))
            model = mamba_model("MM")
        assert all(p.dtype == dtype for n, p in model.named_parameters() if "dt_bias" in n)
    assert all(m.chunk_size == CHUNK for m in model.modules() if isinstance(m, MambaMixer))
    torch.manual_seed(0)
    return model


def _recorded_steps(model, monkeypatch, batch, token_budget, steps=("dense", "reuse")):
    """Run a stock dense step and a reuse step; per MambaLayer forward: (action kind, layer
    number, row tokens, the kernel calls' (length, reads a cached state), whether it stopped at
    the state, device bytes it added: what it saved plus, in a prefix row, the state it stored
    in the cache)."""
    import torch

    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.memory import DeviceMemoryMeter, watch_step
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import LOSS

    calls, records, state = [], [], {}
    scan = mamba_mixer.mamba_chunk_scan_combined
    fused = mamba_mixer.mamba_split_conv1d_scan_combined

    def scan_call(x, *args, **kwargs):
        calls.append((x.shape[1], kwargs.get("initial_states") is not None))
        return scan(x, *args, **kwargs)

    def fused_call(zxbcdt, *args, **kwargs):
        calls.append((zxbcdt.shape[1], False))
        return fused(zxbcdt, *args, **kwargs)

    monkeypatch.setattr(mamba_mixer, "mamba_chunk_scan_combined", scan_call)
    monkeypatch.setattr(mamba_mixer, "mamba_split_conv1d_scan_combined", fused_call)

    def before(module, args, kwargs):
        calls.clear()
        state["start"] = state["meter"].device_bytes()
        state["tokens"] = (args[0] if args else kwargs["hidden_states"]).shape[0]

    def after(module, args, output):
        records.append((state["kind"], module.layer_number, state["tokens"], list(calls),
                        output is None, state["meter"].device_bytes() - state["start"]))

    handles = [h for m in model.modules() if isinstance(m, MambaLayer)
               for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                         m.register_forward_hook(after, always_call=True))]
    try:
        state["kind"] = "dense"
        if "dense" in steps:
            with DeviceMemoryMeter(exclude=list(model.parameters())) as state["meter"]:
                dense_step(model, batch, LOSS)
        plan = plan_microbatches(batch, token_budget=token_budget, max_seq_len=512)
        step = ReuseStep(batch, plan)
        state["meter"] = DeviceMemoryMeter(exclude=list(model.parameters()))
        watch_step(step, state["meter"])
        step.observers.append((lambda action: state.update(kind=action and action.kind.value),
                               lambda microbatch: None))
        if "reuse" in steps:
            with state["meter"]:
                reuse_step(model, batch, plan, LOSS, step=step)
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return records


def _predicted(record, act_bytes=4) -> int:
    kind, _, tokens, calls, stopped, _ = record
    lengths = [n for n, _ in calls]
    assert sum(lengths) == tokens, record  # the kernel calls cover the row
    path = "stock" if kind == "dense" else "reuse"
    # a prefix row's final state and conv tail (a copy of the window's last W - 1 steps), into
    # the cache
    stored = STATE_BYTES + 3 * 192 * act_bytes if kind == "PF" else 0
    # bf16 on CPU: torch's rms_norm (the local input norm) saves its input and the normalised
    # input up-cast to fp32; the formula keeps memory_model.ActivationModel's act x 3h + rstd
    upcast = tokens * 2 * DIMS.hidden_size * (4 - act_bytes)
    return mamba_row_bytes(DIMS, act_bytes, lengths, path=path, to_state=stopped) + stored + \
        upcast


# (shapes, token budget): packed suffixes of two groups; a group of one run dense beside them
CASES = {"packed suffixes": ([(33, [6, 9, 4]), (20, [7, 5])], 20),
         "group of one": ([(30, [6]), (20, [5, 4])], 64)}


@pytest.fixture
def fakes(megatron_env, monkeypatch):
    import mamba_saved_fake

    mamba_saved_fake.install(monkeypatch)
    return mamba_saved_fake


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("act_bytes", [4, 2])
def test_layer_bytes_equal_the_prediction(fakes, monkeypatch, case, act_bytes):
    import torch

    from test_equivalence import make_batch

    shapes, budget = CASES[case]
    model = _model(None if act_bytes == 4 else torch.bfloat16)
    records = _recorded_steps(model, monkeypatch, make_batch(5, shapes), budget)
    kinds = set()
    for record in records:
        kind, layer, tokens, calls, stopped, measured = record
        assert measured == _predicted(record, act_bytes), record
        reads = [read for _, read in calls]
        kinds.add((kind, stopped, len(calls), sum(reads)))
    assert ("dense", False, 1, 0) in kinds  # Megatron's dense rows: the fused op
    assert {("PF", False, 1, 0), ("PF", True, 1, 0)} <= kinds  # the whole layer; to its state
    if case == "packed suffixes":  # several sequences in a row, each from its group's state
        assert any(k[0] == "SF" and k[2] == k[3] > 1 for k in kinds), kinds
    else:  # a row holding the group of one, from zeros, beside sequences from states
        assert any(k[0] == "SF" and k[2] > k[3] > 0 for k in kinds), kinds


def test_fakes_compute_what_the_stand_ins_compute(megatron_env, monkeypatch):
    """The fakes change what is saved, not the step: with them reuse == dense (fp32, 1e-5), and
    both equal the runs through the CPU layer's stand-ins."""
    import mamba_saved_fake
    from megatron_patches.training import max_relative_diff
    from test_equivalence import TOL, assert_equal_step, make_batch, run_both

    model = _model()
    batch = make_batch(5, CASES["packed suffixes"][0])
    _, plain_dense, _, plain_reuse, _ = run_both(model, batch, 20)
    mamba_saved_fake.install(monkeypatch)
    dense, dense_grads, reuse, reuse_grads, _ = run_both(model, batch, 20)
    assert_equal_step(dense, dense_grads, reuse, reuse_grads)
    assert max_relative_diff(plain_dense, dense_grads) <= TOL
    assert max_relative_diff(plain_reuse, reuse_grads) <= TOL


# the tensor each check adds a copy of, or drops (a storage nothing else in the layer saves),
# and the steps that call the Function
CHANGED = {"CausalConv1dFn": (0, ("reuse",)),  # the conv window
           "MambaChunkScanCombinedFn": (3, ("reuse",)),  # dA_cumsum
           "MambaSplitConv1dScanCombinedFn": (3, ("dense",)),  # out_x
           "LayerNormFn": (4, ("dense", "reuse"))}  # the gated norm's rstd


@pytest.mark.parametrize("change", ["more", "less"])
@pytest.mark.parametrize("fn", list(CHANGED))
def test_one_tensor_more_or_less_is_caught(fakes, monkeypatch, fn, change):
    """A fake that saves one tensor more (a copy) or one less (kept outside autograd's saved
    tensors, so its backward still runs) no longer matches the prediction."""
    import torch

    from test_equivalence import make_batch

    (index, steps), save, load = CHANGED[fn], fakes.save, fakes.load

    def changed_save(ctx, function, tensors):
        if function.__name__ == fn:
            tensors = list(tensors)
            if change == "more":
                tensors.append(torch.empty_like(tensors[index]))
            else:
                ctx.dropped, tensors[index] = tensors[index], None
        save(ctx, function, tuple(tensors))

    def changed_load(ctx):
        tensors = list(load(ctx))
        if hasattr(ctx, "dropped"):
            tensors[index] = ctx.dropped
        return tuple(tensors)

    monkeypatch.setattr(fakes, "save", changed_save)
    monkeypatch.setattr(fakes, "load", changed_load)
    shapes, budget = CASES["packed suffixes"]
    records = _recorded_steps(_model(), monkeypatch, make_batch(5, shapes), budget, steps)
    errors = [record[-1] - _predicted(record) for record in records]
    assert any(errors), "the check did not see the changed fake"
    assert all(e >= 0 for e in errors) if change == "more" else all(e <= 0 for e in errors)


def test_fakes_stay_in_the_tests(megatron_env):
    """install() refuses with CUDA (the real kernels run there), its patches end with the test,
    and nothing outside tests/ imports the fakes."""
    import pathlib
    import re

    import mamba_saved_fake
    import torch
    from megatron.core.ssm import mamba_mixer
    from megatron_patches.support import mamba_cpu

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(RuntimeError, match="with CUDA the real kernels run"):
            mamba_saved_fake.install(patch)
    with pytest.MonkeyPatch.context() as patch:
        mamba_saved_fake.install(patch)
        assert mamba_mixer.causal_conv1d_fn is mamba_saved_fake.causal_conv1d_fn
        with pytest.MonkeyPatch.context() as inner:  # over the real mamba-ssm: refused
            inner.setattr(mamba_mixer, "mamba_chunk_scan_combined", object())
            with pytest.raises(RuntimeError, match="not for mamba-ssm"):
                mamba_saved_fake.install(inner)
    assert mamba_mixer.causal_conv1d_fn is mamba_cpu.causal_conv1d_fn
    assert mamba_mixer.mamba_chunk_scan_combined is mamba_cpu.mamba_chunk_scan_combined
    assert mamba_cpu.RMSNormGated.forward is not mamba_saved_fake.rms_norm_forward
    root = pathlib.Path(__file__).resolve().parents[1]
    imports = re.compile(r"^\s*(import|from)\s+\S*mamba_saved_fake", re.M)
    users = [p for d in ("prefix_schedule", "megatron_patches", "tools")
             for p in (root / d).rglob("*.py") if imports.search(p.read_text())]
    assert not users
