"""The CPU layer's torch stand-ins for mamba-ssm / causal-conv1d (megatron_patches/support/mamba_cpu.py)
against a plain step-by-step recurrence written here (float64), and the state contract prefix
reuse relies on: running [prefix; suffix] equals running the prefix, then the suffix from the
prefix's final conv and SSM states."""
import pytest
import torch
import torch.nn.functional as F

from megatron_patches.support import mamba_cpu

torch.manual_seed(0)
DT = torch.float64


def _naive_scan(x, dt, A, B, C, D, dt_bias, h0=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, one step at a time."""
    batch, length, heads, hdim = x.shape
    groups, n = B.shape[2], B.shape[3]
    rep = heads // groups
    delta = F.softplus(dt + dt_bias)
    h = torch.zeros(batch, heads, hdim, n, dtype=DT) if h0 is None else h0.clone()
    ys = []
    for t in range(length):
        bt = B[:, t].repeat_interleave(rep, dim=1)  # [b, h, n]
        ct = C[:, t].repeat_interleave(rep, dim=1)
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]
        h = decay * h + (delta[:, t, :, None] * x[:, t])[..., None] * bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, ct) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), h


def _inputs(length, batch=2, heads=4, hdim=3, groups=2, n=5):
    return dict(x=torch.randn(batch, length, heads, hdim, dtype=DT),
                dt=torch.randn(batch, length, heads, dtype=DT),
                A=-torch.rand(heads, dtype=DT) * 3, B=torch.randn(batch, length, groups, n, dtype=DT),
                C=torch.randn(batch, length, groups, n, dtype=DT), D=torch.randn(heads, dtype=DT),
                dt_bias=torch.randn(heads, dtype=DT))


@pytest.mark.parametrize("length,chunk", [(1, 4), (7, 4), (8, 4), (13, 16), (20, 3)])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    i = _inputs(length)
    h0 = torch.randn(2, 4, 3, 5, dtype=DT)
    want, want_h = _naive_scan(**i, h0=h0)
    got, got_h = mamba_cpu.mamba_chunk_scan_combined(
        i["x"], i["dt"], i["A"], i["B"], i["C"], chunk, D=i["D"], dt_bias=i["dt_bias"],
        dt_softplus=True, initial_states=h0, return_final_states=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-10)


def test_scan_state_chains_and_its_gradient_reaches_the_initial_state():
    i = _inputs(12)
    full = mamba_cpu.mamba_chunk_scan_combined(i["x"], i["dt"], i["A"], i["B"], i["C"], 4,
                                               D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True)
    cut = {k: (v[:, :5] if v.dim() > 1 else v) for k, v in i.items()}
    rest = {k: (v[:, 5:] if v.dim() > 1 else v) for k, v in i.items()}
    y1, h = mamba_cpu.mamba_chunk_scan_combined(
        cut["x"], cut["dt"], cut["A"], cut["B"], cut["C"], 4, D=cut["D"], dt_bias=cut["dt_bias"],
        dt_softplus=True, return_final_states=True)
    h_leaf = h.detach().requires_grad_()
    y2 = mamba_cpu.mamba_chunk_scan_combined(
        rest["x"], rest["dt"], rest["A"], rest["B"], rest["C"], 4, D=rest["D"],
        dt_bias=rest["dt_bias"], dt_softplus=True, initial_states=h_leaf)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, rtol=1e-10, atol=1e-10)
    y2.square().sum().backward()
    assert h_leaf.grad is not None and h_leaf.grad.abs().max() > 0
    # d(loss)/d(h) by finite differences on one entry
    eps, idx = 1e-6, (1, 2, 1, 3)
    bumped = h.detach().clone()
    bumped[idx] += eps
    y2b = mamba_cpu.mamba_chunk_scan_combined(
        rest["x"], rest["dt"], rest["A"], rest["B"], rest["C"], 4, D=rest["D"],
        dt_bias=rest["dt_bias"], dt_softplus=True, initial_states=bumped)
    fd = (y2b.square().sum() - y2.detach().square().sum()) / eps
    assert abs(fd - h_leaf.grad[idx]) < 1e-4 * max(1.0, abs(float(fd)))


@pytest.mark.parametrize("length", [1, 2, 6])
def test_conv_with_initial_states_chains(length):
    dim, width = 6, 4
    x = torch.randn(2, dim, 9 + length, dtype=DT)
    w, b = torch.randn(dim, width, dtype=DT), torch.randn(dim, dtype=DT)
    full = mamba_cpu.causal_conv1d_fn(x, w, b, activation="silu")
    want = F.silu(F.conv1d(F.pad(x, (width - 1, 0)), w.unsqueeze(1), b, groups=dim))
    torch.testing.assert_close(full, want)
    y1, tail = mamba_cpu.causal_conv1d_fn(x[..., :length], w, b, activation="silu",
                                          return_final_states=True)
    assert tail.shape == (2, dim, width - 1)
    if length < width - 1:  # missing steps are zeros
        assert tail[..., : width - 1 - length].abs().max() == 0
    y2 = mamba_cpu.causal_conv1d_fn(x[..., length:], w, b, activation="silu", initial_states=tail)
    torch.testing.assert_close(torch.cat([y1, y2], -1), full)


def test_seq_idx_restarts_conv_and_scan():
    i = _inputs(9, batch=1)
    seq_idx = torch.tensor([[0] * 4 + [1] * 5], dtype=torch.int32)
    got = mamba_cpu.mamba_chunk_scan_combined(i["x"], i["dt"], i["A"], i["B"], i["C"], 4,
                                              D=i["D"], dt_bias=i["dt_bias"], dt_softplus=True,
                                              seq_idx=seq_idx)
    a = {k: (v[:, :4] if v.dim() > 1 else v) for k, v in i.items()}
    b = {k: (v[:, 4:] if v.dim() > 1 else v) for k, v in i.items()}
    want = torch.cat([_naive_scan(**a)[0], _naive_scan(**b)[0]], 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    x = torch.randn(1, 3, 9, dtype=DT)
    w = torch.randn(3, 4, dtype=DT)
    got = mamba_cpu.causal_conv1d_fn(x, w, None, seq_idx=seq_idx)
    want = torch.cat([mamba_cpu.causal_conv1d_fn(x[..., :4], w), mamba_cpu.causal_conv1d_fn(x[..., 4:], w)], -1)
    torch.testing.assert_close(got, want)


def test_gated_norm_matches_its_definition():
    x, z, w = (torch.randn(3, 8, dtype=DT) for _ in range(3))
    got = mamba_cpu.rms_norm_ref(x, w[0], z=z, eps=1e-5, group_size=4, norm_before_gate=False)
    g = (x * F.silu(z)).reshape(3, 2, 4)
    want = (g / torch.sqrt(g.square().mean(-1, keepdim=True) + 1e-5)).reshape(3, 8) * w[0]
    torch.testing.assert_close(got, want)
