"""Moved to megatron_patches.runtime.agreement; this path stays importable (the README or examples show it)."""
import sys

import megatron_patches.runtime.agreement

sys.modules[__name__] = megatron_patches.runtime.agreement
