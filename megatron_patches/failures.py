"""Moved to megatron_patches.support.failures; this path stays importable (the README or examples show it)."""
import sys

import megatron_patches.support.failures

sys.modules[__name__] = megatron_patches.support.failures
