"""tools/gpu_check.py, context parallelism: can Transformer Engine's own CP attention serve a
reuse row? Asks the installed TE's backend filter (`get_attention_backend`, the function
DotProductAttention itself calls) with the attention a reuse suffix row needs -- THD, suffix
queries over [prefix ; suffix] keys under a bottom-right causal mask, s_q != s_kv -- for every
`cp_comm_type`, plus a positive control (square padding_causal THD, which TE's CP does run).

TE's source (dot_product_attention/utils.py, "Filter: Context parallelism", TE 1.x-2.x) disables
FlashAttention and FusedAttention under CP for any `*bottom_right` mask and for causal masks with
s_q != s_kv, whatever `cp_comm_type`, and UnfusedDotProductAttention for CP at all. The reuse path
therefore never calls TE's CP attention (docs/DESIGN.md "Context parallelism"): it gathers K/V
itself and runs TE's non-CP kernels. This check proves that premise on the installed TE; if a
future TE enables a backend here, the claim fails and the design should be revisited.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["CP_COMM_TYPES", "te_cp_filter"]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _load():
    """(AttentionParams, get_attention_backend) of the installed TE; ImportError if absent."""
    try:  # TE >= 2.0
        from transformer_engine.pytorch.attention.dot_product_attention.utils import (
            AttentionParams, get_attention_backend)
    except ImportError:  # TE 1.x
        from transformer_engine.pytorch.attention import AttentionParams, get_attention_backend
    return AttentionParams, get_attention_backend


def _backends(params_cls, select, **values) -> dict:
    names = {f.name for f in dataclasses.fields(params_cls)}
    chosen = select(params_cls(**{k: v for k, v in values.items() if k in names}))
    flash, fused, unfused = (bool(x) for x in chosen[-1])  # available_backends
    return dict(flash=flash, fused=fused, unfused=unfused)


def te_cp_filter(device: torch.device, heads=(32, 8), head_dim=128, prefix=4096,
                 suffix=512) -> dict:
    """{"rows": [...], "ok": bool, "claim": str} or {"skipped": reason}."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device (dry run)"}
    try:
        params_cls, select = _load()
    except ImportError as e:
        return {"skipped": f"transformer_engine not importable ({e})"}
    common = dict(qkv_type=torch.Tensor, qkv_dtype=torch.bfloat16, qkv_layout="thd_thd_thd",
                  batch_size=16, num_heads=heads[0], num_gqa_groups=heads[1],
                  head_dim_qk=head_dim, head_dim_v=head_dim, context_parallel=True,
                  is_training=True)
    cases = {"reuse row (padding_causal_bottom_right, s_q != s_kv)":
             dict(attn_mask_type="padding_causal_bottom_right", max_seqlen_q=suffix,
                  max_seqlen_kv=prefix + suffix),
             "reuse row as top-left causal (padding_causal, s_q != s_kv)":
             dict(attn_mask_type="padding_causal", max_seqlen_q=suffix,
                  max_seqlen_kv=prefix + suffix),
             "control: square padding_causal (s_q == s_kv)":
             dict(attn_mask_type="padding_causal", max_seqlen_q=suffix, max_seqlen_kv=suffix)}
    rows = []
    for comm in CP_COMM_TYPES:
        for name, case in cases.items():
            row = dict(cp_comm_type=comm, case=name)
            try:
                row.update(_backends(params_cls, select, cp_comm_type=comm, **common, **case))
            except Exception as e:  # noqa: BLE001 -- report it
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    reuse = [r for r in rows if not r["case"].startswith("control")]
    control = [r for r in rows if r["case"].startswith("control")]
    refused = all("error" not in r and not (r["flash"] or r["fused"] or r["unfused"])
                  for r in reuse)
    control_ok = any("error" not in r and (r["flash"] or r["fused"]) for r in control)
    return {"rows": rows, "ok": refused and control_ok,
            "claim": "Transformer Engine's own CP attention disables every backend for a reuse "
                     f"row (THD, bottom-right causal, s_q != s_kv) under each cp_comm_type "
                     f"{list(CP_COMM_TYPES)}, while it runs the square control: the reuse path's "
                     "own CP attention on TE's non-CP kernels is needed"}
