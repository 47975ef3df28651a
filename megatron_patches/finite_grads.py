"""Moved to megatron_patches.runtime.finite_grads; this path stays importable (the README or examples show it)."""
import sys

import megatron_patches.runtime.finite_grads

sys.modules[__name__] = megatron_patches.runtime.finite_grads
