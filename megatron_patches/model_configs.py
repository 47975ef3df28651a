"""Moved to megatron_patches.models.model_configs; this path stays importable (the README or examples show it).

`python -m megatron_patches.model_configs ...` (the old CLI path) runs the moved module's CLI."""
import sys

if __name__ == "__main__":
    import runpy

    print("note: megatron_patches.model_configs moved to megatron_patches.models.model_configs; "
          "running it", file=sys.stderr)
    runpy.run_module("megatron_patches.models.model_configs", run_name="__main__", alter_sys=True)
else:
    import megatron_patches.models.model_configs

    sys.modules[__name__] = megatron_patches.models.model_configs
