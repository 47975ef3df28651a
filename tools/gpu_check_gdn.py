"""gpu_check.py, phase 5: Gated DeltaNet with prefix reuse on fla's kernels.

On a GPU, Megatron's GatedDeltaNet takes its short conv, l2norm and chunked delta rule from
flash-linear-attention (fla; docs/KERNEL_VERSIONS.md). The reuse hook calls fla's
`chunk_gated_delta_rule` once per row with `cu_seqlens` and one initial state per packed sequence
(`[N, HV, K, V]`, fp32) and caches the returned final state; the backward's dh0 is the state
gradient Phase C consumes ([Note: recurrent prefix state] in docs/DESIGN.md). fla refuses fp32
inputs, so:
1. kernel: fla's varlen call with per-sequence initial states, bf16, against Megatron's torch
   rule run per sequence in fp32 on the same (bf16-rounded) inputs: outputs, final states and
   the gradients of q, k, v, g, beta and the initial states (relative max error <= 2e-2);
2. end to end: a bf16 dense step and a bf16 reuse step of a Qwen3-Next-style GDN GPTModel
   (local spec, fla kernels) are equally close to an fp32 dense reference of the same weights
   run in deterministic mode (Megatron's torch rule and F.conv1d): reuse error <= 1.5 x dense.
`--dry-run`: the CPU layer's torch stand-ins for fla (megatron_patches/support/gdn_cpu.py), tiny sizes.
"""
from __future__ import annotations

import torch

from benchlib.steps import private_rendezvous
from benchlib.workload import make_batch

LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GPU_SHAPE = dict(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                 num_query_groups=2, vocab_size=4096)
DRY_SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)
GPU_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_num_key_heads=4, linear_num_value_heads=8)
GPU_WORK = dict(prefix_len=1536, suffix_len=256, group_size=4, num_groups=2)
DRY_WORK = dict(prefix_len=40, suffix_len=8, group_size=3, num_groups=2)
KERNEL_TOL = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def check_kernel(device, *, dry_run: bool) -> dict:
    """fla's varlen rule with per-sequence initial states vs the torch rule per sequence."""
    from megatron.core.ssm.gated_delta_net import common, gdn  # 0.20: the torch rule is gdn's

    lengths, heads, dim = ((5, 70, 3), 2, 16) if dry_run else ((700, 129, 64, 1), 8, 128)
    gen = torch.Generator().manual_seed(0)
    total, n = sum(lengths), len(lengths)

    def draw(*shape, fn=lambda x: x):
        return fn(torch.randn(*shape, generator=gen)).to(device)

    q = draw(1, total, heads, dim, fn=lambda x: torch.nn.functional.normalize(x, dim=-1))
    k = draw(1, total, heads, dim, fn=lambda x: torch.nn.functional.normalize(x, dim=-1))
    v, g = draw(1, total, heads, dim), draw(1, total, heads, fn=lambda x: -x.abs() * 0.05)
    beta, h0 = draw(1, total, heads, fn=torch.sigmoid), draw(n, heads, dim, dim) * 0.1
    inputs16 = [t.to(torch.bfloat16 if not dry_run else torch.float32) for t in (q, k, v, g, beta)]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.long,
                      device=device)
    ours = [t.detach().clone().requires_grad_(True) for t in inputs16 + [h0]]
    out, final = common.chunk_gated_delta_rule(*ours[:5], initial_state=ours[5],
                                               output_final_state=True, cu_seqlens=cu)
    w_out, w_final = torch.randn_like(out.float()), torch.randn_like(final.float())
    ((out.float() * w_out).sum() + (final.float() * w_final).sum()).backward()
    ref = [t.detach().float().clone().requires_grad_(True) for t in inputs16 + [h0]]
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o, f = gdn.torch_chunk_gated_delta_rule(*(t[:, a:b] for t in ref[:5]),
                                                   initial_state=ref[5][i:i + 1],
                                                   output_final_state=True)
        outs.append(o)
        finals.append(f)
    ref_out, ref_final = torch.cat(outs, 1), torch.cat(finals)
    ((ref_out * w_out).sum() + (ref_final * w_final).sum()).backward()
    errors = dict(out=_rel(out, ref_out), final_state=_rel(final, ref_final))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ours, ref):
        errors[name] = _rel(a.grad, b.grad)
    return dict(ok=max(errors.values()) <= KERNEL_TOL, tol=KERNEL_TOL, lengths=list(lengths),
                errors=errors, kernel=getattr(common.chunk_gated_delta_rule, "__module__", "?"))



def bf16_steps(model16, model32, work: dict, vocab_size: int):
    """An fp32 dense reference step (model32), a bf16 dense and a bf16 reuse step (model16, the
    same weights) on one batch: (losses, gradient errors against the reference, whether bf16
    reuse is as close as bf16 dense: <= 1.5 x its error, losses within 2e-2). Shared by phases
    6 and 7 (tools/gpu_check_mamba.py)."""
    from megatron_patches.training import dense_step, max_relative_diff, param_grads, reuse_step
    from megatron_patches.training import zero_grads
    from prefix_schedule.losses import PolicyLossConfig
    from prefix_schedule.planning.planner import plan_microbatches

    batch = make_batch(**work, vocab_size=vocab_size, seed=5)
    plan = plan_microbatches(batch, token_budget=work["group_size"] * work["suffix_len"],
                             max_seq_len=work["prefix_len"] + work["suffix_len"])
    loss = PolicyLossConfig(**LOSS_KW)
    results, grads = {}, {}
    for name, model, fn in (
            ("reference_fp32_dense", model32, lambda: dense_step(model32, batch, loss)),
            ("dense_bf16", model16, lambda: dense_step(model16, batch, loss)),
            ("reuse_bf16", model16, lambda: reuse_step(model16, batch, plan, loss))):
        zero_grads(model)
        results[name] = fn().loss
        grads[name] = param_grads(model)
        zero_grads(model)
    ref = grads["reference_fp32_dense"]
    errors = {name: max_relative_diff(ref, grads[name]) for name in ("dense_bf16", "reuse_bf16")}
    ok = (0 < errors["dense_bf16"] < 0.2 and errors["reuse_bf16"] <= 1.5 * errors["dense_bf16"]
          and abs(results["reuse_bf16"] - results["dense_bf16"])
          <= 2e-2 * max(1.0, abs(results["dense_bf16"])))
    return results, errors, ok



def e2e_steps(build_models, work: dict, *, dry_run: bool):
    """Phases 6 and 7's end-to-end part: install the reuse hooks, a one-process Megatron, the
    attention backend; `build_models(dry_run, max_seq_len)` -> (bf16 model, fp32 model, shape,
    settings); then bf16_steps. Returns (losses, errors, ok, shape, settings)."""
    import megatron_patches
    from megatron_patches.models.tiny import initialize_single_process
    from prefix_schedule.attention.backends import set_default_backend

    megatron_patches.install()
    private_rendezvous()
    initialize_single_process(seed=1234)
    set_default_backend("torch" if dry_run else "transformer_engine")
    model16, model32, shape, settings = build_models(dry_run,
                                                     work["prefix_len"] + work["suffix_len"])
    return (*bf16_steps(model16, model32, work, shape["vocab_size"]), shape, settings)


def _models(dry_run: bool, max_seq_len: int):
    """(bf16 model on the fla path, fp32 deterministic-mode reference with the same weights)."""
    from megatron_patches.models.gdn import GDN_TINY_SHAPE, build_gdn_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    shape, gdn = (DRY_SHAPE, GDN_TINY_SHAPE) if dry_run else (GPU_SHAPE, GPU_GDN)
    common = dict(linear_attention_freq=4, attention_output_gate=True, rotary_percent=0.5, **gdn)
    cfg16 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len, params_dtype=torch.bfloat16)
    cfg32 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len)
    model16 = build_gdn_model(cfg16, seed=3, **common)
    model32 = build_gdn_model(cfg32, seed=4, deterministic_mode=True, **common)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    for model in (model16, model32):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model16, model32, shape, common


def run(device, *, dry_run: bool) -> dict:
    import megatron_patches

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    from megatron.core.ssm.gated_delta_net import common

    if not common.HAVE_FLA:
        return {"skipped": "flash-linear-attention (fla) is not installed: Megatron's "
                           "GatedDeltaNet needs it on a GPU"}
    kernel = check_kernel(device, dry_run=dry_run)
    work = DRY_WORK if dry_run else GPU_WORK
    results, errors, steps_ok, shape, settings = e2e_steps(_models, work, dry_run=dry_run)
    ok = kernel["ok"] and steps_ok
    return dict(claim="Gated DeltaNet (Qwen3-Next layout, linear_attention_freq=4), fla varlen "
                      "rule with per-sequence initial states: kernel vs torch rule, and bf16 "
                      "dense vs bf16 reuse equally close to an fp32 dense reference",
                ok=ok, kernel=kernel, settings={k: str(v) for k, v in settings.items()},
                model=shape, workload=dict(work), grad_rel_err_vs_fp32=errors, losses=results)
