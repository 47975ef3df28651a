"""Test tiers: plan/attention/data tests need no Megatron; `megatron_env` sets up real Megatron
on CPU (gloo, one process) with the prefix-reuse hooks installed; `gpu` tests skip without CUDA.

The CPU/gloo layer is opt-in (megatron_patches/support/cpu_support.py): the test session turns it on
here, before any test imports megatron.core (a no-op where CUDA is available)."""

import os

import pytest
import torch
from hypothesis import settings

import megatron_patches

megatron_patches.enable_cpu_support()

# CI must not depend on the draw: the "ci" profile (default) replays the same examples every run;
# HYPOTHESIS_PROFILE=explore draws fresh ones (run it locally to hunt for new counterexamples).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def megatron_env():
    """Megatron parallel state (TP=PP=1, gloo) and the reuse hooks, once per session."""
    import megatron_patches
    from megatron_patches.models.tiny import initialize_single_process

    megatron_patches.install()
    initialize_single_process(seed=1234)
    yield


@pytest.fixture(autouse=True)
def _fresh_moe_metrics_tracker():
    """Megatron's MoE metrics tracker is a process global sized by the first MoE model's layer
    count: a later model with more layers indexes past it (IndexError in record()). Each test
    starts without one (no-op where megatron was never imported)."""
    yield
    import sys

    logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if logging is not None and hasattr(logging, "destroy_moe_metrics_tracker"):
        logging.destroy_moe_metrics_tracker()


def pytest_terminal_summary(terminalreporter):
    """One line for every test skipped without the Megatron-LM checkouts (tests/megatron_trees.py)."""
    from megatron_trees import skip_summary

    line = skip_summary(terminalreporter.stats.get("skipped", []))
    if line:
        terminalreporter.write_line(line, yellow=True)
