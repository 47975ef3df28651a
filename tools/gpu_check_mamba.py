"""gpu_check.py, phase 7: Mamba-2 with prefix reuse on mamba-ssm's and causal-conv1d's kernels.

On a GPU, Megatron's MambaMixer trains through mamba-ssm's fused `mamba_split_conv1d_scan_combined`,
which takes no conv state; the reuse hook (megatron_patches/runtime/mamba_hooks.py) therefore runs
each row segment as causal-conv1d's `causal_conv1d_fn` over [cached conv tail; segment] (a
channel-last view, as the hook passes it) and mamba-ssm's `mamba_chunk_scan_combined` from the
group's cached SSD state (`initial_states`, `return_final_states`; docs/KERNEL_VERSIONS.md
"Mamba-2"). So:
1. kernel: the same calls the hook makes, on a sequence split into a prefix and a suffix (the
   suffix resumes from the prefix's final state and conv tail), against the whole sequence in one
   call: outputs, the final state, and the gradients of x, dt, A, B, C, D, z, dt_bias, the conv
   weight and bias (the chained gradient reaches the prefix through the state, as Phase C needs),
   relative max error <= 2e-2 on a GPU (fp32 inputs; Triton's tf32 dots), 1e-5 in the dry run;
   on a GPU also the whole-sequence kernel call against the CPU layer's torch stand-in
   (megatron_patches/support/mamba_cpu.py) in fp32 on the same inputs;
2. end to end: a bf16 dense step and a bf16 reuse step of a tiny HybridModel `M*M-` (local
   spec, the real kernels) are equally close to an fp32 dense reference of the same weights:
   reuse error <= 1.5 x dense.
`--dry-run`: the CPU layer's torch stand-ins (megatron_patches/support/mamba_cpu.py), tiny sizes.
"""
from __future__ import annotations

import torch

from gpu_check_gdn import e2e_steps

PATTERN = "M*M-"
GPU_SHAPE = dict(hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                 num_query_groups=2, vocab_size=4096)
DRY_SHAPE = dict(hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 vocab_size=256)
GPU_MAMBA = dict(mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, mamba_num_heads=32)
DRY_MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)
GPU_WORK = dict(prefix_len=1536, suffix_len=256, group_size=4, num_groups=2)
DRY_WORK = dict(prefix_len=40, suffix_len=8, group_size=3, num_groups=2)
KERNEL_TOL = {True: 1e-5, False: 2e-2}  # dry run (fp32 torch) / GPU (Triton, tf32 dots)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _inputs(device, dry_run: bool) -> dict:
    heads, headdim, groups, dstate, length, width = ((4, 8, 2, 8, 53, 4) if dry_run
                                                     else (16, 64, 4, 128, 1100, 4))
    gen = torch.Generator().manual_seed(0)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    channels = heads * headdim + 2 * groups * dstate
    return dict(xbc=draw(1, length, channels), z=draw(1, length, heads * headdim),
                dt=draw(1, length, heads, scale=0.5), A=-torch.rand(heads, generator=gen).to(device),
                D=draw(heads), dt_bias=draw(heads, scale=0.1),
                conv_w=draw(channels, width, scale=0.3), conv_b=draw(channels, scale=0.1),
                dims=(heads, headdim, groups, dstate), split=length * 2 // 3)


def _scan(conv_fn, scan_fn, t, a, b, tail, state, chunk):
    """The hook's calls on tokens [a, b): the conv over [tail; segment] (channel-last view), then
    the scan from `state`; returns (y, conv tail, final state)."""
    heads, headdim, groups, dstate = t["dims"]
    width = t["conv_w"].shape[-1]
    xbc = t["xbc"][:, a:b]
    window = torch.cat([tail, xbc], dim=1) if tail is not None else torch.cat(
        [xbc.new_zeros(1, width - 1, xbc.shape[-1]), xbc], dim=1)
    conv = conv_fn(window.transpose(1, 2), t["conv_w"], t["conv_b"], activation="silu")
    conv = conv[..., width - 1:].transpose(1, 2)
    dim = heads * headdim
    x, bmat, cmat = torch.split(conv, [dim, groups * dstate, groups * dstate], dim=-1)
    n = b - a
    y, final = scan_fn(x.reshape(1, n, heads, headdim), t["dt"][:, a:b], t["A"],
                       bmat.reshape(1, n, groups, dstate), cmat.reshape(1, n, groups, dstate),
                       chunk, D=t["D"], z=t["z"][:, a:b].reshape(1, n, heads, headdim),
                       dt_bias=t["dt_bias"], dt_softplus=True, initial_states=state,
                       return_final_states=True)
    return y.reshape(1, n, dim), window[:, -(width - 1):], final


_GRADS = ("xbc", "z", "dt", "A", "D", "dt_bias", "conv_w", "conv_b")


def _run(conv_fn, scan_fn, t, chained: bool, chunk: int):
    leaves = {k: (v.detach().clone().requires_grad_(True) if torch.is_tensor(v) else v)
              for k, v in t.items()}
    length, split = t["xbc"].shape[1], t["split"]
    if chained:
        y1, tail, state = _scan(conv_fn, scan_fn, leaves, 0, split, None, None, chunk)
        y2, _, final = _scan(conv_fn, scan_fn, leaves, split, length, tail, state, chunk)
        y = torch.cat([y1, y2], dim=1)
    else:
        y, _, final = _scan(conv_fn, scan_fn, leaves, 0, length, None, None, chunk)
    gen = torch.Generator().manual_seed(1)
    w_y = torch.randn(y.shape, generator=gen).to(y.device)
    w_f = torch.randn(final.shape, generator=gen).to(y.device)
    ((y.float() * w_y).sum() + (final.float() * w_f).sum()).backward()
    return y.detach(), final.detach(), {k: leaves[k].grad for k in _GRADS}


def _compare(got, want) -> dict:
    errors = dict(out=_rel(got[0], want[0]), final_state=_rel(got[1], want[1]))
    errors.update({f"d{k}": _rel(got[2][k], want[2][k]) for k in _GRADS})
    return errors


def check_kernel(device, *, dry_run: bool) -> dict:
    """The hook's conv + scan calls, chained over a prefix/suffix split, vs one whole call."""
    from megatron.core.ssm import mamba_mixer
    from megatron_patches.support import mamba_cpu

    conv_fn, scan_fn = mamba_mixer.causal_conv1d_fn, mamba_mixer.mamba_chunk_scan_combined
    t = _inputs(device, dry_run)
    chunk = 16 if dry_run else 256
    whole = _run(conv_fn, scan_fn, t, chained=False, chunk=chunk)
    errors = {"chained_vs_whole": _compare(_run(conv_fn, scan_fn, t, chained=True, chunk=chunk),
                                           whole)}
    if not dry_run:  # the real kernels against the CPU layer's torch stand-ins, fp32
        ref = _run(mamba_cpu.causal_conv1d_fn, mamba_cpu.mamba_chunk_scan_combined, t,
                   chained=False, chunk=chunk)
        errors["kernel_vs_torch"] = _compare(whole, ref)
    tol = KERNEL_TOL[dry_run]
    worst = max(v for part in errors.values() for v in part.values())
    return dict(ok=worst <= tol, tol=tol, errors=errors, split=t["split"],
                length=t["xbc"].shape[1], chunk_size=chunk,
                kernels=[getattr(f, "__module__", "?") for f in (conv_fn, scan_fn)])


def _models(dry_run: bool, max_seq_len: int):
    """(bf16 model, fp32 reference with the same weights); slow decay, as a trained model has."""
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    shape, mamba = (DRY_SHAPE, DRY_MAMBA) if dry_run else (GPU_SHAPE, GPU_MAMBA)
    cfg16 = TinyLlamaConfig(num_layers=0, **shape, max_seq_len=max_seq_len,
                            params_dtype=torch.bfloat16)
    cfg32 = TinyLlamaConfig(num_layers=0, **shape, max_seq_len=max_seq_len)
    model16 = build_hybrid_model(cfg16, PATTERN, seed=3, **mamba)
    model32 = build_hybrid_model(cfg32, PATTERN, seed=4, **mamba)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model16.modules():
            if isinstance(module, MambaMixer):
                a_log = torch.empty(module.A_log.shape).uniform_(0.05, 0.5, generator=gen).log()
                module.A_log.copy_(a_log.to(module.A_log))
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    for model in (model16, model32):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model16, model32, shape, mamba


def run(device, *, dry_run: bool) -> dict:
    import megatron_patches

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    from megatron.core.ssm import mamba_mixer

    if mamba_mixer.causal_conv1d_fn is None or mamba_mixer.mamba_chunk_scan_combined is None:
        return {"skipped": "mamba-ssm and causal-conv1d are not installed: Megatron's "
                           "MambaMixer needs them on a GPU"}
    kernel = check_kernel(device, dry_run=dry_run)
    work = DRY_WORK if dry_run else GPU_WORK
    results, errors, steps_ok, shape, settings = e2e_steps(_models, work, dry_run=dry_run)
    ok = kernel["ok"] and steps_ok
    return dict(claim=f"Mamba-2 (HybridModel {PATTERN}), causal-conv1d's conv over [cached tail; "
                      "segment] and mamba-ssm's chunk scan from a cached state: chained == one "
                      "call, and bf16 dense vs bf16 reuse equally close to an fp32 dense reference",
                ok=ok, kernel=kernel, settings={k: str(v) for k, v in settings.items()},
                model=dict(shape, pattern=PATTERN), workload=dict(work),
                grad_rel_err_vs_fp32=errors, losses=results)
