"""Megatron-LM's production settings for the tests, from Megatron-LM's own argument parser.

The megatron-core 0.19.2 wheel also ships `megatron/training` (Megatron-LM's training package;
its sources equal those in the offline tarball Megatron-LM-core_r0.19.0.tar.gz), but it does not
import on Python 3.11: it uses `typing.override` (3.12). A test-only shim sets `typing.override`
to the identity and answers 9 (Hopper) to the device-arch query of `validate_args`; then
`production_settings(...)` runs Megatron-LM's `parse_and_validate_args` on a command line and
builds the configs with Megatron-LM's own builders: `core_transformer_config_from_args`
(training/argument_utils.py, which sets deallocate_pipeline_outputs=True at line 305),
`get_megatron_ddp_config` and `get_megatron_optimizer_config` (training/training.py:1962-2014).
Where `megatron.training` is missing, `MIRRORED` holds the values those produce (cited), and
`ProductionSettings.source` says which was used.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from typing import List, Sequence

import torch

__all__ = ["ProductionSettings", "production_settings", "command_line", "MIRRORED"]

# What the parser + builders give for the flags below (core_r0.19.0):
MIRRORED = dict(
    deallocate_pipeline_outputs=True,   # training/argument_utils.py:305
    batch_p2p_comm=True,                # argument_utils.py:307 (overlap_p2p_comm is forced False
                                        # without virtual stages: training/arguments.py:977)
    variable_seq_lengths=False,         # training/arguments.py:1232 (RL rows: set True below)
    overlap_grad_reduce=True,           # --overlap-grad-reduce (arguments.py:2968)
    use_distributed_optimizer=True,     # --use-distributed-optimizer (arguments.py:2997)
    overlap_param_gather=True,          # --overlap-param-gather (arguments.py:2989)
    align_grad_reduce=True,             # training/config/common_config.py:80 -> grad_sync_func
    check_for_nan_in_grad=True,         # --check-for-nan-in-loss-and-grad default
)


@dataclasses.dataclass
class ProductionSettings:
    transformer_config: object
    """TransformerConfig (variable_seq_lengths on: RL rows differ in length)."""
    ddp_config: object
    optimizer_config: object
    align_grad_reduce: bool
    align_param_gather: bool
    source: str
    """'megatron-lm parser' or 'mirrored'."""
    raw: dict
    """The MIRRORED keys as the parser / builders gave them (before variable_seq_lengths)."""


def _import_megatron_training():
    """Megatron-LM's parser and builders, or None where megatron.training is not installed."""
    import importlib.util

    import megatron.core  # noqa: F401

    if importlib.util.find_spec("megatron.training") is None:
        return None
    if not hasattr(typing, "override"):  # Python 3.11
        typing.override = lambda func: func
    from megatron.training import arguments, argument_utils, training

    arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU (Hopper)
    return arguments, argument_utils, training


def command_line(*, tp: int, pp: int, dp: int, sequence_parallel: bool, model: dict,
                 seq_length: int, extra: Sequence[str] = ()) -> List[str]:
    """Flags of a production run of the tiny model (fp32, so gradients compare at 1e-5);
    `extra` flags go last (e.g. `--hybrid-layer-pattern`: a HybridModel)."""
    argv = [
        "--num-layers", model["num_layers"], "--hidden-size", model["hidden_size"],
        "--ffn-hidden-size", model["ffn_hidden_size"],
        "--num-attention-heads", model["num_attention_heads"],
        "--group-query-attention", "--num-query-groups", model["num_query_groups"],
        "--vocab-size", model["vocab_size"], "--tokenizer-type", "NullTokenizer",
        "--seq-length", seq_length, "--max-position-embeddings", seq_length,
        "--micro-batch-size", 1, "--global-batch-size", dp,
        "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--hidden-dropout", 0, "--attention-dropout", 0, "--calculate-per-token-loss",
        "--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
        "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
        "--no-persist-layer-norm",  # the local spec's torch norm (Transformer Engine would use it)
        "--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather",
        "--ddp-bucket-size", 40000,  # several buckets per stage (the chained param gathers)
        # The distributed optimizer supports Adam only (distrib_optimizer.py:691). eps=1, far
        # above |g|, makes each update linear in the gradient (Adam ~ SGD with momentum), so a
        # gradient entry at float-noise level cannot get an O(lr) update of noise sign in dense
        # or reuse training (see test_parallel_matrix.py) and weights compare at 1e-5.
        "--optimizer", "adam", "--adam-eps", 1.0, "--lr", 0.1, "--min-lr", 0.1,
        "--weight-decay", 0, "--clip-grad", 0, "--train-iters", 2,
    ]
    if sequence_parallel:
        argv.append("--sequence-parallel")
    return [str(a) for a in [*argv, *extra]]


def production_settings(**kwargs) -> ProductionSettings:
    """Parse `command_line(**kwargs)` with Megatron-LM's parser (needs RANK / WORLD_SIZE);
    without megatron.training, the MIRRORED values."""
    modules = _import_megatron_training()
    if modules is None:
        return _mirrored(**kwargs)
    arguments, argument_utils, training = modules
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *command_line(**kwargs)]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        args = arguments.parse_and_validate_args()
    finally:
        sys.argv = saved
    config = argument_utils.core_transformer_config_from_args(args)
    ddp_config = training.get_megatron_ddp_config(args)
    raw = {key: getattr(config, key, getattr(ddp_config, key, getattr(args, key, None)))
           for key in MIRRORED}
    # RL rows differ in length: the dense reference's pipeline needs variable_seq_lengths
    # (Megatron-LM leaves it to the data loader: arguments.py:1226-1232); it requires alltoall.
    config = dataclasses.replace(config, variable_seq_lengths=True,
                                 moe_token_dispatcher_type="alltoall")
    optimizer_config, _ = training.get_megatron_optimizer_config(args)
    return ProductionSettings(
        transformer_config=config, ddp_config=ddp_config, optimizer_config=optimizer_config,
        align_grad_reduce=args.align_grad_reduce, align_param_gather=args.align_param_gather,
        source="megatron-lm parser", raw=raw)


def _mirrored(*, tp: int, pp: int, dp: int, sequence_parallel: bool, model: dict,
              seq_length: int, extra: Sequence[str] = ()) -> ProductionSettings:
    if extra:
        raise ValueError(f"extra flags {list(extra)} need Megatron-LM's parser "
                         "(megatron.training is not installed)")
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config

    cfg = TinyLlamaConfig(**model, max_seq_len=seq_length)
    config = make_transformer_config(
        cfg, sequence_parallel=sequence_parallel, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall", batch_p2p_comm=MIRRORED["batch_p2p_comm"],
        deallocate_pipeline_outputs=MIRRORED["deallocate_pipeline_outputs"])
    ddp = DistributedDataParallelConfig(bucket_size=40000, **{k: MIRRORED[k] for k in (
        "overlap_grad_reduce", "use_distributed_optimizer", "overlap_param_gather",
        "check_for_nan_in_grad")})
    optimizer = OptimizerConfig(optimizer="adam", adam_eps=1.0, lr=0.1, min_lr=0.1,
                                weight_decay=0.0, clip_grad=0.0, params_dtype=torch.float32,
                                use_distributed_optimizer=True)
    return ProductionSettings(transformer_config=config, ddp_config=ddp, optimizer_config=optimizer,
                              align_grad_reduce=MIRRORED["align_grad_reduce"],
                              align_param_gather=False, source="mirrored", raw=dict(MIRRORED))
