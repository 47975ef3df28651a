"""`tools/gpu_check.py --quick`: the GPU check that fits one short call on a bare GPU machine
(PyTorch only, no Transformer Engine / flash-attn / mamba-ssm; the kit of docs/GPU.md installs
megatron-core and fla). Four phases, one JSON:

a. attention: the `torch_cuda` backend (PyTorch's own varlen flash attention) against the float64
   oracle in bf16 and fp16 -- out, dq, dk, dv, prefix gK/gV -- two-part and copy mode, packed
   groups with GQA (32/8 heads, head_dim 128), an empty prefix slot, only 1-token suffixes; its
   time and allocator peak (prefix 8192, 8 suffixes x 1024); the op schemas this PyTorch has.
b. end to end: a Qwen3-8B-shaped slice (hidden 4096, 32/8 heads, head_dim 128, ffn 12288,
   4 layers, vocab 32768, bf16; Megatron's local spec with PyTorch's fused SDPA as dense core
   attention: the same flash kernel family as torch_cuda) -- one dense and one reuse step at
   prefix/suffix 8192/1024, 10240/2048 and 2048/10240 with G = 8: each against an fp32 dense
   reference of the same weights (K/V heads expanded so fp32 SDPA keeps O(L) memory), reuse no
   farther than 1.5 x bf16 dense, losses within 2e-2; dense/reuse time (CUDA events, median) and
   peak allocated memory per phase (torch.cuda.max_memory_allocated).
c. Qwen3.5 layout (Gated DeltaNet 3:1, fla's kernels): tools/gpu_check_gdn.py's kernel check
   (varlen rule with per-sequence initial states vs the torch rule, incl. dh0) and a bf16 dense
   vs reuse step against an fp32 deterministic-mode reference, with dense/reuse time.
d. the predictor's microbenchmark (tools/predict_bench.py): `predict_device`, a device file for
   `tools/predict.py --device-file`.
A phase that cannot run (a library missing, the time budget used up) is listed in `not_run` and
makes the exit status 4 unless --allow-partial; a failed claim exits 1. `--dry-run` runs every
phase on CPU at tiny sizes with the CPU stand-ins (tests/test_gpu_quick.py runs it).
"""
from __future__ import annotations

import dataclasses
import json
import time
import traceback

import torch

QWEN_SLICE = dict(num_layers=4, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                  num_query_groups=8, vocab_size=32768)
DRY_SLICE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256)
SHARES = {"8k/1k": (8192, 1024), "10k/2k": (10240, 2048), "2k/10k": (2048, 10240)}
DRY_SHARES = {"8k/1k": (48, 8), "10k/2k": (40, 10), "2k/10k": (8, 40)}
GROUP_SIZE, DRY_GROUP_SIZE = 8, 3
LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)


def attention_sizes(full, dry_run: bool):
    if dry_run:
        return dataclasses.replace(full.DRY, backends=("torch",))
    layouts = {k: full.GPU.layouts[k] for k in ("3groups", "empty_slot", "len1_only")}
    return dataclasses.replace(full.GPU, backends=("torch_cuda",), layouts=layouts,
                               timing=(8192, 8, 1024))


def phase_attention(device, dry_run: bool, full) -> dict:
    """`full`: tools/gpu_check.py's module (its sizes, check_correctness, time_attention; passed
    in by its main, which imports this module: no import circle)."""
    from prefix_schedule.attention.backends import availability

    check_correctness, time_attention = full.check_correctness, full.time_attention
    sizes = attention_sizes(full, dry_run)
    name = sizes.backends[0]
    why = availability(device, getattr(torch, sizes.dtypes[0]), sizes.head_dim)[name]
    schemas = [str(op.default._schema) for op in (torch.ops.aten._flash_attention_forward,
                                                   torch.ops.aten._flash_attention_backward)]
    if not why:
        return {"skipped": f"{name}: {why.reason}", "torch_flash_schemas": schemas}
    rows = check_correctness(device, sizes, [name])
    timing = [time_attention(name, mode, device, sizes, repeats=3, warmup=1)
              for mode in ("two_part", "copy")]
    return dict(claim=f"{name} attention (two-part and copy) == float64 oracle in "
                      f"{'/'.join(sizes.dtypes)}: out, dq, dk, dv, prefix gK/gV",
                ok=all(r["ok"] for r in rows), backend=name, correctness=rows, timing=timing,
                torch_flash_schemas=schemas)


def _expand_kv_heads(model) -> None:
    """fp32 reference: repeat K/V heads before SDPA (GQA in fp32 has no O(L)-memory kernel)."""
    for module in model.modules():
        if type(module).__name__ == "FusedSDPACoreAttention":
            forward = module.forward

            def expanded(query, key, value, *args, _forward=forward, **kwargs):
                rep = query.shape[2] // key.shape[2]
                return _forward(query, key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2),
                                *args, **kwargs)

            module.forward = expanded


def _slice_models(device, dry_run: bool, max_seq_len: int):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    shape = DRY_SLICE if dry_run else QWEN_SLICE
    cfg16 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len, params_dtype=torch.bfloat16)
    cfg32 = TinyLlamaConfig(**shape, max_seq_len=max_seq_len)
    init = dict(use_cpu_initialization=device.type != "cuda")  # 1B parameters: init on the GPU
    model16 = build_model(cfg16, fused_attention=True, seed=3, **init).to(device)
    model32 = build_model(cfg32, fused_attention=True, seed=4, **init).to(device)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()
                             if torch.is_tensor(v) and v.is_floating_point()}, strict=False)
    _expand_kv_heads(model32)
    for model in (model16, model32):
        model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model16, model32, shape


def _compare(phases, grads) -> dict:
    from megatron_patches.training import max_relative_diff

    ref = grads["reference_fp32_dense"]
    errors = {n: max_relative_diff(ref, grads[n]) for n in ("dense_bf16", "reuse_bf16")}
    losses = {row["phase"]: row["loss"] for row in phases}
    ms = {row["phase"]: row["ms"] for row in phases}
    ok = (0 < errors["dense_bf16"] < 0.2 and errors["reuse_bf16"] <= 1.5 * errors["dense_bf16"]
          and abs(losses["reuse_bf16"] - losses["dense_bf16"]) <= 2e-2 * max(1.0, abs(losses["dense_bf16"])))
    return dict(ok=ok, grad_rel_err_vs_fp32=errors, losses=losses,
                speedup_dense_over_reuse=ms["dense_bf16"] / ms["reuse_bf16"], phases=phases)


def _steps(device, model16, model32, batch, plan, warmup: int, repeats: int) -> dict:
    from benchlib.steps import dense_step, reuse_step
    from gpu_check_e2e import _phase
    from prefix_schedule.losses import PolicyLossConfig

    loss = PolicyLossConfig(**LOSS_KW)
    phases, grads = [], {}
    for name, model, fn, (w, r) in (
            ("reference_fp32_dense", model32, lambda: dense_step(model32, batch, loss), (0, 1)),
            ("dense_bf16", model16, lambda: dense_step(model16, batch, loss), (warmup, repeats)),
            ("reuse_bf16", model16, lambda: reuse_step(model16, batch, plan, loss), (warmup, repeats))):
        row, grads[name] = _phase(name, model, fn, device, w, r)
        phases.append(row)
    return _compare(phases, grads)


def _repeats(dry_run: bool) -> tuple[int, int]:
    """(warm-up, timed) steps per bf16 phase: (1, 2) on a GPU; the dry run only checks
    that everything runs (its CPU times mean nothing)."""
    return (0, 1) if dry_run else (1, 2)


def _setup(backend: str) -> None:
    import megatron_patches
    from benchlib.steps import private_rendezvous
    from megatron_patches.models.tiny import initialize_single_process
    from prefix_schedule.attention.backends import set_default_backend

    megatron_patches.enable_cpu_support()  # the CPU/gloo layer (a no-op with CUDA)
    megatron_patches.install()
    private_rendezvous()
    if not torch.distributed.is_initialized():
        initialize_single_process(seed=1234)
    set_default_backend(backend)


def phase_slice(device, dry_run: bool, deadline: float) -> dict:
    from benchlib.workload import make_batch
    from prefix_schedule.planning.planner import plan_microbatches

    backend = "torch" if dry_run else "torch_cuda"
    _setup(backend)
    shares, group = (DRY_SHARES, DRY_GROUP_SIZE) if dry_run else (SHARES, GROUP_SIZE)
    longest = max(p + s for p, s in shares.values())
    model16, model32, shape = _slice_models(device, dry_run, longest)
    rows, skipped = {}, []
    for name, (prefix, suffix) in shares.items():
        if time.monotonic() > deadline:
            skipped.append(name)
            continue
        batch = make_batch(prefix_len=prefix, suffix_len=suffix, group_size=group, num_groups=1,
                           vocab_size=shape["vocab_size"], seed=5)
        plan = plan_microbatches(batch, token_budget=2 * suffix, max_seq_len=prefix + suffix)
        rows[name] = dict(prefix=prefix, suffix=suffix, group_size=group,
                          suffix_microbatches=len(plan.microbatches),
                          **_steps(device, model16, model32, batch, plan, *_repeats(dry_run)))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    result = dict(claim="Qwen3-8B-shaped slice (4 layers, bf16), dense vs prefix reuse at each share: "
                        "reuse no farther from an fp32 reference than 1.5 x bf16 dense, losses agree; "
                        "speedup and peak allocated memory per phase",
                  ok=all(r["ok"] for r in rows.values()), model=shape, reuse_attention_backend=backend,
                  dense_core_attention="FusedSDPACoreAttention (torch SDPA, flash kernel on CUDA bf16)",
                  shares=rows)
    if skipped:
        result["skipped"] = f"time budget used up before shares {skipped}"
    return result


def phase_gdn(device, dry_run: bool) -> dict:
    import megatron_patches

    megatron_patches.enable_cpu_support()
    from megatron.core.ssm.gated_delta_net import common

    if not common.HAVE_FLA:
        return {"skipped": "flash-linear-attention (fla) is not installed (the kit installs fla-core)"}
    import gpu_check_gdn
    from benchlib.workload import make_batch
    from prefix_schedule.planning.planner import plan_microbatches

    kernel = gpu_check_gdn.check_kernel(device, dry_run=dry_run)
    _setup("torch" if dry_run else "torch_cuda")
    work = gpu_check_gdn.DRY_WORK if dry_run else gpu_check_gdn.GPU_WORK
    model16, model32, shape, settings = gpu_check_gdn._models(
        dry_run, work["prefix_len"] + work["suffix_len"])
    model16, model32 = model16.to(device), model32.to(device)
    batch = make_batch(**work, vocab_size=shape["vocab_size"], seed=5)
    plan = plan_microbatches(batch, token_budget=work["group_size"] * work["suffix_len"],
                             max_seq_len=work["prefix_len"] + work["suffix_len"])
    steps = _steps(device, model16, model32, batch, plan, *_repeats(dry_run))
    steps_ok = steps.pop("ok")
    return dict(claim="Qwen3.5 layout (GDN 3:1) on fla's kernels: state passing and gradients vs "
                      "the torch rule; bf16 reuse as close to an fp32 reference as bf16 dense; "
                      "speedup", ok=kernel["ok"] and steps_ok, steps_ok=steps_ok, kernel=kernel,
                model=shape, settings={k: str(v) for k, v in settings.items()},
                workload=dict(work), **steps)


def phase_predict(device, dry_run: bool) -> dict:
    import predict_bench

    result = predict_bench.measure_device(device.type, repeats=1 if dry_run else 3, quick=dry_run)
    return dict(claim="predictor microbenchmark (GEMM / attention curves, bandwidth, per-op cost)",
                ok=True, device=result["device"], raw=result["raw"])


PHASES = (("a_attention", lambda d, dry, deadline, full: phase_attention(d, dry, full)),
          ("b_slice_e2e", lambda d, dry, deadline, full: phase_slice(d, dry, deadline)),
          ("c_gdn", lambda d, dry, deadline, full: phase_gdn(d, dry)),
          ("d_predict", lambda d, dry, deadline, full: phase_predict(d, dry)))


def run(args, device, dry_run: bool, full=None) -> int:
    """`full`: tools/gpu_check.py's module (phase a uses its attention checks)."""
    from gpu_check_report import library_versions

    started = time.monotonic()
    deadline = started + args.budget_s
    report = dict(schema=1, mode="quick-dry-run" if dry_run else "quick", device=(
        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        torch=torch.__version__, libraries=library_versions(), phases={})
    for name, fn in PHASES:
        if time.monotonic() > deadline:
            report["phases"][name] = {"skipped": f"time budget of {args.budget_s:.0f} s used up"}
            continue
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            report["phases"][name] = fn(device, dry_run, deadline, full)
        except Exception:  # noqa: BLE001 -- the other phases still count
            report["phases"][name] = dict(ok=False, error=traceback.format_exc())
        report["phases"][name]["elapsed_s"] = time.monotonic() - started
        _save(args.json, report)
    phases = report["phases"].values()
    report["failed"] = [n for n, p in report["phases"].items() if p.get("ok") is False]
    report["not_run"] = [n for n, p in report["phases"].items() if "skipped" in p]
    report["elapsed_s"] = time.monotonic() - started
    _save(args.json, report)
    for name, phase in report["phases"].items():
        status = "not run: " + phase["skipped"] if "skipped" in phase else (
            "proved" if phase.get("ok") else "FAILED")
        print(f"[{name}] {status}")
    if report["failed"]:
        return 1
    if report["not_run"] and not args.allow_partial:
        print(f"phases that did not run: {report['not_run']} (pass --allow-partial to accept)")
        return 4
    return 0 if all(p.get("ok", True) for p in phases) else 1


def _save(path, report) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
