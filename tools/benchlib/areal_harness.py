"""AReaL 1.0.4's Megatron engine on CPU, shared by tests/test_fw_areal*.py and
tools/peer_areal.py: the engine object, AReaL's actor batch, AReaL's loss.

Both sides run AReaL's real code: `MegatronEngine.train_batch` (its `_prepare_mb_list` split,
`compute_total_loss_weight`, `forward_backward_batch` with `packed_context_parallel_forward`,
`_compute_logprobs_and_loss` with the `local_weight / total_weight x dp x len(mb_list)` factor)
for dense, `grpo_loss_fn` from areal/trainer/ppo/actor.py as the loss; the prefix-reuse side runs
megatron_patches.frameworks.areal inside the same engine class.

Stubbed, because it needs CUDA, a checkpoint, or a package that cannot import on CPU (named here,
nothing else):
- `megatron.bridge` (Megatron-Bridge; `install_import_stubs`): AReaL's engine module imports it
  at load for checkpoint conversion and LoRA, which these tests never call; empty modules with
  the imported names (classes that raise if used; `mbridge` itself is installed and real);
  likewise the experiment loggers `wandb`, `swanlab`, `tensorboardX`, `trackio` that
  areal/utils/stats_logger.py imports at load (never called here), and AReaL's FP8
  Triton kernels module `areal.engine.megatron_utils.fp8.kernels` (CUDA only; FP8 is off);
- the engine's construction (`areal_engine`; `MegatronEngine.initialize`: HF checkpoint via
  mbridge, CUDA process groups, Megatron's DDP and distributed optimizer): the engine object is
  built by AReaL's own `__init__` from a real AReaL config, then gets the model, a
  `ParallelStrategy()` (all 1), device "cpu" and `use_padded_seq=True` (AReaL's own BSHD path,
  which it takes for models whose kernels reject packed THD input: the local attention here);
- the optimizer (`GradRecorder`): loss scale 1, `step()` records the gradients and does not
  update; the model's `zero_grad_buffer` (Megatron DDP's) zeroes the plain gradients;
- the [B, S] padding mask AReaL's BSHD path hands the model (`stub_padding_mask`): only
  Transformer Engine's attention reads it; the local attention gets the causal mask alone
  (AReaL pads on the right, so no real token attends to padding: the same computation).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from functools import partial
from typing import Dict, Sequence, Tuple

import torch

__all__ = ["AREAL_MISSING", "areal_available", "install_import_stubs", "GradRecorder",
           "stub_padding_mask", "areal_engine", "areal_batch", "grpo_loss", "loss_weight_fn"]

AREAL_MISSING = ("AReaL is not importable in this Python: areal 1.0.4 lives in the frameworks "
                 "environment; build it with `make .venv-frameworks/.setup-stamp`")
STUBBED_MODULES = ("megatron.bridge", "megatron.bridge.peft", "megatron.bridge.peft.lora",
                   "swanlab", "wandb", "tensorboardX", "trackio")
TRITON_ONLY_MODULES = ("areal.engine.megatron_utils.fp8.kernels",)
"""AReaL modules that import Triton unguarded (its FP8 block-cast kernels, CUDA only): stubbed
when Triton is not installed (it is ~1 GB and runs on no CPU)."""


def areal_available() -> bool:
    return importlib.util.find_spec("areal") is not None


class _Unavailable:
    """A Megatron-Bridge class stand-in: importable, raises if used."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} is a CPU-test stub of Megatron-Bridge "
                           "(tools/benchlib/areal_harness.py)")


def _stub_attr(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (_Unavailable,), {})


def install_import_stubs() -> None:
    """Empty `megatron.bridge` modules (module docstring), unless importable."""
    from megatron_patches.support.cpu_support import stub_missing_triton
    stub_missing_triton()  # megatron-core's own paged-stash Triton module (cpu_support.py)
    for name in STUBBED_MODULES:
        if name in sys.modules:
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                continue
        except (ImportError, ValueError):
            pass
        _stub_module(name)
    if importlib.util.find_spec("triton") is None:
        for name in TRITON_ONLY_MODULES:
            sys.modules.setdefault(name, _stub_module(name))


def _stub_module(name: str):
    module = types.ModuleType(name)
    module.__path__ = []  # a package: submodules import
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__getattr__ = _stub_attr
    sys.modules[name] = module
    return module


class GradRecorder:
    """The optimizer stand-in (module docstring): `grads` after each `step()`."""

    def __init__(self, model) -> None:
        self.model, self.grads, self.param_groups = model, [], [{"lr": 0.0}]

    def get_loss_scale(self):
        return torch.tensor(1.0)

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def step(self):
        from megatron_patches.training import param_grads
        grads = param_grads(self.model)
        self.grads.append(grads)
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        return True, float(norm), None


def stub_padding_mask(model):
    """Drop the [B, S] padding mask of AReaL's BSHD path (module docstring)."""
    def padding_mask_stub(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            kwargs["attention_mask"] = None
        return args, kwargs
    return model.register_forward_pre_hook(padding_mask_stub, with_kwargs=True)


def areal_engine(model, config, *, cls=None):
    """An AReaL engine of class `cls` (default MegatronPPOActor) around `model` (module
    docstring); `engine.optimizer.grads` holds each step's gradients."""
    from areal.api.alloc_mode import ParallelStrategy
    if cls is None:
        from areal.engine.megatron_engine import MegatronPPOActor as cls
    engine = cls(config)
    engine.model = [model]
    engine.tf_config = model.config
    engine.parallel_strategy = ParallelStrategy()
    engine.device = torch.device("cpu")
    engine.use_padded_seq = True
    engine.is_vision_model = False
    engine.optimizer = GradRecorder(model)
    engine._initialized = True
    engine.process_group_initialized = True  # Megatron's parallel state is initialised (gloo)
    from areal.utils import logging
    engine.logger = logging.getLogger("[MegatronEngine Rank 0]")  # as initialize() names it
    model.zero_grad_buffer = engine.optimizer.zero_grad
    return engine


def actor_config(*, prefix_reuse: bool, **overrides):
    """AReaL's PPOActorConfig with the prefix_reuse key (megatron_patches.frameworks.areal)."""
    from areal.api.cli_args import MicroBatchSpec, PPOActorConfig
    from megatron_patches.frameworks.areal import PrefixReuseConfig, with_prefix_reuse
    reuse = overrides.pop("prefix_reuse_config", {})
    mb_spec = overrides.pop("mb_spec", MicroBatchSpec(n_mbs=3))
    return with_prefix_reuse(PPOActorConfig)(
        experiment_name="prefix-reuse", trial_name="cpu", dtype="float32", mb_spec=mb_spec,
        prefix_reuse=PrefixReuseConfig(enabled=prefix_reuse, **reuse), **overrides)


def areal_batch(groups: Sequence[Tuple[int, int]], *, seed: int, vocab_size: int = 256,
                response_lens: Tuple[int, int] = (5, 12), mask_drop: float = 0.1,
                extra: Sequence[str] = ("prox_logp",)) -> Dict[str, torch.Tensor]:
    """AReaL's actor batch after `compute_advantages` (areal/trainer/ppo/actor.py): right-padded
    [B, S] `input_ids` / `attention_mask`; `loss_mask`, `logprobs`, `advantages` rolled by -1
    (entry t is about token t+1), `groups` = (prompt length, samples) per prompt. `extra`:
    `prox_logp` (the proximal log-probs the actor's compute_logp adds; default), `teacher_logp`
    (distillation), `versions` (per-token policy versions, for the approximated proximal
    log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for p, n in groups:
        prompt = torch.randint(1, vocab_size, (p,), generator=gen)
        adv = torch.randn(n, generator=gen)
        for k in range(n):
            r = int(torch.randint(*response_lens, (1,), generator=gen))
            samples.append((prompt, torch.randint(1, vocab_size, (r,), generator=gen), float(adv[k])))
    B = len(samples)
    S = max(p.numel() + r.numel() for p, r, _ in samples)
    data = {"input_ids": torch.zeros(B, S, dtype=torch.int64),
            "attention_mask": torch.zeros(B, S, dtype=torch.bool)}
    for key in ("loss_mask", "logprobs", "advantages", *extra):
        data[key] = torch.zeros(B, S, dtype=torch.int32 if key in ("loss_mask", "versions")
                                else torch.float32)
    for b, (prompt, resp, a) in enumerate(samples):
        p, n = prompt.numel(), prompt.numel() + resp.numel()
        data["input_ids"][b, :n] = torch.cat([prompt, resp])
        data["attention_mask"][b, :n] = True
        mask = torch.zeros(S, dtype=torch.int32)
        mask[p:n] = (torch.rand(n - p, generator=gen) > mask_drop).int()
        mask[p] = 1
        data["loss_mask"][b] = torch.roll(mask, -1)
        data["logprobs"][b, :n - 1] = -torch.rand(n - 1, generator=gen) * 3 - 0.5
        data["advantages"][b] = a * data["loss_mask"][b].float()
        for key in extra:
            if key == "versions":
                data[key][b, :n - 1] = torch.randint(0, 3, (n - 1,), generator=gen).int()
            else:
                data[key][b, :n - 1] = -torch.rand(n - 1, generator=gen) * 3 - 0.5
    return data


def grpo_loss(**settings):
    """AReaL's `grpo_loss_fn` as `MegatronPPOActor._ppo_update` binds it (PPOActorConfig
    defaults: eps_clip 0.2, no dual clip, token-level, recompute proximal log-probs)."""
    from areal.trainer.ppo.actor import grpo_loss_fn
    kwargs = dict(eps_clip=0.2, eps_clip_higher=None, c_clip=None)
    kwargs.update(settings)
    return partial(grpo_loss_fn, **kwargs)


def loss_weight_fn(x):
    """AReaL's actor loss weight (areal/trainer/ppo/actor.py)."""
    return x["loss_mask"].count_nonzero()
