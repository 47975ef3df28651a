"""ROLL's real package for tests/test_fw_roll.py: unpacked from its offline tarball
(`ROLL-*.tar.gz`, alibaba/ROLL 8eb27cc; found as slime_support finds slime's; `roll/` and
`mcore_adapter/src` put on sys.path), imported with the stubs named below. Missing: skip, or
FAIL under PREFIX_REUSE_REQUIRE_FRAMEWORKS=1.

Stubbed (heavy imports irrelevant to a training step, or what needs Ray's cluster / CUDA):
* modules imported at load and never called in `train_step` (STUBBED: `transfer_queue`, ROLL's
  Ray data-transfer backend; `imageio`; `opentelemetry` with 23 names under it, ROLL's tracing;
  STUBS_USED lists them; they are taken out of sys.modules and the import system again
  once ROLL is imported) -- inert modules;
* the strategy / worker objects are made without their `__init__` / `initialize` (Ray actor,
  HF checkpoint through mcore_adapter, NCCL groups): `roll_actor` sets the attributes
  `initialize` sets (model, its `forward_backward_func = get_forward_backward_func()` bound as
  initialize binds it, seq_length, rank info) on ROLL's own MegatronTrainStrategy;
* the model: `RollGPTStandIn`, a megatron-core GPTModel (TinyLlama, local spec, fp32) in
  Megatron's DDP inside mcore_adapter's own `VirtualModels`, taking ROLL's model call
  (`input_ids`, a [B, S] 2-D `attention_mask` with left-padded prompts, `loss_mask`): the 2-D
  mask becomes causal attention with padding keys masked ([B, 1, S, S]) for the local attention;
  everything else goes to GPTModel.forward as given (`loss_mask` included). mcore_adapter's
  McaGPTModel (built from an HF checkpoint; it inherits GPTModel.forward and hands the mask to
  Transformer Engine) was not run here; its
  `get_batch_on_this_cp_rank` is mcore_adapter's own (CP = 1: the identity);
* the optimizer (`GradRecorder`): `step()` records every main_grad, does not update, returns
  ROLL's (update_successful, grad_norm, num_zeros); `reload_states` / `offload_states` no-ops;
  the LR scheduler's `step` a no-op;
* the pipeline config (RLVRConfig) is built from ROLL's own field defaults without its
  `__post_init__` (model paths, output dirs, Ray resources), then the loss settings are set.
Everything else is ROLL's: `MegatronTrainStrategy.train_step` (its chunking,
`loss_scale = num_microbatches x dp`, `_get_batch_num_tokens` / `_get_global_valid_samples`),
`inner_forward_step` and its `loss_wrapper`, `op_compute_log_probs` / `op_compute_entropy`
(mcore_adapter's `vocab_parallel_logprobs`, ROLL's `vocab_parallel_entropy`), the RLVR
`ActorWorker.loss_func` with `agg_loss`, DataProto.
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types

import torch

from slime_support import missing, unpacked

STUBBED = ("transfer_queue", "imageio")
"""Stubbed when not importable: ROLL's Ray data-transfer backend (transfer_queue) and imageio
(video frames for multimodal data), both imported at load by its strategy / worker modules."""
STUBBED_PREFIXES = ("opentelemetry",)
"""Stubbed with every submodule (ROLL's tracing: ~17 opentelemetry modules at load)."""


class _StubModule(types.ModuleType):
    """An inert module: a lower-case attribute is a submodule (also inert; callable, returns
    None), a capitalised one an inert class (instantiable, subclassable, any arguments)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():
            import importlib
            value = importlib.import_module(f"{self.__name__}.{name}")
        else:
            value = type(name, (), {"__init__": lambda self, *a, **k: None,
                                    "__getattr__": lambda self, n: (lambda *a, **k: None)})
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return None


class _StubFinder:
    """Imports of `opentelemetry.*` (and STUBBED names' submodules) resolve to inert modules."""

    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in STUBBED_PREFIXES or top in _STUBBED_NOW:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


_STUBBED_NOW: set = set()
STUBS_USED: list = []


def import_roll():
    """ROLL's megatron_strategy and RLVR actor_worker modules (module docstring)."""
    import importlib.util
    import megatron_patches
    megatron_patches.enable_cpu_support()
    root = unpacked("ROLL", "roll")
    for p in (root / "mcore_adapter" / "src", root):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    for name in STUBBED:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            _STUBBED_NOW.add(name)
    finder = _StubFinder()
    sys.meta_path.append(finder)
    try:
        from roll.distributed.strategy import megatron_strategy
        from roll.pipeline.rlvr import actor_worker
    except ModuleNotFoundError as error:
        missing(f"ROLL imports {error.name!r}: run in .venv-frameworks (make test-frameworks)")
    finally:  # the stubs serve ROLL's import only: later imports elsewhere see the real world
        sys.meta_path.remove(finder)
        stubbed = sorted(n for n in sys.modules
                         if n.split(".")[0] in (*_STUBBED_NOW, *STUBBED_PREFIXES)
                         and isinstance(sys.modules[n], _StubModule))
        STUBS_USED[:] = sorted(set(STUBS_USED) | set(stubbed))
        for name in stubbed:
            del sys.modules[name]
    assert str(root) in megatron_strategy.__file__
    return megatron_strategy, actor_worker


def stand_in_class():
    from megatron.core.models.gpt import GPTModel
    from mcore_adapter.models.model_factory import PretrainedModel

    class RollGPTStandIn(GPTModel):
        """ROLL's model call on a megatron-core GPTModel (module docstring)."""

        get_batch_on_this_cp_rank = PretrainedModel.get_batch_on_this_cp_rank

        def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None,
                    packed_seq_params=None, loss_mask=None, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 2:
                keys = attention_mask.bool()
                S = keys.shape[1]
                causal = torch.ones(S, S, dtype=torch.bool, device=keys.device).tril()
                allowed = causal[None] & keys[:, None, :]
                attention_mask = ~allowed[:, None]  # Megatron: True = masked out
            return super().forward(input_ids, position_ids, attention_mask, labels=labels,
                                   packed_seq_params=packed_seq_params, loss_mask=loss_mask,
                                   **kwargs)
    return RollGPTStandIn


def roll_models(seed: int = 1234):
    """mcore_adapter's VirtualModels holding [DDP(RollGPTStandIn)] (made without its __init__,
    which builds McaGPTModel from an HF config)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from mcore_adapter.models.model_factory import VirtualModels
    from framework_data import SMALL
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    gpt = build_model(TinyLlamaConfig(**SMALL), seed=seed)
    gpt.__class__ = stand_in_class()
    gpt.config.calculate_per_token_loss = False  # ROLL's regime (2-tuple losses)
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    models = VirtualModels.__new__(VirtualModels)
    models.models, models.config = [ddp], gpt.config
    return models, gpt


class GradRecorder:
    """The optimizer (module docstring)."""

    def __init__(self, model) -> None:
        self.model, self.grads = model, []

    def step(self):
        grads = {n: p.main_grad.detach().clone() for n, p in self.model.named_parameters()}
        self.grads.append(grads)
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        return True, norm, None

    def reload_states(self, *a, **k):
        pass

    def offload_states(self, *a, **k):
        pass

    def zero_grad(self, *a, **k):
        pass


def worker_config(*, prefix_reuse: bool, per_device: int, accumulation: int, **extra):
    """ROLL's WorkerConfig (with the prefix_reuse key) for `actor_train`, megatron_train."""
    from roll.configs.worker_config import StrategyArguments, WorkerConfig
    from roll.configs.training_args import TrainingArguments
    from megatron_patches.frameworks.roll import with_prefix_reuse
    cls = with_prefix_reuse(WorkerConfig)
    return cls(name="actor_train", prefix_reuse=prefix_reuse,
               prefix_reuse_min_shared_len=4,
               training_args=TrainingArguments(per_device_train_batch_size=per_device,
                                               gradient_accumulation_steps=accumulation),
               strategy_args=StrategyArguments(strategy_name="megatron_train",
                                               strategy_config={}), **extra)


def pipeline_config(**loss_settings):
    """RLVRConfig from ROLL's field defaults, without __post_init__ (module docstring)."""
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig
    config = RLVRConfig.__new__(RLVRConfig)
    for f in dataclasses.fields(RLVRConfig):
        if f.default is not dataclasses.MISSING:
            setattr(config, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(config, f.name, f.default_factory())
    config.enable_old_logprobs_recompute = True  # old log-probs come with the batch
    if loss_settings.get("train_infer_correction") == "token-is-weight-and-sequence-filter":
        from roll.configs.base_config import (TrainInferCorrectionConfig, TrainInferFilterConfig,
                                              TrainInferISWeightConfig)
        loss_settings["train_infer_correction"] = TrainInferCorrectionConfig(
            is_weight=TrainInferISWeightConfig(enabled=True, weight_type="token"),
            filters=[TrainInferFilterConfig(enabled=True, agg_type="sequence", ratio_low=0.7,
                                            ratio_high=1.3)])
    for key, value in loss_settings.items():
        assert hasattr(config, key), key
        setattr(config, key, value)
    return config


def roll_actor(ms, aw, *, wc, pc, seq_length: int, seed: int = 1234):
    """ROLL's RLVR ActorWorker and MegatronTrainStrategy without Ray (module docstring)."""
    from mcore_adapter import TrainingArguments as McaTrainingArguments
    models, gpt = roll_models(seed)
    strategy = ms.MegatronTrainStrategy.__new__(ms.MegatronTrainStrategy)
    worker = aw.ActorWorker.__new__(aw.ActorWorker)
    worker.worker_config, worker.pipeline_config, worker.strategy = wc, pc, strategy
    worker._logprobs_cache = {}
    worker.rank_info = types.SimpleNamespace(tp_size=1, cp_size=1, dp_size=1, pp_size=1,
                                             tp_rank=0, cp_rank=0, dp_rank=0, pp_rank=0)
    strategy.worker, strategy.worker_config = worker, wc
    strategy.megatron_train_args = McaTrainingArguments(
        output_dir="/tmp/roll-test-out",
        per_device_train_batch_size=wc.training_args.per_device_train_batch_size,
        gradient_accumulation_steps=wc.training_args.gradient_accumulation_steps)
    strategy.model = models
    strategy.models_wrapped, strategy.models_unwrapped = models.models, [gpt]
    strategy.forward_backward_func = ms.get_forward_backward_func()  # as initialize binds it
    strategy.seq_length = seq_length
    strategy.use_sequence_packing = wc.use_sequence_packing
    strategy.enable_router_replay, strategy.is_multimodal = False, False
    strategy.optimizer = GradRecorder(models.models[0])
    strategy.scheduler = types.SimpleNamespace(step=lambda: None)
    return worker, strategy
