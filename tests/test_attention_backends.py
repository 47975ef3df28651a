"""Attention backends: selection (auto order, env override, explicit-unavailable errors, log once,
process default), and each backend's dispatch against the float64 oracle -- flash-attn and
Transformer Engine through fake kernel modules with the real signatures (fake_attention_libs),
torch and math directly. GPU tests for the real libraries are marked `gpu`."""
import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

import fake_attention_libs as fakes
import prefix_schedule.attention.backends as backends
from prefix_schedule.attention import causal_attention, reference_attention, shared_prefix_attention
from prefix_schedule.attention.backends import (ENV_VAR, Availability, get_backend, select_backend,
                                                set_default_backend)
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
    (False, False, "cuda", "math"),  # torch's CPU kernel refuses a CUDA device
])
def test_auto_order(monkeypatch, te, fa, device, want):
    fake_availability(monkeypatch, transformer_engine=te, flash_attn=fa)
    assert select_backend(device=torch.device(device), dtype=torch.bfloat16).name == want
    assert select_backend("auto", device=device, dtype=torch.bfloat16).name == want


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
    ("flash_attn", ["not installed", "pip install 'flash-attn>=2.6'"]),
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
    backends._reset()
    fakes.install_flash_attn(monkeypatch, "2.5.9")
    assert "older than 2.6" in get_backend("flash_attn").available(CPU, torch.bfloat16).reason
    fakes.install_transformer_engine(monkeypatch, cudnn=(9, 5, 1))
    assert "cuDNN >= (9, 6, 0)" in get_backend("transformer_engine").available(CPU, torch.bfloat16).reason
    assert "got a cuda device" in get_backend("torch").available("cuda", torch.float32).reason
    assert get_backend("math").available("cuda", torch.float32)


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


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4", "2.8.3"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_two_part_matches_oracle(monkeypatch, version, case):
    iface = fakes.install_flash_attn(monkeypatch, version)
    on_cpu(monkeypatch, "flash_attn")
    args, grad_out = make_problem(3, *CASES[case], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="flash_attn")
    assert [c["fn"] for c in iface.calls] == ["fwd", "fwd", "bwd", "bwd"]


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


@pytest.mark.parametrize("flavor, packed", [("2.x", True), ("latest", True), ("2.x", False)],
                         ids=["2.x", "latest", "padded_stats"])
@pytest.mark.parametrize("case", list(CASES))
def test_te_two_part_matches_oracle(monkeypatch, flavor, packed, case):
    fa = fakes.install_transformer_engine(monkeypatch, flavor, packed_stats=packed)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(8, *CASES[case], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="transformer_engine")
    assert [(c["fn"], c["mask"]) for c in fa.calls] == [
        ("fwd", "padding_causal"), ("fwd", "padding"), ("bwd", "padding_causal"), ("bwd", "padding")]


def test_te_leaves_empty_prefix_slots_out_of_part_p(monkeypatch):
    """cuDNN rows without keys are unspecified (NaN in the fake): the middle slot, which has no
    prefix, is gathered out of part P and its rows keep part S's result."""
    fa = fakes.install_transformer_engine(monkeypatch)
    on_cpu(monkeypatch, "transformer_engine")
    args, grad_out = make_problem(9, *PACKED, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="transformer_engine")
    part_p = [c for c in fa.calls if c["mask"] == "padding"]
    assert all(c["cu_q"] == [0, 4, 6] and c["cu_k"] == [0, 5, 8] for c in part_p) and len(part_p) == 2


@pytest.mark.parametrize("flavor", ["2.x", "latest"])
def test_te_copy_mode_uses_dot_product_attention(monkeypatch, flavor):
    fa = fakes.install_transformer_engine(monkeypatch, flavor)
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


# ---------------------------------------------------------------- tools/gpu_check.py

@pytest.fixture
def gpu_check(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYOUTS", {"tiny": ([3, 1, 2], [0, 1, 1], [4, 0])})
    return module


def test_gpu_check_without_cuda_checks_torch_and_exits_0(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert "no CUDA device" in capsys.readouterr().out and report["failures"] == 0
    assert {(r["backend"], r["mode"]) for r in report["correctness"]} == {("torch", "two_part"), ("torch", "copy")}


def test_gpu_check_reports_a_wrong_backend(gpu_check, monkeypatch):
    fakes.install_flash_attn(monkeypatch)
    on_cpu(monkeypatch, "flash_attn")
    rows = gpu_check.check_correctness(CPU, (F64,), ["flash_attn", "math"], 4, 2, 8)
    assert all(r["ok"] for r in rows), rows
    math_backend = get_backend("math")
    original = math_backend.varlen_bwd
    monkeypatch.setattr(math_backend, "varlen_bwd", lambda *a: [2 * g for g in original(*a)])
    rows = gpu_check.check_correctness(CPU, (F64,), ["math"], 4, 2, 8)
    assert [r["ok"] for r in rows] == [False, True] and rows[0]["out"] < 1e-12 < rows[0]["dq"]


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
