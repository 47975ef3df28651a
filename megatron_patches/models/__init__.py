"""Model builders (tiny Llama, HybridModel), the paper's configs, checkpoints.

`from megatron_patches.models import build_model` (the README's path) hands out models/tiny.py's names, imported on first use."""
import importlib


def __getattr__(name: str):
    if name.startswith('__') or name == 'tiny':  # the import machinery's questions
        raise AttributeError(name)
    return getattr(importlib.import_module(__name__ + '.tiny'), name)
