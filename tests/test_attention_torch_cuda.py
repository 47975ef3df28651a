"""The "torch_cuda" backend (PyTorch's own varlen flash attention) on CPU through the fake of its
aten ops (tests/fake_torch_flash.py, derived from PyTorch's source): output and every gradient,
prefix K/V included, against the float64 oracle; GQA, empty prefix slots, 1-token suffixes,
copy mode; refusals (version, ROCm, CPU build, no flash, changed schema, device); "auto" order.
The real kernels run in tools/gpu_check.py --quick phase a (`gpu` marker test below)."""
import pytest
import torch

import fake_torch_flash as fake
import prefix_schedule.attention.backends as backends
from prefix_schedule.attention import causal_attention
from prefix_schedule.attention.backends import ENV_VAR, Availability, get_backend, select_backend
from prefix_schedule.attention.backends import versions
from test_attention import CASES, HEADS, TOL, make_problem
from test_attention_backends import check_against_oracle, on_cpu

CPU, F64 = torch.device("cpu"), torch.float64


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    backends._reset()
    yield
    backends._reset()


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("case", list(CASES))
def test_two_part_matches_oracle(monkeypatch, case, heads):
    state = fake.install(monkeypatch)
    on_cpu(monkeypatch, "torch_cuda")
    args, grad_out = make_problem(5, *CASES[case], *HEADS[heads], F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="torch_cuda")
    assert [c["fn"] for c in state.calls] == ["fwd", "fwd", "bwd", "bwd"]
    s_fwd, p_fwd = state.calls[:2]
    assert s_fwd["causal"] or s_fwd["max_q"] == 1 or CASES[case][0] == [1] * len(CASES[case][0])
    assert not p_fwd["causal"] and all(c["max_q"] >= 2 for c in state.calls)  # never the swap path


@pytest.mark.parametrize("schemas", ["flaggems-table", "philox-names"])
def test_older_schema_texts_load_and_match_oracle(monkeypatch, schemas):
    """The leading parameters the backend passes are the same in the older schema texts."""
    fake.install(monkeypatch, "2.10.0", schemas=fake.SCHEMAS[schemas])
    on_cpu(monkeypatch, "torch_cuda")
    args, grad_out = make_problem(4, *CASES["packed3"], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="torch_cuda")


def test_empty_prefix_slot_stays_in_part_p(monkeypatch):
    """PACKED has a slot whose prefix is empty: it stays a key-less entry of part P (out 0,
    LSE +inf in the kernel; the merge counts it as no mass)."""
    state = fake.install(monkeypatch)
    on_cpu(monkeypatch, "torch_cuda")
    lengths, slots, prefix_lens = CASES["packed3"]
    assert 0 in prefix_lens
    args, grad_out = make_problem(6, lengths, slots, prefix_lens, 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="torch_cuda")
    cu_k = state.calls[1]["cu_k"]
    assert any(a == b for a, b in zip(cu_k, cu_k[1:]))


def test_copy_mode_and_causal_attention(monkeypatch):
    state = fake.install(monkeypatch)
    on_cpu(monkeypatch, "torch_cuda")
    args, grad_out = make_problem(7, *CASES["two_groups"], 8, 2, F64)
    check_against_oracle(args, grad_out, TOL[F64], backend="torch_cuda", mode="copy")
    assert [c["fn"] for c in state.calls] == ["fwd", "bwd"] and state.calls[0]["causal"]
    q, k, v = (torch.randn(6, h, 8, dtype=F64) for h in (4, 2, 2))
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    got = causal_attention(q, k, v, backend="torch_cuda")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bf16_close_to_oracle(monkeypatch):
    fake.install(monkeypatch)
    on_cpu(monkeypatch, "torch_cuda")
    args, grad_out = make_problem(8, *CASES["packed3"], 8, 2, torch.bfloat16)
    check_against_oracle(args, grad_out, TOL[torch.bfloat16], backend="torch_cuda")


def test_fake_enforces_the_kernel_checks(monkeypatch):
    """The fake refuses what mha_varlen_fwd refuses (so the backend's calls are checked)."""
    fake.install(monkeypatch)
    ops = torch_cuda_ops()
    q = torch.randn(4, 4, 8, dtype=torch.float16)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(AssertionError, match="fp16 and bf16"):
        ops.fwd(q.float(), q.float(), q.float(), cu, cu, 2, 2, 0.0, False, False, scale=0.1)
    with pytest.raises(AssertionError, match="head_size"):
        q12 = torch.randn(4, 4, 12, dtype=torch.float16)
        ops.fwd(q12, q12, q12, cu, cu, 2, 2, 0.0, False, False, scale=0.1)
    with pytest.raises(AssertionError, match="cum_seq_q"):  # int32 only
        ops.fwd(q, q, q, cu.long(), cu, 2, 2, 0.0, False, False, scale=0.1)
    with pytest.raises(AssertionError, match="python int"):
        ops.fwd(q, q, q, cu, cu, torch.tensor(2), 2, 0.0, False, False, scale=0.1)
    with pytest.raises(TypeError, match="window_size"):
        ops.fwd(q, q, q, cu, cu, 2, 2, 0.0, False, False, scale=0.1, window_size=(-1, 0))
    with pytest.raises(TypeError, match="too many positional"):
        ops.fwd(q, q, q, cu, cu, 2, 2, 0.0, False, False, 0.1)  # scale is keyword-only
    kv = torch.randn(3, 2, 8, dtype=torch.float16)  # GQA, max_q == 1, an entry without queries
    with pytest.raises(RuntimeError, match="invalid for input"):
        ops.fwd(q[:1], kv, kv, torch.tensor([0, 1, 1], dtype=torch.int32),
                torch.tensor([0, 2, 3], dtype=torch.int32), 1, 2, 0.0, False, False, scale=0.1)


def torch_cuda_ops():
    from prefix_schedule.attention.backends import torch_cuda

    return torch_cuda.torch_flash_ops()


@pytest.mark.parametrize("kw, reason", [
    (dict(version="2.9.1"), "torch 2.9.1 is outside the versions whose call signatures were checked (2.10 - 2.13"),
    (dict(version="2.14.0"), "outside the versions"),
    (dict(hip="6.4"), "ROCm"),
    (dict(cuda=None), "CPU-only build"),
    (dict(flash_built=False), "built without flash attention"),
    (dict(schemas=(fake.SCHEMAS["2.13"][0].replace("*, float? scale=None, ", "*, "),
                   fake.SCHEMAS["2.13"][1])), "differ from the checked schemas"),
    (dict(schemas=(fake.SCHEMAS["2.13"][0],
                   fake.SCHEMAS["2.13"][1].replace("Tensor rng_state, Tensor unused, ", ""))),
     "_flash_attention_backward is"),
])
def test_refusals_name_the_reason(monkeypatch, kw, reason):
    fake.install(monkeypatch, **kw)
    why = get_backend("torch_cuda").available(CPU, torch.bfloat16, 64).reason
    assert reason in why and "install with" in why, why
    with pytest.raises(ValueError, match="torch_cuda"):
        select_backend("torch_cuda", device=CPU, dtype=torch.bfloat16, head_dim=64)


def test_device_reasons(monkeypatch):
    fake.install(monkeypatch)
    backend = get_backend("torch_cuda")
    assert "needs a CUDA device" in backend.available(CPU, torch.bfloat16, 64).reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability >= (8, 0)" in backend.available("cuda", torch.float16, 64).reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "supports torch.float16, torch.bfloat16, got torch.float32" in \
        backend.available("cuda", torch.float32, 64).reason
    assert "head_dim a multiple of 8 and <= 256, got 320" in backend.available("cuda", torch.bfloat16, 320).reason
    assert backend.available("cuda", torch.bfloat16, 128)


def test_auto_order_puts_torch_cuda_after_te_and_flash(monkeypatch):
    def set_ok(**ok):
        for name, flag in ok.items():
            monkeypatch.setattr(get_backend(name), "available",
                                lambda d, t, h=None, f=flag: Availability(f, "" if f else "off"))
    set_ok(transformer_engine=False, flash_attn=False, torch_cuda=True)
    assert select_backend(device=CPU, dtype=torch.bfloat16).name == "torch_cuda"
    backends._reset()
    set_ok(flash_attn=True)
    assert select_backend(device=CPU, dtype=torch.bfloat16).name == "flash_attn"
    assert backends.BACKEND_NAMES.index("torch_cuda") == backends.BACKEND_NAMES.index("torch") - 1


def test_installed_torch_schemas_are_the_faked_ones():
    """The fake's schema text is what this PyTorch prints (a later torch bump shows up here)."""
    got = tuple(str(op.default._schema) for op in (torch.ops.aten._flash_attention_forward,
                                                    torch.ops.aten._flash_attention_backward))
    if versions.version_tuple(torch.__version__)[:2] == (2, 13):
        assert got == fake.SCHEMAS["2.13"]
    versions.check_torch_flash_schemas(*got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_kernels_on_cuda(dtype):
    if not get_backend("torch_cuda").available("cuda", dtype, 64):
        pytest.skip(get_backend("torch_cuda").available("cuda", dtype, 64).reason)
    args, grad_out = make_problem(9, *CASES["packed3"], 8, 2, dtype, head_dim=64)
    args = [[x.detach().cuda().requires_grad_() for x in a] if isinstance(a, list)
            else (a.detach().cuda().requires_grad_() if torch.is_tensor(a) else a) for a in args]
    check_against_oracle(args, grad_out.cuda(), TOL[torch.bfloat16], backend="torch_cuda")
