"""Moved to megatron_patches.models.model_configs; this path stays importable (the README or examples show it)."""
import sys

import megatron_patches.models.model_configs

sys.modules[__name__] = megatron_patches.models.model_configs
