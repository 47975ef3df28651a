"""The model provider of the entry point: Megatron-LM's own GPT builder, with the few config
settings prefix reuse needs.

`model_provider(...)` is Megatron-LM's `model_provider.model_provider(gpt_builders.gpt_builder,
...)` -- the same pair `pretrain_gpt.py` and `train_rl.py` use, imported from the checkout that
provides `megatron.training` -- with the TransformerConfig from `core_transformer_config_from_args`
plus:
* `variable_seq_lengths=True` under pipeline parallelism (RL rows differ in length; stock 1F1B,
  the dense baseline, then exchanges shapes), with `moe_token_dispatcher_type="alltoall"`, which
  Megatron requires beside it;
everything else (`deallocate_pipeline_outputs=True` included: the reuse executor frees sent
outputs as Megatron's 1F1B does) follows the command line; what prefix reuse cannot honour is refused by the
executor before any compute (megatron_patches/config/config_support.py).

Without Transformer Engine (`--transformer-impl local`: the CPU layer) Megatron's torch norms
refuse `--sequence-parallel`; there an MoE model's block spec gets `SequenceParallelTorchNorm`
(megatron_patches/models/tiny.py: the same per-token norm, its weight gradient summed over TP by
`finalize_model_grads`), as the core tests build them. With TE nothing is changed.

Gated DeltaNet hybrids (`--experimental-attention-variant gated_delta_net`: Qwen3-Next, Qwen3.5)
without TE: gpt_builder's `get_transformer_block_with_experimental_attention_variant_spec`
builds only Transformer Engine modules (its local backend has no fused in_proj norm), so while
gpt_builder runs it returns `megatron_patches.models.gdn.gdn_block_spec` instead: the same
per-layer pattern from Megatron's local layer spec, GDN layers being Megatron's own
`GatedDeltaNet` behind the layer's input norm (what TE's fused norm + in_proj computes). With
TE nothing is changed.

HybridModels (`--hybrid-layer-pattern`: Nemotron-H's `M`, `*`, `-` layers): Megatron-LM builds
them with `hybrid_builders.hybrid_builder`, which the core_r0.19.0 tree this entry point runs on
does not ship (its train_rl.py imports it); `hybrid_builder` below is that builder's legacy
(non-recipe) path, read from Megatron-LM main's hybrid_builders.py: the same HybridModel
arguments, the layer spec from `--spec` when given, else Megatron's `hybrid_stack_spec` (TE)
or, without TE, `megatron_patches.models.hybrid.local_hybrid_stack_spec` (the same layers from
Megatron's local modules).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from pathlib import Path

from megatron_patches.config.config_support import is_gdn_variant
from megatron.training import get_args
from megatron.training.arguments import core_transformer_config_from_args

__all__ = ["model_provider", "hybrid_builder", "megatron_lm_root"]


def megatron_lm_root() -> Path:
    """The Megatron-LM checkout that provides `megatron.training` (it holds gpt_builders.py)."""
    import megatron.training

    return Path(megatron.training.__file__).resolve().parents[2]


def _checkout_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
    root = megatron_lm_root()
    if not (root / f"{name}.py").is_file():
        raise ValueError(f"{name}.py is not in {root}: megatron.training must come from a "
                         "Megatron-LM checkout (put the checkout on PYTHONPATH or install it "
                         "with pip install -e)")
    sys.path.append(str(root))
    return importlib.import_module(name)


def reuse_transformer_config(args):
    """Megatron's config from the arguments, with what the RL steps need."""
    config = core_transformer_config_from_args(args)
    if args.pipeline_model_parallel_size > 1:
        config.variable_seq_lengths = True
        config.moe_token_dispatcher_type = "alltoall"
    return config


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    """`get_model`'s model_provider_func: a GPTModel from Megatron-LM's gpt_builder, or a
    HybridModel from `hybrid_builder` for a `--hybrid-layer-pattern`."""
    args = get_args()
    provider = _checkout_module("model_provider").model_provider
    if args.hybrid_layer_pattern is not None:
        return provider(hybrid_builder, pre_process, post_process, vp_stage,
                        config=config or reuse_transformer_config(args),
                        pg_collection=pg_collection)
    builders = _checkout_module("gpt_builders")
    local = args.transformer_impl == "local"
    norms = _sequence_parallel_torch_norms(builders, vp_stage) if (
        local and args.sequence_parallel) else None
    gdn = _local_gdn_block_spec(builders) if (
        local and is_gdn_variant(args.experimental_attention_variant)) else None
    mla = _local_mla_core_attention(builders) if (
        local and args.multi_latent_attention) else None
    with norms or contextlib.nullcontext(), gdn or contextlib.nullcontext(), \
            mla or contextlib.nullcontext():
        return provider(builders.gpt_builder, pre_process, post_process, vp_stage,
                        config=config or reuse_transformer_config(args),
                        pg_collection=pg_collection)


def hybrid_builder(args, pre_process, post_process, vp_stage=None, config=None,
                   pg_collection=None):
    """A HybridModel from the arguments (Megatron-LM main's hybrid_builder without recipes)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.spec_utils import import_module

    config = config or reuse_transformer_config(args)
    if args.spec is not None:
        spec = import_module(args.spec)
    elif args.transformer_impl == "local":
        from megatron_patches.models.hybrid import local_hybrid_stack_spec

        spec = local_hybrid_stack_spec(num_moe_experts=config.num_moe_experts,
                                       mamba="M" in args.hybrid_layer_pattern)
    else:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
    return HybridModel(
        config=config, hybrid_stack_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage,
        hybrid_layer_pattern=args.hybrid_layer_pattern)


GDN_SPEC_FUNCTION = "get_transformer_block_with_experimental_attention_variant_spec"
"""gpt_builder's spec function for GDN hybrids (Transformer Engine only): replaced without TE."""


@contextlib.contextmanager
def _local_gdn_block_spec(builders):
    """While gpt_builder runs: its GDN block spec is megatron_patches.models.gdn's local one."""
    from megatron_patches.models.gdn import gdn_block_spec

    original = getattr(builders, GDN_SPEC_FUNCTION)
    setattr(builders, GDN_SPEC_FUNCTION,
            lambda config, vp_stage=None, **_: gdn_block_spec(config, vp_stage=vp_stage))
    try:
        yield
    finally:
        setattr(builders, GDN_SPEC_FUNCTION, original)


MLA_SPEC_FUNCTIONS = ("get_gpt_decoder_block_spec", "_get_transformer_layer_spec")
"""gpt_builders' spec functions whose MLA layers get the local core attention sized for MLA."""


@contextlib.contextmanager
def _local_mla_core_attention(builders):
    """While gpt_builder runs without TE: MLA layers get `models.mla.MLALocalCoreAttention`
    (Megatron's local DotProductAttention does not take MLA's k_channels / v_channels)."""
    from megatron_patches.models.mla import use_local_mla_core_attention

    def wrap(function):
        def spec(*args, **kwargs):
            result = function(*args, **kwargs)
            use_local_mla_core_attention(result)
            return result
        return spec

    originals = {name: getattr(builders, name) for name in MLA_SPEC_FUNCTIONS}
    for name, function in originals.items():
        setattr(builders, name, wrap(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(builders, name, function)


SPEC_FUNCTIONS = ("get_gpt_decoder_block_spec",)
"""gpt_builders' spec functions whose norms are swapped: an MoE model's block spec (tested:
tests/test_megatron_lm_moe.py). A dense model's layer spec (`_get_transformer_layer_spec`,
also MTP's) is left as is: dense TP with --sequence-parallel on CPU stays refused by Megatron's
torch-norm assert."""


@contextlib.contextmanager
def _sequence_parallel_torch_norms(builders, vp_stage):
    """While gpt_builder runs: its spec functions return specs whose norms allow sequence
    parallelism without TE (`models._sequence_parallel_block_spec`)."""
    from megatron_patches.models.tiny import _sequence_parallel_block_spec

    def wrap(function):
        def spec(*args, **kwargs):
            config = inspect.signature(function).bind(*args, **kwargs).arguments["config"]
            return _sequence_parallel_block_spec(function(*args, **kwargs), config, vp_stage)
        return spec

    originals = {name: getattr(builders, name) for name in SPEC_FUNCTIONS}
    for name, function in originals.items():
        setattr(builders, name, wrap(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(builders, name, function)
