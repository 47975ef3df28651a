"""slime's real package for tests/test_fw_slime.py: unpacked from its offline tarball, imported
with the stubs named below, driven without Ray on a CPU Megatron model.

Source: `slime-*.tar.gz` (THUDM/slime 624b824, shared/frameworks/README.md), looked for in
`$PREFIX_REUSE_FRAMEWORK_TARBALLS` (only there when set), else `shared/frameworks/` beside the checkout or above it;
extracted once per process into a temporary directory. Missing: skip, or FAIL under
PREFIX_REUSE_REQUIRE_FRAMEWORKS=1 (make test-frameworks).

Stubs (each replaces only what needs CUDA, Ray's cluster or an inference engine, or an
irrelevant heavy import):
* `wandb` (slime/observability/logging_utils.py imports it at top; `--use-wandb` stays off);
* `sglang.srt.server_args.ServerArgs`, `sglang_router.launch_router.RouterArgs`: the inference
  engine's CLI arguments that slime's parser adds (no engine runs in a training step);
* a `cpu` accelerator backend registered through slime's `register_accelerator` (its built-in
  backends are CUDA and MUSA);
* `ThdCoreAttention`: Transformer Engine's THD (packed, cu_seqlens) attention, which slime's
  dense forward uses and which needs CUDA: per packed segment, causal torch SDPA. It serves
  only slime's dense step; reuse steps run the reuse attention hook.
For the actor (`slime_actor`): torch_memory_saver (CUDA memory offload) and SGLang engine
internals imported by actor.py; the actor object made without its __init__ (Ray placement
group, NCCL, checkpoint loading), its SGLang weight updater's metrics empty; the test makes
`ray.get` the identity (the rollout arrives as a Ray object reference).
Everything else is slime's code: its argument parser (with Megatron's), `compute_advantages_and_
returns`, `DataIterator`, `get_batch`, `train_one_step`, `train`, `loss_function`; the model is a
megatron-core GPTModel in Megatron's DDP with Megatron's optimizer (SGD) and slime's scheduler.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
REQUIRE = os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1"
STUBBED_MODULES = ("wandb", "sglang", "sglang.srt", "sglang.srt.server_args", "sglang_router",
                   "sglang_router.launch_router")
_ROOTS: dict = {}


def missing(reason: str):
    """Skip, or fail under PREFIX_REUSE_REQUIRE_FRAMEWORKS=1."""
    if REQUIRE:
        pytest.fail(f"{reason} (PREFIX_REUSE_REQUIRE_FRAMEWORKS=1)")
    pytest.skip(reason)


def find_framework_tarball(prefix: str) -> Path:
    env = os.environ.get("PREFIX_REUSE_FRAMEWORK_TARBALLS")
    dirs = [Path(env)] if env else [p / "shared" / "frameworks" for p in [REPO, *REPO.parents]]
    for d in dirs:
        found = sorted(d.glob(f"{prefix}-*.tar.gz")) if d.is_dir() else []
        if found:
            return found[-1]
    missing(f"no {prefix}-*.tar.gz in {[str(d) for d in dirs[:3]]} ...")


def unpacked(prefix: str, package_dir: str) -> Path:
    """The tarball's top folder holding `package_dir`, extracted once per process."""
    if prefix not in _ROOTS:
        tarball = find_framework_tarball(prefix)
        dest = Path(tempfile.mkdtemp(prefix=f"prefix-reuse-{prefix}-"))
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
        roots = [p.parent.parent for p in dest.glob(f"*/{package_dir}/__init__.py")]
        if not roots:
            missing(f"{tarball} holds no {package_dir}/ package")
        _ROOTS[prefix] = roots[0]
    return _ROOTS[prefix]


class _NoCliArgs:
    @staticmethod
    def add_cli_args(parser, *args, **kwargs):
        return parser


def import_slime():
    """slime on sys.path with the named stubs; Megatron's CPU support on."""
    import megatron_patches
    from megatron_patches.megatron_lm.compat import enable_megatron_lm_cpu_support
    megatron_patches.enable_cpu_support()
    enable_megatron_lm_cpu_support()
    root = unpacked("slime", "slime")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in STUBBED_MODULES:
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules["sglang.srt.server_args"].ServerArgs = _NoCliArgs
    sys.modules["sglang_router.launch_router"].RouterArgs = _NoCliArgs
    try:
        _register_cpu_accelerator()
        import slime.backends.megatron_utils.model as model_module
        import slime.utils.arguments  # noqa: F401  (slime_args)
    except ModuleNotFoundError as error:  # a venv without slime's deps (make test-frameworks has them)
        missing(f"slime imports {error.name!r}: run in .venv-frameworks (make test-frameworks)")
    assert str(root) in model_module.__file__
    return model_module


def _register_cpu_accelerator() -> None:
    """A CPU backend through slime's own plug-in registry (`register_accelerator`, 'without
    changing Slime core'): slime's built-in backends are CUDA and MUSA only."""
    from slime.utils import accelerator
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    class CpuAccelerator(TorchAccelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def _module(self):
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def device_name(self, index=None) -> str:
            return "cpu"

        def current_device(self) -> str:
            return "cpu"

        def set_device(self, index) -> None:
            return None

        def empty_cache(self) -> None:
            return None

    accelerator.register_accelerator("cpu", CpuAccelerator, lambda: True, priority=-1,
                                     communication_backends=("gloo",))
    accelerator.reset_accelerator()


def slime_args(*argv: str):
    """slime's argument namespace as its launcher builds it: Megatron's parser with slime's
    extra-args provider, plus `--prefix-reuse` through slime's `add_custom_arguments` hook;
    then set as Megatron's global args (slime's train_one_step reads get_args())."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from slime.utils.arguments import _pre_parse_mode, get_slime_extra_args_provider
    from megatron_patches.frameworks.slime import add_prefix_reuse_arguments
    saved = sys.argv
    sys.argv = ["train.py", "--rollout-batch-size", "4", "--optimizer", "sgd", "--lr", "0.5",
                "--min-lr", "0.5", "--num-rollout", "1", "--global-batch-size", "12",
                "--no-check-for-nan-in-loss-and-grad", "--clip-grad", "0",
                # the model slime_model builds (framework_data.SMALL), as a launch passes it
                "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
                "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
                "2", "--kv-channels", "16", "--swiglu", "--seq-length", "256", *argv]
    try:
        args = parse_args(extra_args_provider=get_slime_extra_args_provider(
            add_prefix_reuse_arguments), ignore_unknown_args=False)
        for key, value in vars(_pre_parse_mode()).items():  # as slime's parse_args merges them
            setattr(args, key, value)
    finally:
        sys.argv = saved
    args.n_samples_per_prompt = 4
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if isinstance(getattr(args, name, None), str):  # Megatron's validate_args does this
            setattr(args, name, dtypes[getattr(args, name)])
    args.start_weight_decay = args.end_weight_decay = args.weight_decay  # validate_args too
    if args.eps_clip_high is None:  # slime_validate_args (which needs a full launch) does this
        args.eps_clip_high = args.eps_clip
    args.use_critic = args.advantage_estimator == "ppo"  # slime_validate_args too
    args.vocab_size = args.padded_vocab_size = 256  # Megatron's tokenizer setup (SMALL's vocab)
    args.load = "unused"  # no checkpoint: the model is built here
    global_vars._GLOBAL_ARGS = args
    return args


class ThdCoreAttention(torch.nn.Module):
    """Stand-in for Transformer Engine's THD attention (CUDA): causal SDPA per packed segment."""

    def __init__(self, softmax_scale: float) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("ThdCoreAttention runs slime's packed (THD) batches only")
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # [h, s, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=k.shape[0] != q.shape[0])
            outs.append(o.transpose(0, 1))
        out = torch.cat(outs)
        return out.reshape(out.shape[0], -1)


def slime_model(seed: int = 1234):
    """A megatron-core GPTModel (fp32, local spec) with THD attention, in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from framework_data import SMALL
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    gpt = build_model(TinyLlamaConfig(**SMALL), seed=seed)
    for layer in gpt.decoder.layers:
        layer.self_attention.core_attention = ThdCoreAttention(gpt.config.kv_channels ** -0.5)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    return [ddp]


def slime_optimizer(args, model):
    """Megatron's optimizer as slime's setup_model_and_optimizer builds it, and slime's scheduler."""
    import dataclasses
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig)
              if hasattr(args, f.name)}
    config = OptimizerConfig(**kwargs)
    config.timers = None
    optimizer = get_megatron_optimizer(config=config, model_chunks=model)
    return optimizer, get_optimizer_param_scheduler(args, optimizer)


def record_grads(optimizer, model, into: list):
    """Copy every parameter's main_grad just before each optimizer.step (slime releases the
    grads after the step)."""
    real_step = optimizer.step

    def step(*a, **kw):
        into.append({n: p.main_grad.detach().clone() for n, p in model[0].named_parameters()})
        return real_step(*a, **kw)
    optimizer.step = step


ACTOR_STUBS = ("torch_memory_saver", "sglang.srt.patch_torch", "sglang.srt.utils",
               "sglang.srt.model_executor", "sglang.srt.model_executor.model_runner")
"""What slime's actor module imports beyond model.py: torch_memory_saver (CUDA memory
offload) and SGLang's engine internals (weight sync). Stubbed: inert classes."""


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


def slime_actor(args, model, optimizer, scheduler):
    """slime's MegatronTrainRayActor without Ray: the object made without its __init__ (which
    joins a Ray placement group, initialises NCCL and loads a checkpoint), with the fields
    __init__ would set: the model / optimizer / scheduler built here, slime's TensorBackuper in its
    single-tag form (the copying form pins memory: CUDA), slime's TrainProfiler, and a weight
    updater whose metrics are empty (SGLang weight sync: stubbed)."""
    for name in ACTOR_STUBS:
        if name not in sys.modules:
            module = _InertModule(name)
            module.__path__ = []
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = module
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.observability.profile_utils import TrainProfiler
    from slime.utils.tensor_backper import TensorBackuper
    actor = object.__new__(MegatronTrainRayActor)
    actor.args, actor.model, actor.role = args, model, "actor"
    actor.optimizer, actor.opt_param_scheduler = optimizer, scheduler
    actor.weights_backuper = TensorBackuper.create(
        source_getter=lambda: model[0].named_parameters(), single_tag="actor")
    actor._active_model_tag = "actor"
    actor.weights_backuper.backup("actor")
    actor.rollout_data_postprocess = None
    actor.prof = TrainProfiler(args)
    actor.weight_updater = types.SimpleNamespace(pop_metrics=lambda: {})
    from slime.observability.timer import Timer
    try:
        Timer().start("train_wait")  # what __init__'s with_defer does on return
    except AssertionError:  # started by an earlier actor's train (slime's Timer is global)
        pass
    return actor
