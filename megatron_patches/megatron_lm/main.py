"""`main()` of the Megatron-LM entry point (examples/megatron_lm/train_grpo.py)."""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib.util
import os
import sys
import traceback

import torch

from megatron_patches.megatron_lm import compat

__all__ = ["main", "CPU_ARGUMENT_CHANGES", "path_with_this_python"]

CPU_ARGUMENT_CHANGES = {
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "no_persist_layer_norm": True,
}
"""Without CUDA, arguments whose value needs CUDA (NCCL, Transformer Engine, fused kernels) are
changed to the CPU equivalent, each announced on rank 0; with CUDA nothing is changed."""


def _cpu_arguments(args) -> None:
    for name, value in CPU_ARGUMENT_CHANGES.items():
        if getattr(args, name) != value:
            if args.rank == 0:
                print(f"> no CUDA: {name} {getattr(args, name)!r} -> {value!r}", flush=True)
            setattr(args, name, value)


def _check_hf_checkpoint(args) -> dict:
    """The checkpoint's config.json; ValueError unless the arguments build exactly its model."""
    from megatron_patches.models.hf_checkpoints import read_hf_config
    from megatron_patches.models.model_configs import check_trainable, mismatches_with_args

    spec, config = read_hf_config(args.hf_checkpoint)
    check_trainable(spec)
    problems = mismatches_with_args(spec, args)
    if args.padded_vocab_size != spec.vocab_size:
        problems.append(f"Megatron pads the vocabulary {args.vocab_size} to "
                        f"{args.padded_vocab_size}, the checkpoint has {spec.vocab_size} (padded "
                        "logits would enter the softmax): give --vocab-size "
                        f"{spec.vocab_size} --make-vocab-size-divisible-by 1")
    if problems:
        raise ValueError(f"the arguments do not build the model of {args.hf_checkpoint} (print "
                         "matching ones with python -m megatron_patches.models.model_configs): "
                         + "; ".join(problems))
    return config


def _check_cpu_arguments(args) -> None:
    """What cannot run without CUDA, refused before any compute."""
    if args.clip_grad and args.clip_grad > 0:
        raise ValueError(f"--clip-grad {args.clip_grad} (Megatron's default is 1.0): Megatron's "
                         "gradient clipping asserts CUDA tensors (clip_grads.py), so on a machine "
                         "without CUDA it fails after the first step's compute; give --clip-grad 0")


def path_with_this_python(path: str) -> str:
    """`path` with this interpreter's directory first, when that directory's `python3` is this
    interpreter (a venv's bin/); else `path` unchanged."""
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    python3 = os.path.join(bindir, "python3")
    if os.path.exists(python3) and os.path.samefile(python3, sys.executable):
        return bindir + os.pathsep + path
    return path


def _python_first_on_path() -> None:
    """Megatron's rank 0 compiles its C++ dataset helpers with `make`, whose Makefile asks
    `python3 -m pybind11 --includes`: the first `python3` on PATH, not this interpreter. Without
    this Python's bin directory on PATH (a venv not activated) that is another Python, usually
    without pybind11: the compile fails and every other rank dies in Megatron's barrier
    ("Connection closed by peer"). So this interpreter goes first on PATH; and if pybind11 itself
    is missing, the error says so before anything starts."""
    from megatron.core import datasets

    helpers = os.path.dirname(datasets.__file__)
    if glob.glob(os.path.join(helpers, "helpers_cpp*.so")):
        return  # already built: make has nothing to do
    os.environ["PATH"] = path_with_this_python(os.environ.get("PATH", ""))
    if importlib.util.find_spec("pybind11") is None:
        raise ValueError(f"Megatron compiles its C++ dataset helpers ({helpers}) with pybind11, "
                         f"which {sys.executable} lacks: pip install pybind11==3.1.0 (make setup "
                         "installs it), or build them once yourself: make -C " + helpers)


def _refuse(error: ValueError) -> int:
    """Bad arguments (every rank parses the same command line, so every rank refuses it): one
    clear line from rank 0, no traceback per rank; exit status 2. Under torchrun the other ranks
    wait (up to `_REFUSAL_WAIT_S`) until rank 0 has printed it: torchrun stops every rank as soon
    as one exits, which would otherwise cut rank 0 off before its line."""
    rank = int(os.environ.get("RANK", "0"))
    store = _job_store()
    if rank == 0:
        print(f"train_grpo.py: error: {error}", file=sys.stderr, flush=True)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's own report of the exit follows
            print("train_grpo.py: (torchrun now reports the ranks' exit status 2 as a "
                  "ChildFailedError with its own traceback: the error is the line above)",
                  file=sys.stderr, flush=True)
        if store is not None:
            store.set(_REFUSED_KEY, "1")
    elif store is not None:
        with contextlib.suppress(Exception):  # rank 0 gone or never coming: exit anyway
            store.wait([_REFUSED_KEY], datetime.timedelta(seconds=_REFUSAL_WAIT_S))
    return 2


_REFUSED_KEY = "prefix_reuse/arguments_refused"
_REFUSAL_WAIT_S = 60.0


def _job_store():
    """A client of torchrun's store (its agent hosts it), or None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    try:
        return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                          is_master=False,
                                          timeout=datetime.timedelta(seconds=_REFUSAL_WAIT_S))
    except Exception:  # noqa: BLE001 -- without a store every rank just exits
        return None


def _megatron_assertion(error: AssertionError) -> str:
    """A failed assert of Megatron's argument validation as one line: its message, or its
    source line (most have no message), and where it is."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    what = str(error) or (f"`{frame.line}`" if frame.line else "an assert without a message")
    return (f"Megatron-LM refused the arguments: {what} ({os.path.basename(frame.filename)}:"
            f"{frame.lineno}); fix the flag it names")


def _parse_and_check(on_cpu: bool, verbose: bool):
    """Megatron's argument parsing plus our checks, all before any process group exists; returns
    (args, the HF config or None, the RL step source)."""
    from megatron.training import get_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_patches.megatron_lm import arguments, data, quiet, stalls

    defaults = dict(arguments.ARGS_DEFAULTS)
    if not verbose:
        quiet.shorten_argument_dump()
        defaults.update(quiet.quiet_defaults())
    try:
        parse_and_validate_args(extra_args_provider=arguments.add_prefix_reuse_args,
                                args_defaults=defaults)
    except AssertionError as error:  # Megatron validates its arguments with bare asserts
        raise ValueError(_megatron_assertion(error)) from None
    args = get_args()
    arguments.check_prefix_reuse_args(args)
    arguments.check_output_dirs(args)
    timeout_from = stalls.apply_collective_timeout(args, sys.argv[1:])
    if args.rank == 0:
        print(f"> collective timeout: {args.distributed_timeout_minutes * 60:g} s ({timeout_from}); "
              "a rank waiting that long for a peer ends the job, naming the peer", flush=True)
    hf_config = _check_hf_checkpoint(args) if args.hf_checkpoint else None
    if on_cpu:
        _check_cpu_arguments(args)
        _cpu_arguments(args)
    source = data.open_step_source(args)
    _python_first_on_path()
    return args, hf_config, source


def _run(args, hf_config, source, on_cpu: bool, verbose: bool) -> int:
    """Megatron's start-up, the model, the training loop and the export; the exit status."""
    import megatron_patches
    from megatron.core.enums import ModelType
    from megatron.training import print_rank_0
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    from megatron_patches.models import hf_checkpoints
    from megatron_patches.megatron_lm import model, trainer

    initialize_megatron(allow_no_cuda=on_cpu)
    if not verbose:
        from megatron_patches.megatron_lm import quiet

        quiet.checkpoint_lines(args.hf_checkpoint)
    megatron_patches.install()
    chunks, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                             model.model_provider)
    if args.hf_checkpoint and args.iteration == 0:  # a --load checkpoint wins over it
        for chunk in chunks:
            hf_checkpoints.load_hf_weights(chunk, args.hf_checkpoint)
        optimizer.reload_model_params()
        print_rank_0(f"> loaded weights from the Hugging Face checkpoint {args.hf_checkpoint}")
        for kind, names in hf_checkpoints.untrained_tensors(args.hf_checkpoint).items():
            print_rank_0(f"> not trained: {len(names)} tensors {kind} of the checkpoint "
                         "(--export-hf writes them back unchanged)")
    status = 0
    if trainer.nothing_to_train(args):  # says so, loudly
        status = 0 if args.allow_nothing_to_train else 1
    else:
        trainer.train(chunks, optimizer, scheduler, source)
    if args.export_hf and status == 0:
        hf_checkpoints.export_hf_weights(chunks, args.export_hf, hf_config,
                                         source=args.hf_checkpoint)
        print_rank_0(f"> wrote the Hugging Face checkpoint {args.export_hf}")
    torch.distributed.barrier()
    return status


def main() -> int:
    from megatron_patches.megatron_lm import quiet

    verbose = quiet.verbose_requested(sys.argv[1:])
    if not verbose:
        quiet.quiet_megatron(sys.argv[1:])  # before Megatron imports: import-time warnings
        sys.argv[1:] = quiet.without_one_logger(sys.argv[1:])
    compat.enable_python311_support()
    on_cpu = compat.enable_megatron_lm_cpu_support()

    from megatron_patches.megatron_lm import stalls

    if not verbose:
        quiet.warning_level(sys.argv[1:])
    try:
        args, hf_config, source = _parse_and_check(on_cpu, verbose)
    except ValueError as error:
        return _refuse(error)
    with stalls.failure_report(args):  # a stalled or failed rank is named, within the timeout
        status = _run(args, hf_config, source, on_cpu, verbose)
    # Tear the process groups down while the interpreter is alive: left to interpreter exit,
    # gloo's worker threads can abort the process (SIGABRT, "terminate called without an active
    # exception") after a run that succeeded -- seen on a run that trained nothing.
    torch.distributed.destroy_process_group()
    return status
