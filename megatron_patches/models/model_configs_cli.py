"""`python -m megatron_patches.models.model_configs list | megatron-args NAME | hf-config NAME`:
model_configs.py's command line over the registry it passes in (no import back)."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Mapping

__all__ = ["main"]


def main(models: Mapping[str, object], description: str, argv=None) -> int:
    """List `models` (name -> ModelSpec) or print one's Megatron-LM arguments / config.json."""
    parser = argparse.ArgumentParser(prog="python -m megatron_patches.models.model_configs",
                                     description=description)
    parser.add_argument("command", choices=["list", "megatron-args", "hf-config"])
    parser.add_argument("model", nargs="?")
    ns = parser.parse_args(argv)
    if ns.command == "list":
        for name, spec in models.items():
            kinds = " ".join(k for k, on in (("MoE", spec.is_moe), ("GDN", spec.is_gdn),
                                             ("Mamba", spec.is_nemotron_h)) if on)
            print(f"{name:24s} {spec.family:16s} {kinds}".rstrip())
        return 0
    if ns.model not in models:
        what = "needs a model name" if ns.model is None else f"unknown model {ns.model!r}"
        parser.error(f"{ns.command} {what}: choose one of {sorted(models)}")
    spec = models[ns.model]
    if ns.command == "megatron-args":
        print(shlex.join(spec.megatron_args()))
    else:
        print(json.dumps(spec.hf_config(), indent=2))
    return 0
