"""Snapshot the signatures of every upstream Megatron function our patches and executor touch.

    .venv/bin/python tools/snapshot_signatures.py          # write it for the installed version
    .venv/bin/python tools/snapshot_signatures.py --check  # exit 1 and list the differences
    .venv/bin/python tools/snapshot_signatures.py --root /path/to/Megatron-LM [--check]

One snapshot per supported version, in megatron_patches/snapshots/megatron_core_<version>.json,
compared with the live signatures by tests/test_patches.py (installed) and tests/test_versions.py
(the offline checkouts): an upstream change to any of these (megatron-core 0.17 dropped
`backward_step`'s `model_type`, for one) must be a visible, reviewed event. `--root` imports
megatron.core from that directory (a Megatron-LM checkout) instead of the installed one.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from megatron_patches.patching import registry  # noqa: E402  (needs the repo on sys.path first)

__all__ = ["SIGNATURE_TARGETS", "DATACLASS_TARGETS", "CONSTANT_TARGETS", "collect", "compare",
           "snapshot_path", "main"]

SNAPSHOT_DIR = _REPO / "megatron_patches" / "snapshots"
REGENERATE = ".venv/bin/python tools/snapshot_signatures.py"

_ATTENTION = "megatron.core.transformer.attention:Attention"
_GPT = "megatron.core.models.gpt.gpt_model:GPTModel"
_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules:"
_DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
_HYBRID = "megatron.core.models.hybrid."
_PS = "megatron.core.parallel_state:"

SIGNATURE_TARGETS = (
    f"{_ATTENTION}.forward",
    f"{_ATTENTION}._run_core_attention",
    f"{_ATTENTION}._checkpointed_attention_forward",
    f"{_GPT}.forward",
    f"{_GPT}._preprocess",
    f"{_ROPE}.forward",
    f"{_ROPE}.get_emb",
    f"{_SCHEDULES}get_forward_backward_func",
    f"{_SCHEDULES}forward_step",
    f"{_SCHEDULES}backward_step",
    f"{_SCHEDULES}forward_step_calc_loss",
    f"{_SCHEDULES}forward_backward_no_pipelining",
    f"{_SCHEDULES}forward_backward_pipelining_without_interleaving",
    "megatron.core.distributed.finalize_model_grads:finalize_model_grads",
    "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads",
    f"{_DDP}.__init__",
    f"{_DDP}.no_sync",
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec",
    "megatron.core.tensor_parallel:vocab_parallel_cross_entropy",
    "megatron.core.tensor_parallel:reduce_from_tensor_model_parallel_region",
    f"{_SCHEDULES}_build_default_pg_collection",
    "megatron.core.utils:get_attr_wrapped_model",
    "megatron.core.utils:get_model_config",
    "megatron.core.utils:unwrap_model",
    "megatron.core.parallel_state:get_pipeline_model_parallel_prev_rank",
    "megatron.core.parallel_state:get_pipeline_model_parallel_next_rank",
    "megatron.core.parallel_state:get_pipeline_model_parallel_last_rank",
    "megatron.core.parallel_state:initialize_model_parallel",
    # models.py / hybrid.py / layers.py: the models we build and the layer patterns we read
    f"{_GPT}.__init__",
    f"{_HYBRID}hybrid_model:HybridModel.__init__",
    f"{_HYBRID}hybrid_model:HybridModel.forward",
    f"{_HYBRID}hybrid_block:HybridStack.__init__",
    f"{_HYBRID}hybrid_block:HybridStack.forward",
    f"{_HYBRID}hybrid_layer_allocation:parse_hybrid_pattern",
    f"{_HYBRID}hybrid_layer_allocation:select_pipeline_segment",
    "megatron.core.ssm.mlp_layer:MLPLayer.__init__",
    # mamba-state-hook / mamba_hooks.py / mamba_cpu.py: the Mamba mixer and what it calls
    "megatron.core.ssm.mamba_mixer:MambaMixer.__init__",
    "megatron.core.ssm.mamba_mixer:MambaMixer._ssm_training",
    "megatron.core.ssm.mamba_layer:MambaLayer.__init__",
    "megatron.core.transformer.transformer_layer:TransformerLayer.__init__",
    # executor, training, rl: parallel state they read
    f"{_PS}get_pipeline_model_parallel_world_size",
    f"{_PS}get_pipeline_model_parallel_rank",
    f"{_PS}get_pipeline_model_parallel_group",
    f"{_PS}get_virtual_pipeline_model_parallel_world_size",
    f"{_PS}is_pipeline_first_stage",
    f"{_PS}is_pipeline_last_stage",
    f"{_PS}get_tensor_model_parallel_world_size",
    f"{_PS}get_tensor_model_parallel_group",
    "megatron.core.tensor_parallel:model_parallel_cuda_manual_seed",
    # gdn.py / gdn_hooks.py / gdn_cpu.py: the GDN layer, its kernels' Python contract, its specs
    "megatron.core.ssm.gated_delta_net.gdn:GatedDeltaNet.forward",
    "megatron.core.ssm.gated_delta_net.common:_GDNBase.__init__",
    "megatron.core.ssm.gated_delta_net.gdn:torch_chunk_gated_delta_rule",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs:"
    "get_linear_attention_pattern",
    # what cpu_support replaces on CPU
    "megatron.core.transformer.utils:get_default_causal_mask",
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
)
"""Functions as `module:qualname`; P2PCommunicator's methods are added by `_p2p_methods`."""

P2P_COMMUNICATOR = "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator"
DATACLASS_TARGETS = (
    "megatron.core.transformer.transformer_config:TransformerConfig",
    f"{_HYBRID}hybrid_block:HybridStackSubmodules",
    "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
    "megatron.core.ssm.mamba_layer:MambaLayerSubmodules",
    "megatron.core.ssm.mamba_mixer:MambaMixerSubmodules",
)
"""Dataclasses whose field names (in order) are snapshot."""
CONSTANT_TARGETS = (f"{_HYBRID}hybrid_layer_allocation:Symbols",)
"""Classes whose public str constants (name -> value) are snapshot: the layer symbols."""

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _stub_triton_kernels() -> None:
    """`import megatron.core` imports triton for an MoE kernel module; stub it where triton is
    missing (megatron_patches.support.cpu_support installs the same stub; whichever runs first wins)."""
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH in sys.modules:
        return
    stub = types.ModuleType(_PAGED_STASH)

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(f"{_PAGED_STASH} needs triton, which is not installed")

    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _unavailable
    sys.modules[_PAGED_STASH] = stub


def _needs_triton(target: str):
    """NEEDS_TRITON when the target's module cannot be imported without triton (Megatron-LM
    main's Mamba mixer imports Triton kernel modules at import time), else None."""
    try:
        importlib.import_module(target.partition(":")[0])
    except ModuleNotFoundError as error:
        if error.name == "triton" and importlib.util.find_spec("triton") is None:
            return NEEDS_TRITON
        raise
    return None


NEEDS_TRITON = "<not importable without triton>"


def _resolve(target: str):
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def _p2p_methods() -> list[str]:
    cls = _resolve(P2P_COMMUNICATOR)
    names = ["__init__"] + sorted(
        name for name, value in vars(cls).items()
        if inspect.isfunction(value) and not name.startswith("_")
    )
    return [f"{P2P_COMMUNICATOR}.{name}" for name in names]


def collect() -> dict:
    """Live signatures and dataclass fields of the installed megatron-core (imports it)."""
    _stub_triton_kernels()
    signatures = {
        name: _needs_triton(name) or str(inspect.signature(_resolve(name)))
        for name in SIGNATURE_TARGETS + tuple(_p2p_methods())
    }
    fields = {
        name: _needs_triton(name) or [field.name for field in dataclasses.fields(_resolve(name))]
        for name in DATACLASS_TARGETS
    }
    constants = {
        name: {k: v for k, v in sorted(vars(_resolve(name)).items())
               if not k.startswith("_") and isinstance(v, str)}
        for name in CONSTANT_TARGETS
    }
    version = registry.imported_version()
    assert version == registry.megatron_version(registry.default_root())
    return {"megatron_core_version": version, "signatures": signatures, "dataclass_fields": fields,
            "constants": constants}


def snapshot_path(version: str) -> Path:
    """Where the snapshot for one megatron-core version lives."""
    return SNAPSHOT_DIR / f"megatron_core_{version}.json"


def compare(expected: dict, live: dict) -> list[str]:
    """Human-readable differences between a stored snapshot and the live one ([] if equal)."""
    problems = []
    for section in ("signatures", "dataclass_fields", "constants"):
        old, new = expected.get(section, {}), live.get(section, {})
        for name in sorted(old.keys() | new.keys()):
            if name not in new:
                problems.append(f"{name}: in the snapshot, no longer snapshot")
            elif name not in old:
                problems.append(f"{name}: not in the snapshot (new target or new method)")
            elif old[name] != new[name]:
                problems.append(
                    f"{name} changed:\n    snapshot: {old[name]}\n    live:     {new[name]}"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the snapshot; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--root", type=Path, default=None,
                        help="import megatron.core from this directory (contains megatron/)")
    args = parser.parse_args(argv)
    if args.root is not None:
        registry.megatron_version(args.root)  # a clear error if it holds no megatron-core
        sys.path.insert(0, str(args.root.resolve()))
    live = collect()
    path = snapshot_path(live["megatron_core_version"])
    if args.check:
        if not path.is_file():
            print(f"no snapshot {path}; create it with `{REGENERATE}`", file=sys.stderr)
            return 1
        problems = compare(json.loads(path.read_text(encoding="utf-8")), live)
        print("\n".join(problems) or f"{path.name}: all signatures match")
        return 1 if problems else 0
    SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(live, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(live['signatures'])} signatures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
