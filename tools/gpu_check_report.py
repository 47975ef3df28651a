"""What a tools/gpu_check.py run proves: its claims (proved / failed / not run, with the reason),
the phases that did not run, the exit status, and the library versions it ran with."""

from __future__ import annotations

import torch

__all__ = ["library_versions", "claims", "not_run", "exit_status"]


def library_versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for module, attr in (("transformer_engine", "__version__"), ("flash_attn", "__version__"),
                         ("megatron.core", "__version__")):
        try:
            out[module] = str(getattr(__import__(module, fromlist=["_"]), attr))
        except Exception as e:  # noqa: BLE001 -- absent or broken: say which
            out[module] = f"unavailable ({type(e).__name__})"
    if torch.backends.cudnn.is_available():
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def claims(report, checked_backends, backends, dry_run: bool) -> list[dict]:
    """What this run proves, per claim: proved / failed / not run (reason); `backends`: the
    attention backends this run was to check (the GPU ones; the CPU dry run's); `dry_run`: a CPU run."""
    rows = report["correctness"]
    out = []
    for name in backends:
        mine = [r for r in rows if r["backend"] == name]
        what = (f"{name}: two_part and copy match the float64 oracle (out, dq, dk, dv, prefix gK/gV) "
                f"in {', '.join(report['sizes']['dtypes'])} on {len(report['sizes']['layouts'])} "
                "layouts (GQA, empty prefix slot, 1-token suffixes"
                + ("" if dry_run else ", > 1024 query rows") + "), with the installed version's "
                "call signatures")
        status = ("not run: " + report["availability"][name] if name not in checked_backends
                  else "proved" if all(r["ok"] for r in mine) else "failed")
        out.append(dict(claim=what, status=status))
    cp_rows = report["cp_correctness"]
    out.append(dict(claim="context parallelism: every CP rank's zigzag pieces (CP "
                    f"{sorted({r['cp'] for r in cp_rows})}) on "
                    f"{sorted({r['backend'] for r in cp_rows})} match the float64 oracle",
                    status="proved" if cp_rows and all(r["ok"] for r in cp_rows)
                    else "failed" if cp_rows else "not run: no backend available"))
    te_cp = report["te_cp_filter"]
    out.append(dict(claim=te_cp.get("claim", "Transformer Engine's CP attention backend filter"),
                    status=f"not run: {te_cp['skipped']}" if "skipped" in te_cp
                    else "proved" if te_cp["ok"] else "failed"))
    timing = report["timing"]
    out.append(dict(claim="attention fwd+bwd time (synchronized) and peak memory per backend x mode",
                    status="proved" if timing and all(t["ok"] for t in timing)
                    else "failed" if timing else "not run"))
    for key, label in (("e2e", "end-to-end step"), ("moe_e2e", "MoE end-to-end step"),
                       ("predict_device", "predictor microbenchmark"),
                       ("gdn_e2e", "Gated DeltaNet kernel and end-to-end step"),
                       ("mamba_e2e", "Mamba-2 kernels and end-to-end step")):
        e2e = report.get(key)
        if e2e is None or "skipped" in (e2e or {}):
            out.append(dict(claim=label, status=f"not run: {(e2e or {}).get('skipped')}"))
        else:
            out.append(dict(claim=e2e["claim"], status="proved" if e2e["ok"] else "failed"))
    return out


def not_run(report) -> list[str]:
    """The claims of requested phases that did not run (--skip-e2e ones were not requested)."""
    return [c["claim"] for c in report["claims"]
            if c["status"].startswith("not run") and "--skip-e2e" not in c["status"]]


def exit_status(report, allow_partial: bool) -> int:
    """1 on a failure; 4 when a requested phase did not run, unless `allow_partial`; else 0."""
    if report["failures"]:
        return 1
    return 4 if report["not_run"] and not allow_partial else 0
