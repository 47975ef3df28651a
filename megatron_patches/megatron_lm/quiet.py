"""A readable console for the Megatron-LM entry point: without `--prefix-reuse-megatron-verbose`,
Megatron's argument dump (~800 lines) becomes one line, its logging level defaults to WARNING
(Megatron's own `--logging-level` / `$MEGATRON_LOGGING_LEVEL` still win), and the warnings
listed in `HARMLESS` -- each known not to matter for this entry point, the reason beside it --
are not printed. Megatron's iteration, checkpoint and start-up lines are untouched. With the flag,
nothing here runs: Megatron prints what it always prints.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Sequence, Tuple

__all__ = ["VERBOSE_FLAG", "HARMLESS", "verbose_requested", "quiet_megatron", "quiet_defaults",
           "shorten_argument_dump", "warning_level", "without_one_logger", "checkpoint_lines"]

VERBOSE_FLAG = "--prefix-reuse-megatron-verbose"

HARMLESS: Tuple[Tuple[str, str], ...] = (
    # (start of the message, why it does not matter here)
    ("Transformer Engine and Apex are not installed",
     "the CPU run uses torch's optimizers and kernels on purpose (local spec)"),
    ("Apex is not installed. Falling back to Torch Norm", "the local spec's norms are torch's"),
    ("Only transformer-engine>=1.7.0 supports MoE experts",
     "printed at import by the TE spec provider, which the CPU run does not use"),
    ("CPU RNG state changed within GPU RNG context",
     "on CPU the CUDA RNG tracker is the CPU generator (megatron_patches/support/cpu_support.py)"),
    ("GPTModel IS DEPRECATED", "the entry point builds Megatron-LM's own gpt_builder model"),
    ("MimoModelConfig is experimental", "an import-time notice of a module this run does not use"),
    ("MCore's async save is deprecated", "the run saves synchronously"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated",
     "torch's notice about a call inside Megatron's checkpoint code"),
    ("Please use DTensor instead and we are deprecating ShardedTensor",
     "torch's notice about Megatron's torch_dist checkpoint format"),
    ("The argument order of load has been changed", "torch's notice about Megatron's call"),
    ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load",
     "Megatron reads checkpoint metadata on each rank by itself, on purpose"),
    ("RerunStateMachine initialized in mode", "a notice of Megatron's default mode"),
    ("Result validation enabled", "a notice of Megatron's default mode"),
)
"""Messages not printed without the verbose flag (warnings and log records alike)."""

_COMMON_STATE_DIFF = re.compile(r"common state dict differs from rank 0 common state dict\. "
                                r"Keys only on rank 0: (\[.*?\]), Keys only on \d+: (\[.*?\]), "
                                r"Mismatched keys: (\[.*\])", re.S)


def verbose_requested(argv: Sequence[str]) -> bool:
    """True if the command line asks for Megatron's full output (read before Megatron parses
    it: the import-time warnings come first)."""
    return VERBOSE_FLAG in argv


class _HarmlessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(message.startswith(prefix) for prefix, _ in HARMLESS):
            return False
        return not _only_rank_specific_args_differ(message)


def _only_rank_specific_args_differ(message: str) -> bool:
    """Megatron's checkpoint validation compares every rank's common state with rank 0's; it
    holds the parsed `args`, which carry each rank's own `rank` and `local_rank`, so every rank
    > 0 warns on every save (only rank 0's copy is written). Silenced only when nothing is
    missing on either side and the one mismatch is that `args` namespace; any other key shows."""
    found = _COMMON_STATE_DIFF.search(message)
    if not found:
        return False
    only_0, only_here, mismatched = found.groups()
    return only_0 == only_here == "[]" and mismatched.strip() == _ARGS_ONLY


_ARGS_ONLY = "[(('args',), <class 'argparse.Namespace'>, <class 'argparse.Namespace'>)]"


def quiet_defaults() -> dict:
    """Megatron argument defaults of the quiet console: WARNING logging unless
    `$MEGATRON_LOGGING_LEVEL` is set (an explicit `--logging-level` wins over both)."""
    if os.environ.get("MEGATRON_LOGGING_LEVEL") is not None:
        return {}
    return {"logging_level": logging.WARNING}


def warning_level(argv: Sequence[str]) -> None:
    """Root logging level WARNING unless `--logging-level` or `$MEGATRON_LOGGING_LEVEL` asks
    otherwise (Megatron applies those at initialisation). Call again after importing
    `megatron.training.training`: its import-time basicConfig sets INFO."""
    if os.environ.get("MEGATRON_LOGGING_LEVEL") is None and not any(
            a.startswith("--logging-level") for a in argv):
        logging.getLogger().setLevel(logging.WARNING)


def quiet_megatron(argv: Sequence[str]) -> None:
    """Leave out the `HARMLESS` warnings and log records (call before importing Megatron: some
    are import-time warnings). Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    for prefix, _ in HARMLESS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    warning_level(argv)
    harmless, call_handlers = _HarmlessFilter(), logging.Logger.callHandlers

    def _call_handlers(self, record):  # every logger, every handler (Megatron's added later)
        if harmless.filter(record):
            call_handlers(self, record)

    logging.Logger.callHandlers = _call_handlers
    _INSTALLED = True


_INSTALLED = False


def shorten_argument_dump() -> None:
    """Replace `megatron.training.arguments._print_args` (called by `validate_args`) with a one-
    line summary; call after `megatron.training.arguments` is importable."""
    from megatron.training import arguments

    def _print_args(title, args):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"> Megatron-LM {title}: {len(vars(args))} values (print them with "
                  f"{VERBOSE_FLAG})", flush=True)

    arguments._print_args = _print_args


def without_one_logger(argv: Sequence[str]) -> list:
    """`argv` plus `--no-one-logger` when the one_logger package is not installed and no one-logger
    flag is given: Megatron otherwise prints a warning with a link to NVIDIA's internal wiki."""
    import importlib.util

    if any(a.startswith("--one-logger") or a == "--no-one-logger" for a in argv) or (
            importlib.util.find_spec("one_logger") is not None):
        return list(argv)
    return [*argv, "--no-one-logger"]


_NO_CHECKPOINT = "    will not load any checkpoints and will start from random"


def checkpoint_lines(hf_checkpoint) -> None:
    """With `--hf-checkpoint`, Megatron's "will start from random" (no checkpoint in --load yet)
    is misleading: the weights come from the HF checkpoint next. Say that instead."""
    if not hf_checkpoint:
        return
    from megatron.training import checkpointing

    print_rank_0 = checkpointing.print_rank_0

    def _print(message, *args, **kwargs):
        if message == _NO_CHECKPOINT:
            message = (f"    no checkpoint to resume from: the weights are loaded from the Hugging "
                       f"Face checkpoint {hf_checkpoint}")
        return print_rank_0(message, *args, **kwargs)

    checkpointing.print_rank_0 = _print
