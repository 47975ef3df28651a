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
"""
from __future__ import annotations

from megatron_patches.frameworks.verl import check_verl_version, register_engine

__all__ = ["enable", "disable", "enabled"]

_replaced: dict = {}


def enable():
    """Point verl's ("language_model", "megatron") engines at the prefix-reuse engine
    (idempotent); returns its class."""
    check_verl_version()
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    cls = register_engine()
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
