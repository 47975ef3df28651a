"""`python -m megatron_patches.models.model_configs list | megatron-args NAME | hf-config NAME`
(model_configs.py's command line)."""

from __future__ import annotations

import argparse
import json
import shlex

from megatron_patches.models import model_configs

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_patches.models.model_configs",
                                     description=model_configs.__doc__.splitlines()[0])
    parser.add_argument("command", choices=["list", "megatron-args", "hf-config"])
    parser.add_argument("model", nargs="?")
    ns = parser.parse_args(argv)
    models = model_configs.MODELS
    if ns.command == "list":
        for name, spec in models.items():
            kinds = " ".join(k for k, on in (("MoE", spec.is_moe), ("GDN", spec.is_gdn),
                                             ("Mamba", spec.is_nemotron_h)) if on)
            print(f"{name:24s} {spec.family:16s} {kinds}".rstrip())
        return 0
    if ns.model is None:
        parser.error(f"{ns.command} needs a model name: one of {sorted(models)}")
    spec = model_configs.get_model_spec(ns.model)
    if ns.command == "megatron-args":
        print(shlex.join(spec.megatron_args()))
    else:
        print(json.dumps(spec.hf_config(), indent=2))
    return 0
