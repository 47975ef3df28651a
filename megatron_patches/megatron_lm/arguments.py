"""Our command-line arguments, added to Megatron-LM's parser through `extra_args_provider`.

The GRPO loss reuses Megatron-LM's own RL arguments where the math is the same:
`--grpo-clamp-eps-lower/upper` (the clipped surrogate), `--grpo-kl-beta` (the k3 KL estimator
exp(r) - r - 1 with r = ref - current, as megatron/rl/rl_utils.py), `--grpo-prompts-per-step`
and `--grpo-group-size` (the synthetic generator's groups). Megatron's
`--grpo-entropy-term-weight` weighs a sampled-token term (-p log p of the taken token); our entropy
bonus is the full-vocabulary entropy, so it has its own flag (`--rl-entropy-coef`) and a nonzero
`--grpo-entropy-term-weight` is refused rather than reinterpreted.
"""

from __future__ import annotations

import argparse

__all__ = ["add_prefix_reuse_args", "check_prefix_reuse_args", "check_output_dirs",
           "ARGS_DEFAULTS"]

OUTPUT_DIRS = ("save", "export_hf", "tensorboard_dir", "prefix_reuse_dump_params")
"""Directories the run writes into later (a checkpoint after N iterations, the export at the
end): each checked by a write before any compute."""

ARGS_DEFAULTS = {"micro_batch_size": 1}
"""Megatron defaults this trainer sets (each row is one microbatch of the prefix-reuse plan)."""


def add_prefix_reuse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`extra_args_provider` for `megatron.training.arguments.parse_and_validate_args`."""
    group = parser.add_argument_group("prefix reuse (megatron-prefix-reuse)")
    group.add_argument("--prefix-reuse", action="store_true",
                       help="run each group's shared prompt once (Phases A/B/C); without it the "
                            "step is stock Megatron dense training on full rows (the baseline)")
    group.add_argument("--prefix-chunk-tokens", type=int, default=None,
                       help="run each cached prefix as chunks of at most this many tokens")
    group.add_argument("--prefix-reuse-token-budget", type=int, default=None,
                       help="tokens per suffix microbatch row (default: --seq-length)")
    group.add_argument("--prefix-reuse-offload-prefix-activations", action="store_true",
                       help="park Phase A's saved activations in pinned host memory until Phase C")
    group.add_argument("--rl-entropy-coef", type=float, default=0.0,
                       help="weight of the full-vocabulary entropy bonus (subtracted from the "
                            "loss)")
    group.add_argument("--rl-trace", default=None, metavar="PATH",
                       help="read RL steps from this trace (default: the synthetic generator)")
    group.add_argument("--rl-trace-format", default=None, metavar="NAME",
                       help="a registered trace reader, or module:callable (default: by the "
                            "file's extension)")
    group.add_argument("--rl-synthetic-prefix-len", type=int, default=None,
                       help="synthetic generator: prompt tokens per group (default: 3/4 of "
                            "--seq-length)")
    group.add_argument("--rl-synthetic-max-response-len", type=int, default=None,
                       help="synthetic generator: longest response (default: the rest of "
                            "--seq-length)")
    group.add_argument("--rl-synthetic-uniform-groups", action="store_true",
                       help="synthetic generator: every group of a step has the same response "
                            "lengths (expert parallelism needs the same plan on every "
                            "expert-parallel rank)")
    group.add_argument("--rl-synthetic-fixed-response-len", action="store_true",
                       help="synthetic generator: every response has exactly "
                            "--rl-synthetic-max-response-len tokens (MoE with tensor parallelism "
                            "needs rows of one length)")
    group.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                       help="start from this Hugging Face checkpoint (Llama 3 / Qwen3 / "
                            "Qwen3.5 / Qwen3-Next / Nemotron-H safetensors: model_configs) when "
                            "no --load checkpoint exists")
    group.add_argument("--export-hf", default=None, metavar="DIR",
                       help="after training, write the weights as a Hugging Face checkpoint "
                            "(needs --hf-checkpoint for the config and the dtype)")
    group.add_argument("--allow-nothing-to-train", action="store_true",
                       help="exit 0 when --load's checkpoint is already at --train-iters (e.g. "
                            "to only --export-hf it); without it such a run is an error")
    group.add_argument("--prefix-reuse-megatron-verbose", action="store_true",
                       help="print all of Megatron's output: its argument dump, INFO logging "
                            "and the warnings known to be harmless here (see "
                            "megatron_patches/megatron_lm/quiet.py)")
    group.add_argument("--prefix-reuse-dump-params", default=None, metavar="DIR",
                       help="testing aid: after every step, each rank saves its parameters "
                            "and the step's gradients (grad.*) (safetensors) under DIR/iter_N/")
    _escape_help_percent(parser)
    return parser


def _escape_help_percent(parser: argparse.ArgumentParser) -> None:
    """`--help` formats each help string with `%`; a Megatron help string with a bare `%` (both
    supported trees have one) makes it raise ValueError. Escape the help strings that do not
    format, so `--help` prints every flag, ours included."""
    for action in parser._actions:
        if not action.help or "%" not in action.help:
            continue
        try:
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")


def check_prefix_reuse_args(args) -> None:
    """Refuse what this trainer cannot honour, before any compute (ValueError says the fix)."""
    if args.num_experts:
        _check_moe_parallel_args(args)
    _check_layer_pattern_args(args)
    if args.grpo_entropy_term_weight:
        raise ValueError("--grpo-entropy-term-weight weighs Megatron's sampled-token entropy term; "
                         "this trainer's entropy bonus is the full-vocabulary entropy: use "
                         "--rl-entropy-coef instead")
    if args.micro_batch_size != 1:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size}: each microbatch is one "
                         "packed row here; use --micro-batch-size 1 and "
                         "--prefix-reuse-token-budget for the row size")
    if not args.calculate_per_token_loss:
        raise ValueError("the GRPO token mean needs --calculate-per-token-loss")
    if args.seq_length is None:
        raise ValueError("give --seq-length: the longest [prompt; response] row")
    for name in ("prefix_chunk_tokens", "prefix_reuse_token_budget", "rl_synthetic_prefix_len",
                 "rl_synthetic_max_response_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: give a positive integer")
    if args.export_hf and not args.hf_checkpoint:
        raise ValueError("--export-hf needs --hf-checkpoint (its config names the layout)")
    if args.train_iters is None:
        raise ValueError("give --train-iters (RL steps; sample-based schedules are not used here)")
    if args.rl_trace:
        from megatron_patches.megatron_lm.data import resolve_trace_reader

        resolve_trace_reader(args.rl_trace, args.rl_trace_format)


def _check_moe_parallel_args(args) -> None:
    """MoE with TP > 1 as prefix reuse equals stock dense (megatron_patches.runtime.moe
    [Note: MoE under sequence parallelism]): sequence parallelism (Megatron's MoELayer raises
    without it while training, after compute has started), expert TP = TP, no expert GTP."""
    tp = args.tensor_model_parallel_size
    if tp > 1 and not args.sequence_parallel:
        raise ValueError(f"MoE (--num-experts) with --tensor-model-parallel-size {tp} needs "
                         "--sequence-parallel (Megatron-LM's MoE layers refuse to train TP > 1 "
                         "without it); add --sequence-parallel")
    etp = args.expert_tensor_parallel_size or tp
    if etp != tp:
        raise ValueError(f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size "
                         f"{tp}: prefix reuse's router accounting is verified with expert TP "
                         f"equal to TP; give --expert-tensor-parallel-size {tp} (or leave it "
                         "unset: Megatron defaults it to TP)")
    if (getattr(args, "expert_gtp_weight_remat_size", 1) or 1) > 1:
        raise ValueError(f"--expert-tensor-parallel-num-weight-shards "
                         f"{args.expert_tensor_parallel_num_weight_shards}: expert GTP (weight "
                         "shards beyond --expert-tensor-parallel-size) is not verified with "
                         "prefix reuse; leave it unset or equal to --expert-tensor-parallel-size")


def _check_layer_pattern_args(args) -> None:
    """The layer pattern builds the model the flags name, and prefix reuse can run it: a
    `--linear-attention-freq` below 1 (Megatron computes `(i + 1) % N`: -1 silently builds an
    all-softmax model, 0 divides by zero while building), an empty `--hybrid-layer-pattern`
    (divides by zero while building), context parallelism with recurrent layers (Gated DeltaNet
    or Mamba: their prefix is a state, which CP would have to split; Megatron's own refusal,
    later, names the attention backend instead)."""
    freq = getattr(args, "linear_attention_freq", None)
    if isinstance(freq, int) and freq < 1:
        raise ValueError(f"--linear-attention-freq {freq}: give N >= 1 (every N-th layer is "
                         "softmax attention, the others Gated DeltaNet; N=1 is all softmax), or "
                         'a list pattern such as "([1]*3+[0]*1)*2"')
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None and not pattern.replace("|", "").replace("/", "").strip():
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has no layers: give one symbol "
                         "per layer (M Mamba, * attention, - MLP, E MoE; '|' between pipeline "
                         "stages), e.g. M-M*M-")
    recurrent = _recurrent_layers(args)
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1 and recurrent and getattr(args, "prefix_reuse", False):
        raise ValueError(f"--context-parallel-size {cp} with {recurrent} layers: prefix reuse "
                         "caches their prefix as a recurrent state, which context parallelism "
                         "would have to split across ranks (not implemented); give "
                         "--context-parallel-size 1")


def _recurrent_layers(args) -> str:
    """"Gated DeltaNet" / "Mamba" when the flags build such layers, else ""."""
    if getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        freq = getattr(args, "linear_attention_freq", None)
        if freq != 1 and not (isinstance(freq, list) and not any(freq)):
            return "Gated DeltaNet"
    pattern = getattr(args, "hybrid_layer_pattern", None) or ""
    return "Mamba" if "M" in pattern.split("/")[0] else ""


def check_output_dirs(args) -> None:
    """ValueError unless every output directory can be written now (a write probe: a read-only
    or full disk, or a file in the way, is refused before iteration 1, not after it)."""
    from megatron_patches.support.outputs import check_output_dir

    for name in OUTPUT_DIRS:
        check_output_dir(getattr(args, name, None), "--" + name.replace("_", "-"))
