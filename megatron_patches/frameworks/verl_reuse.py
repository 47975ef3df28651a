"""The verl switch: importing this module turns prefix reuse on for verl's Megatron actor/ref.

    python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer ... \\
        actor_rollout_ref.model.external_lib=megatron_patches.frameworks.verl_reuse

The mechanism is verl's own `external_lib`: `HFModelConfig.__post_init__`
(verl/workers/config/model.py) imports `actor_rollout_ref.model.external_lib` in every process
that builds the model config -- each Ray worker's `ActorRolloutRefWorker.init_model` does, before
`TrainingWorker` asks verl's `EngineRegistry` for the "megatron" language-model engine. On
import this module registers `PrefixReuseMegatronEngine` (backend "megatron_prefix_reuse") and
points verl's registry entries for ("language_model", "megatron") at it, so the actor update
(`update_actor`), the old-log-prob pass (`compute_log_prob`) and the reference pass
(`compute_ref_log_prob`) all run the prefix-reuse step (forward-only Phase A + B for the
log-prob passes). The critic (a value model) keeps verl's engine. A verl release outside
`SUPPORTED_VERL` makes the import fail with the supported range, so the worker stops at start.
Without the switch nothing here is imported and verl runs unchanged.

Options (AdapterConfig fields, JSON) come from the environment variable
`PREFIX_REUSE_VERL_OPTIONS`, which verl forwards to every Ray worker through its own
`ray_kwargs.ray_init.runtime_env` (merged into Ray's job runtime_env by `main_ppo.run_ppo`):
    +ray_kwargs.ray_init.runtime_env.env_vars.PREFIX_REUSE_VERL_OPTIONS='{"min_gain": 1.2}'
An unknown field or a bad value fails the import with a ValueError naming it. `temperature`,
`compute_entropy` follow verl's batch; `sequence_level_loss` is forced on where verl's loss
needs it (verl_settings.py).
"""
from __future__ import annotations

import dataclasses
import json
import os

from megatron_patches.frameworks.adapter import AdapterConfig
from megatron_patches.frameworks.verl import check_verl_version, register_engine

__all__ = ["OPTIONS_ENV", "options_from_env", "enable", "disable", "enabled"]

OPTIONS_ENV = "PREFIX_REUSE_VERL_OPTIONS"


def options_from_env() -> AdapterConfig:
    """AdapterConfig from $PREFIX_REUSE_VERL_OPTIONS (JSON object; unset: the defaults)."""
    text = os.environ.get(OPTIONS_ENV, "").strip()
    if not text:
        return AdapterConfig()
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{OPTIONS_ENV}={text!r} is not JSON ({error}); give an object such "
                         'as {"min_gain": 1.2}') from None
    known = {f.name for f in dataclasses.fields(AdapterConfig)} - {"temperature", "compute_entropy"}
    unknown = sorted(set(options) - known) if isinstance(options, dict) else ["(not an object)"]
    if unknown:
        raise ValueError(f"{OPTIONS_ENV}: unknown option(s) {unknown}; the options are "
                         f"{sorted(known)} (temperature and entropy follow verl's batch)")
    return AdapterConfig(**options)

_replaced: dict = {}


def enable():
    """Point verl's ("language_model", "megatron") engines at the prefix-reuse engine
    (idempotent); returns its class."""
    check_verl_version()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    cls = register_engine()
    cls.prefix_reuse_config = options_from_env()
    registry = EngineRegistry._engines["language_model"]["megatron"]
    for key, engine in list(registry.items()):
        if engine is MegatronEngineWithLMHead:
            _replaced[key] = engine
            registry[key] = cls
    for key in ("cpu", "cuda"):  # the devices the reuse engine runs on
        if key not in registry:
            _replaced[key] = None
            registry[key] = cls
    return cls


def disable() -> None:
    """verl's own engines back (tests)."""
    from verl.workers.engine.base import EngineRegistry
    registry = EngineRegistry._engines["language_model"]["megatron"]
    for key, engine in _replaced.items():
        if engine is None:
            registry.pop(key, None)
        else:
            registry[key] = engine
    _replaced.clear()


def enabled() -> bool:
    """Whether verl's "megatron" language-model engine is the prefix-reuse one here."""
    from verl.workers.engine.base import EngineRegistry
    cls = register_engine()
    return any(e is cls for e in EngineRegistry._engines["language_model"]["megatron"].values())


enable()
