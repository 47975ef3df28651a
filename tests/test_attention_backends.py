"""Attention backends: selection (auto order, env override, explicit-unavailable errors, log once,
process default), and each backend's dispatch against the float64 oracle -- flash-attn and
Transformer Engine through fake kernel modules with the real signatures (fake_attention_libs),
torch and math directly. GPU tests for the real libraries are marked `gpu`."""
import logging
import sys

import pytest
import torch

import fake_attention_libs as fakes
import fake_transformer_engine as fake_te
import prefix_schedule.attention.backends as backends
from prefix_schedule.attention import (PackedMeta, causal_attention, reference_attention,
                                       shared_prefix_attention)
from prefix_schedule.attention.backends import (ENV_VAR, Availability, MathFallbackWarning, get_backend,
                                                select_backend, set_default_backend)
from prefix_schedule.attention.backends import versions
from prefix_schedule.attention.backends.two_part import suffix_call
from test_attention import CASES, PACKED, TOL, as_f64, assert_rel_close, make_problem, out_and_grads

CPU, F64 = torch.device("cpu"), torch.float64


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    backends._reset()
    yield
    backends._reset()


def check_against_oracle(args, grad_out, tol, **kw):
    """Output and every gradient (q, k, v, prefix K/V) of shared_prefix_attention(**kw)."""
    got = out_and_grads(shared_prefix_attention, args, grad_out, **kw)
    want = out_and_grads(reference_attention, as_f64(args), grad_out)
    names = ["out", "dq", "dk", "dv"] + [f"d_prefix[{i}]" for i in range(len(got) - 4)]
    for name, a, b in zip(names, got, want):
        assert_rel_close(a, b, tol, f"{kw} {name}")


def on_cpu(monkeypatch, name):
    """Let a GPU backend run its (fake) kernels on CPU tensors of any dtype."""
    monkeypatch.setattr(get_backend(name), "device_reason", lambda device, dtype, head_dim: "")


def fake_availability(monkeypatch, **ok):
    for name, flag in ok.items():
        monkeypatch.setattr(get_backend(name), "available",
                            lambda device, dtype, head_dim=None, flag=flag: Availability(flag, "" if flag else "faked off"))


# ---------------------------------------------------------------- selection

@pytest.mark.parametrize("te, fa, device, want", [
    (True, True, "cpu", "transformer_engine"),
    (False, True, "cpu", "flash_attn"),
    (False, False, "cpu", "torch"),
])
def test_auto_order(monkeypatch, te, fa, device, want):
    fake_availability(monkeypatch, transformer_engine=te, flash_attn=fa)
    assert select_backend(device=torch.device(device), dtype=torch.bfloat16).name == want
    assert select_backend("auto", device=device, dtype=torch.bfloat16).name == want


def test_auto_on_cuda_never_falls_back_to_math_silently(monkeypatch, recwarn):
    """No TE / flash-attn (or an fp32 model) on a GPU: "auto" lands on the score-materialising
    math kernel; that warns once per combination, with every skipped backend's reason."""
    for name in ("transformer_engine", "flash_attn", "transformer_engine_torch"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed (no CUDA query needed)
    cuda = torch.device("cuda")  # a CUDA device as far as selection can tell
    with pytest.warns(MathFallbackWarning) as caught:
        assert select_backend(device=cuda, dtype=torch.float32, head_dim=64).name == "math"
    (warning,) = caught
    text = str(warning.message)
    assert "O(L_q x L_k)" in text and "skipped transformer_engine: not installed" in text
    assert "skipped torch: the torch backend runs PyTorch's CPU flash kernel" in text
    recwarn.clear()
    select_backend(device=cuda, dtype=torch.float32, head_dim=64)  # the same combination: silent
    select_backend("math", device=cuda, dtype=torch.bfloat16, head_dim=64)  # asked for by name
    select_backend(device=CPU, dtype=torch.float32, head_dim=64)  # CPU: the torch kernel
    assert not [w for w in recwarn if issubclass(w.category, MathFallbackWarning)]
    with pytest.warns(MathFallbackWarning):  # another combination warns again
        select_backend(device=cuda, dtype=torch.bfloat16, head_dim=64)


def test_auto_here_is_torch_and_logs_skipped_reasons_once(caplog):
    caplog.set_level(logging.INFO, logger="prefix_schedule.attention")
    for _ in range(3):
        assert select_backend(device=CPU, dtype=torch.float32, head_dim=64).name == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == "prefix_schedule.attention"]
    assert len(lines) == 1 and "torch (auto)" in lines[0], lines
    assert "skipped transformer_engine" in lines[0] and "skipped flash_attn" in lines[0]
    select_backend(device=CPU, dtype=torch.float64, head_dim=64)  # a new combination: one more line
    backends._selected.clear()  # re-selecting the same combination does not log again
    select_backend(device=CPU, dtype=torch.float32, head_dim=64)
    assert len([r for r in caplog.records if r.name == "prefix_schedule.attention"]) == 2


def test_env_overrides_auto_but_not_an_explicit_name(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "math")
    assert select_backend(device=CPU, dtype=torch.float32).name == "math"
    assert select_backend("auto", device=CPU, dtype=torch.float32).name == "math"
    assert select_backend("torch", device=CPU, dtype=torch.float32).name == "torch"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=ENV_VAR):
        select_backend(device=CPU, dtype=torch.float32)


@pytest.mark.parametrize("name, expect", [
    ("flash_attn", ["not installed", "pip install 'flash-attn>=2.6,<2.9'"]),
    ("transformer_engine", ["not installed", "transformer_engine[pytorch]"]),
])
def test_explicit_unavailable_raises_with_reason_and_install_hint(monkeypatch, name, expect):
    monkeypatch.setitem(sys.modules, name, None)  # import fails even where installed
    with pytest.raises(ValueError) as err:
        select_backend(name, device=CPU, dtype=torch.bfloat16)
    assert all(text in str(err.value) for text in expect), str(err.value)
    monkeypatch.setenv(ENV_VAR, name)  # the same through the environment variable
    with pytest.raises(ValueError, match=ENV_VAR):
        select_backend(device=CPU, dtype=torch.bfloat16)


def test_device_and_version_reasons(monkeypatch):
    fakes.install_flash_attn(monkeypatch, "2.7.4")
    why = get_backend("flash_attn").available(CPU, torch.bfloat16, 64)
    assert not why and "CUDA" in why.reason
    fake_te.install(monkeypatch, cudnn=(9, 5, 1))
    assert "cuDNN >= (9, 6, 0)" in get_backend("transformer_engine").available(CPU, torch.bfloat16).reason
    assert "got a cuda device" in get_backend("torch").available("cuda", torch.float32).reason
    assert get_backend("math").available("cuda", torch.float32)


@pytest.mark.parametrize("name, install, version", [
    ("flash_attn", fakes.install_flash_attn, "2.5.9.post1"),  # LSE [B, H, max_seqlen_q]
    ("flash_attn", fakes.install_flash_attn, "2.9.0"),        # not checked
    ("transformer_engine", fake_te.install, "2.1.0"),
    ("transformer_engine", fake_te.install, "2.20.2"),  # release source not read here
])
def test_versions_outside_the_checked_range_are_refused(monkeypatch, name, install, version):
    install(monkeypatch, "2.8.3" if name == "flash_attn" else "2.19.0")  # signatures: any
    sys.modules["flash_attn" if name == "flash_attn" else "transformer_engine"].__version__ = version
    why = get_backend(name).available(CPU, torch.bfloat16, 64).reason
    assert f"{version} is outside the versions whose call signatures were checked" in why, why
    assert ("2.6 - 2.8" if name == "flash_attn" else "2.2 - 2.19") in why and "install with" in why


def test_version_tables_match_the_fakes():
    """versions.py (what the backends call) and the fakes (what each version accepts) were
    written from the same reading; they must agree on every version tested."""
    for version in fake_te.TE_VERSIONS:
        api = versions.te_api(version)
        fwd, bwd = (dict(p) for p in fake_te.fused_attn_signatures(version))
        assert list(api.backend_args) == fake_te.backend_args(version), version
        assert api.fwd_kwargs <= set(fwd) and api.bwd_kwargs <= set(bwd), version
        required = {n for n, d in bwd.items() if d is fakes.REQUIRED}
        assert required <= api.bwd_kwargs, (version, required - api.bwd_kwargs)
        required = {n for n, d in fwd.items() if d is fakes.REQUIRED}
        assert required <= api.fwd_kwargs, (version, required - api.fwd_kwargs)
        assert api.bucketed_stats == (fakes.vt(version)[:2] < (2, 11)), version
    assert [versions.get_max_tokens(n) for n in (1, 1024, 1025, 2048, 40000)] == \
        [fake_te.get_max_tokens(n) for n in (1, 1024, 1025, 2048, 40000)] == [1024, 1024, 2048, 2048, 65536]


def test_unknown_names_raise():
    for call in (lambda: select_backend("flash", device=CPU, dtype=torch.float32),
                 lambda: set_default_backend("cudnn"), lambda: get_backend("auto")):
        with pytest.raises(ValueError):
            call()


def test_default_backend_reaches_calls_without_backend(monkeypatch):
    """The Megatron hook passes no backend: set_default_backend decides (--attention-backend)."""
    seen = []
    math_backend = get_backend("math")
    original = math_backend.varlen_fwd
    monkeypatch.setattr(math_backend, "varlen_fwd", lambda *a: seen.append(a[3]) or original(*a))
    args, grad_out = make_problem(1, *PACKED, 4, 2, F64)
    set_default_backend("math")
    assert backends.get_default_backend() == "math"
    check_against_oracle(args, grad_out, TOL[F64])
    assert len(seen) == 2  # part S and part P
    causal_attention(*args[:3])  # square causal: part S only through SDPA
    monkeypatch.setenv(ENV_VAR, "torch")  # an explicit default wins over the environment
    assert select_backend(device=CPU, dtype=F64).name == "math"


# ---------------------------------------------------------------- dispatch vs the oracle

@pytest.mark.parametrize("mode", ["two_part", "copy"])
@pytest.mark.parametrize("case", list(CASES))
def test_math_backend_matches_oracle(mode, case):
    args, grad_out = make_problem(2, *CASES[case], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], mode=mode, backend="math")


@pytest.mark.parametrize("version", fakes.FLASH_VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_flash_two_part_matches_oracle(monkeypatch, version, case):
    iface = fakes.install_flash_attn(monkeypatch, version)
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(3, *CASES[case], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="flash_attn")
    assert [c["fn"] for c in iface.calls] == ["fwd", "fwd", "bwd", "bwd"]
    assert [c["window"] for c in iface.calls] == [(-1, 0), (-1, -1)] * 2  # S causal, P not


@pytest.mark.parametrize("version, wrong, error", [
    ("2.6.0.post1", dict(block_table=...), "missing a required argument: 'block_table'"),
    ("2.6.0.post1", dict(softcap=...), "missing a required argument: 'softcap'"),
    ("2.6.3", dict(window_size_left=-1), "unexpected keyword argument 'window_size_left'"),
    ("2.7.4.post1", dict(window_size=(-1, -1)), "unexpected keyword argument 'window_size'"),
    ("2.6.3", dict(zero_tensors=False), "unexpected keyword argument 'zero_tensors'"),
])
def test_flash_fakes_refuse_what_the_version_refuses(monkeypatch, version, wrong, error):
    """The fake binds arguments like the real `def` of that version (... = argument left out)."""
    iface = fakes.install_flash_attn(monkeypatch, version)
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kw = dict(dropout_p=0.0, softmax_scale=0.5, causal=True, softcap=0.0, alibi_slopes=None,
              return_softmax=False, block_table=None,
              **({"window_size": (-1, 0)} if fakes.vt(version) < (2, 7) else {
                  "window_size_left": -1, "window_size_right": 0}))
    for key, value in wrong.items():
        kw.pop(key) if value is ... else kw.update({key: value})
    with pytest.raises(TypeError, match=error):
        iface._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, **kw)


def test_flash_2_6_0_needs_block_table_and_gets_it(monkeypatch):
    """flash-attn 2.6.0 / 2.6.0.post1 give block_table no default: the backend passes None."""
    iface = fakes.install_flash_attn(monkeypatch, "2.6.0.post1")
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(3, *PACKED, 8, 2, torch.bfloat16, head_dim=16)
    check_against_oracle(args, grad_out, TOL[torch.bfloat16], backend="flash_attn")
    assert len(iface.calls) == 4


def test_flash_varlen_metadata_and_empty_prefix_entry(monkeypatch):
    """Part S: one call over the suffixes (causal); part P: one call whose batch is the slots,
    the empty-prefix slot an empty key entry (LSE +inf, turned into -inf before the merge)."""
    iface = fakes.install_flash_attn(monkeypatch)
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(4, *PACKED, 8, 2, F64)
    out_and_grads(shared_prefix_attention, args, grad_out, backend="flash_attn")
    s_fwd, p_fwd, s_bwd, p_bwd = iface.calls
    meta = args[-1]
    assert s_fwd["cu_q"] == s_fwd["cu_k"] == list(meta.cu_seqlens) and s_fwd["causal"]
    assert (s_fwd["max_q"], s_fwd["max_k"]) == (4, 4)
    assert p_fwd["cu_q"] == [0, 4, 13, 15] and p_fwd["cu_k"] == [0, 5, 5, 8] and not p_fwd["causal"]
    assert (p_fwd["max_q"], p_fwd["max_k"], p_fwd["empty"]) == (9, 5, 1)
    assert {k: s_bwd[k] for k in ("cu_q", "cu_k", "causal")} == {k: s_fwd[k] for k in ("cu_q", "cu_k", "causal")}
    assert p_bwd["cu_q"] == p_fwd["cu_q"] and p_bwd["cu_k"] == p_fwd["cu_k"]


def test_flash_copy_mode_and_causal_attention(monkeypatch):
    iface = fakes.install_flash_attn(monkeypatch)
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(5, *PACKED, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], mode="copy", backend="flash_attn")
    assert iface.calls[0]["fn"] == "func" and iface.calls[0]["causal"]
    assert iface.calls[0]["cu_k"] == [0, 8, 14, 18, 22, 23, 28]  # [prefix ; suffix] per suffix
    single, grad = make_problem(6, [7], [0], [0], 8, 2, F64)
    got = out_and_grads(lambda q, k, v, *_: causal_attention(q, k, v, backend="flash_attn"), single, grad,
                        num_leaves=3)
    want = out_and_grads(reference_attention, as_f64(single), grad, num_leaves=3)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert_rel_close(a, b, TOL[F64], name)


def test_flash_bf16_close_to_oracle(monkeypatch):
    fakes.install_flash_attn(monkeypatch)
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(7, *PACKED, 8, 2, torch.bfloat16, head_dim=16)
    check_against_oracle(args, grad_out, TOL[torch.bfloat16], backend="flash_attn")


TE_CASES = [(v, True) for v in fake_te.TE_VERSIONS] + [("2.18.0", False), ("2.19.0", False)]  # + per-seq stats


@pytest.mark.parametrize("version, packed", TE_CASES,
                         ids=[v + ("" if p else "-per_sequence_stats") for v, p in TE_CASES])
@pytest.mark.parametrize("case", list(CASES))
def test_te_two_part_matches_oracle(monkeypatch, version, packed, case):
    fa = fake_te.install(monkeypatch, version, packed_stats=packed)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(8, *CASES[case], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="transformer_engine")
    kernels = [c for c in fa.calls if c["fn"] != "get_backend"]
    assert [(c["fn"], c["mask"]) for c in kernels] == [
        ("fwd", "padding_causal"), ("fwd", "padding"), ("bwd", "padding_causal"), ("bwd", "padding")]
    # TE's own backend choice, once per call shape (cached), with this version's arguments
    chosen = [c for c in fa.calls if c["fn"] == "get_backend"]
    assert len(chosen) == 2 and {c["mask_type"] for c in chosen} == {"NVTE_PADDING_CAUSAL", "NVTE_PADDING"}


@pytest.mark.parametrize("version, rows", [("2.2.0", 1024), ("2.10.0", 1024), ("2.11.0", None),
                                           ("2.18.0", None)])
def test_te_bucketed_softmax_stats(monkeypatch, version, rows):
    """TE 2.2-2.10 return THD stats of get_max_tokens(total_q) rows (>= 1024): the forward slices
    them, the backward gets a buffer of the same rows; from 2.11 exactly total_q."""
    fa = fake_te.install(monkeypatch, version)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(12, *PACKED, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="transformer_engine")
    fwd_s, fwd_p, bwd_s, bwd_p = [c for c in fa.calls if c["fn"] in ("fwd", "bwd")]
    total_s, total_p = fwd_s["cu_q"][-1], fwd_p["cu_q"][-1]  # 15 rows; 6 without the empty slot
    assert (fwd_s["stats_rows"], fwd_p["stats_rows"]) == (rows or total_s, rows or total_p)
    assert (bwd_s["stats_rows"], bwd_p["stats_rows"]) == (fwd_s["stats_rows"], fwd_p["stats_rows"])


@pytest.mark.parametrize("version, wrong, error", [
    ("2.14.0", dict(dqkv_dtype=...), "missing a required argument: 'dqkv_dtype'"),
    ("2.15.0", dict(dqkv_dtype="kBFloat16"), "unexpected keyword argument 'dqkv_dtype'"),
    ("2.14.0", dict(o_format="thd"), "unexpected keyword argument 'o_format'"),
    ("2.5.0", dict(softmax_type="vanilla"), "unexpected keyword argument 'softmax_type'"),
    ("2.11.0", dict(bottom_right_diagonal=False), "unexpected keyword argument 'bottom_right_diagonal'"),
])
def test_te_fakes_refuse_what_the_version_refuses(monkeypatch, version, wrong, error):
    fa = fake_te.install(monkeypatch, version)
    x = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kw = dict(max_seqlen_q=4, max_seqlen_kv=4, cu_seqlens_q=cu, cu_seqlens_kv=cu, q=x, k=x, v=x, o=x,
              d_o=x, fake_dtype=x.dtype, aux_ctx_tensors=[], fused_attention_backend=1)
    if fakes.vt(version)[:2] < (2, 15):
        kw["dqkv_dtype"] = "kBFloat16"
    for key, value in wrong.items():
        kw.pop(key) if value is ... else kw.update({key: value})
    with pytest.raises(TypeError, match=error):
        fa.fused_attn_bwd(**kw)


@pytest.mark.parametrize("version", ["2.4.0", "2.5.0", "2.8.0", "2.12.0", "2.19.0"])
def test_te_get_fused_attn_backend_is_positional_with_the_versions_arguments(monkeypatch, version):
    fake_te.install(monkeypatch, version)
    import transformer_engine_torch as tex

    n = len(fake_te.backend_args(version))
    with pytest.raises(TypeError, match="incompatible function arguments"):
        tex.get_fused_attn_backend(*([0] * (n - 1)))  # the previous version's count
    backend = get_backend("transformer_engine")
    assert int(backend.kernel(torch.bfloat16, 8, 2, 64, 300, 300, causal=True)) == 1  # F16_arbitrary


def test_te_refuses_a_shape_its_backend_choice_refuses(monkeypatch):
    """TE's get_fused_attn_backend decides; No_Backend is a clear error before the kernel."""
    fa = fake_te.install(monkeypatch, "2.10.0")
    on_cpu(monkeypatch, "transformer_engine")
    fa.refuse = lambda a: a["max_seqlen_kv"] > 4  # part P has 5 prefix keys
    args, grad_out = make_problem(13, *PACKED, 8, 2, F64)
    with pytest.raises(ValueError, match="get_fused_attn_backend chose .*No_Backend.*max_seqlen 4/5"):
        shared_prefix_attention(*args, backend="transformer_engine")
    assert not [c for c in fa.calls if c["fn"] == "fwd" and c["mask"] == "padding"]


def test_te_availability_asks_te(monkeypatch):
    fa = fake_te.install(monkeypatch, "2.12.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = get_backend("transformer_engine")
    assert backend.available("cuda", torch.bfloat16, 64)
    backends._reset()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = get_backend("transformer_engine").available("cuda", torch.bfloat16, 64).reason
    assert "compute capability >= (9, 0)" in why
    backends._reset()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fa.refuse = lambda a: True  # e.g. a cuDNN without this head_dim
    why = get_backend("transformer_engine").available("cuda", torch.bfloat16, 64).reason
    assert "get_fused_attn_backend chose <NVTE_Fused_Attn_Backend.NVTE_No_Backend: -1>" in why


def test_te_leaves_empty_prefix_slots_out_of_part_p(monkeypatch):
    """cuDNN rows without keys are unspecified (NaN in the fake): the middle slot, which has no
    prefix, is gathered out of part P and its rows keep part S's result."""
    fa = fake_te.install(monkeypatch)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(9, *PACKED, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="transformer_engine")
    part_p = [c for c in fa.calls if c.get("mask") == "padding"]
    assert all(c["cu_q"] == [0, 4, 6] and c["cu_k"] == [0, 5, 8] for c in part_p) and len(part_p) == 2


@pytest.mark.parametrize("version", ["2.2.0", "2.18.0", "2.19.0"])
def test_te_copy_mode_uses_dot_product_attention(monkeypatch, version):
    fa = fake_te.install(monkeypatch, version)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(10, *PACKED, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], mode="copy", backend="transformer_engine")
    (call,) = fa.calls
    assert call["fn"] == "dpa" and call["mask"] == "padding_causal_bottom_right"


def test_host_metadata_is_built_once_per_layout():
    """Layers of one microbatch reuse the same call description and device tensors."""
    cu = (0, 3, 4, 8)
    call = suffix_call(cu)
    assert suffix_call(tuple([0, 3, 4, 8])) is call and (call.max_q, call.max_k) == (4, 4)
    first = call.cu_tensors(CPU)
    assert all(a is b for a, b in zip(first, call.cu_tensors(CPU)))
    assert first[0].dtype == torch.int32 and first[0].tolist() == list(cu)
    assert call.runs == ((0, 0, 3, 3, 1), (3, 3, 1, 1, 1), (4, 4, 4, 4, 1))


# ---------------------------------------------------------------- real libraries (GPU)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["transformer_engine", "flash_attn", "math"])
@pytest.mark.parametrize("mode", ["two_part", "copy"])
def test_real_backend_on_cuda_matches_oracle(name, mode):
    why = get_backend(name).available("cuda", torch.bfloat16, 64)
    if not why:
        pytest.skip(why.reason)
    args, grad_out = make_problem(11, *PACKED, 8, 2, torch.bfloat16, head_dim=64)
    cuda = lambda x: x.detach().cuda().requires_grad_()  # noqa: E731
    q, k, v, pk, pv, meta = args
    dev_args = (cuda(q), cuda(k), cuda(v), [cuda(x) for x in pk], [cuda(x) for x in pv], meta)
    got = out_and_grads(shared_prefix_attention, dev_args, grad_out.cuda(), mode=mode, backend=name)
    want = out_and_grads(reference_attention, as_f64(args), grad_out)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_rel_close(a.cpu(), b, TOL[torch.bfloat16], f"{name} {mode} tensor {i}")


@pytest.mark.parametrize("mode", ["two_part", "copy"])
def test_flash_takes_mla_value_head_dim_through_padding(monkeypatch, mode):
    """MLA (Q/K 24, V 16 here; DeepSeek-V3 192 / 128): flash-attn 2 takes one head dim (the fake
    asserts it, as mha_varlen_fwd's shapes do), so V reaches it zero-padded
    ([Note: unequal V head dim]); output and every gradient equal the float64 oracle."""
    fakes.install_flash_attn(monkeypatch)
    on_cpu(monkeypatch, "flash_attn")
    gen = torch.Generator().manual_seed(2)
    meta = PackedMeta.from_lengths([3, 2, 4], [0, 0, 1])

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).requires_grad_()

    q, k, v = leaf(9, 4, 24), leaf(9, 2, 24), leaf(9, 2, 16)
    pk, pv = [leaf(6, 2, 24), leaf(3, 2, 24)], [leaf(6, 2, 16), leaf(3, 2, 16)]
    out = shared_prefix_attention(q, k, v, pk, pv, meta, scale=0.2, backend="flash_attn",
                                  mode=mode)
    ref = reference_attention(q, k, v, pk, pv, meta, scale=0.2)
    assert out.shape == (9, 4, 16)
    grad = torch.randn(out.shape, generator=gen, dtype=F64)
    inputs = (q, k, v, *pk, *pv)
    got = (out, *torch.autograd.grad(out, inputs, grad))
    want = (ref, *torch.autograd.grad(ref, inputs, grad))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-12 * b.abs().max()
