"""`main()` of the Megatron-LM entry point (examples/megatron_lm/train_grpo.py)."""

from __future__ import annotations

import torch

from megatron_patches.megatron_lm import compat

__all__ = ["main", "CPU_ARGUMENT_CHANGES"]

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
    from megatron_patches.hf_checkpoints import read_hf_config
    from megatron_patches.model_configs import check_trainable, mismatches_with_args

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
                         "matching ones with python -m megatron_patches.model_configs): "
                         + "; ".join(problems))
    return config


def main() -> int:
    compat.enable_python311_support()
    on_cpu = compat.enable_megatron_lm_cpu_support()

    import megatron_patches
    from megatron.core.enums import ModelType
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    from megatron_patches import hf_checkpoints
    from megatron_patches.megatron_lm import arguments, data, model, trainer

    parse_and_validate_args(extra_args_provider=arguments.add_prefix_reuse_args,
                            args_defaults=arguments.ARGS_DEFAULTS)
    args = get_args()
    arguments.check_prefix_reuse_args(args)
    hf_config = _check_hf_checkpoint(args) if args.hf_checkpoint else None
    if on_cpu:
        _cpu_arguments(args)
    initialize_megatron(allow_no_cuda=on_cpu)
    megatron_patches.install()
    source = data.open_step_source(args)
    chunks, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder,
                                                             model.model_provider)
    if args.hf_checkpoint and args.iteration == 0:  # a --load checkpoint wins over it
        for chunk in chunks:
            hf_checkpoints.load_hf_weights(chunk, args.hf_checkpoint)
        optimizer.reload_model_params()
        print_rank_0(f"> loaded weights from the Hugging Face checkpoint {args.hf_checkpoint}")
    trainer.train(chunks, optimizer, scheduler, source)
    if args.export_hf:
        hf_checkpoints.export_hf_weights(chunks, args.export_hf, hf_config)
        print_rank_0(f"> wrote the Hugging Face checkpoint {args.export_hf}")
    torch.distributed.barrier()
    return 0
