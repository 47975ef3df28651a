"""The verl switch as a verl user turns it on (make test-frameworks):
`actor_rollout_ref.model.external_lib=megatron_patches.frameworks.verl_reuse` on verl's own
`ppo_megatron_trainer` config, composed with Hydra the way `verl.trainer.main_ppo` composes it.

Each check runs in a FRESH interpreter started outside the repository root (what a Ray worker
is: a new process that receives the config, with only installed packages importable): it
builds verl's `HFModelConfig` from `actor_rollout_ref.model` as `ActorRolloutRefWorker.init_model`
does (`omega_conf_to_dataclass`), then asks verl's `EngineRegistry` for the engine that
`TrainingWorker.__init__` would build (`backend=engine_config.strategy`, "megatron").
Stand-ins (named): the model directory holds a LlamaConfig only (no weights, no tokenizer:
`+actor_rollout_ref.model.load_tokenizer=False`), and the engine lookup is told the device is
CUDA (`VERL_ENGINE_DEVICE=cuda`, verl's own override) as on a GPU node, and triton's missing
MoE paged-stash kernel module is stubbed (`stub_missing_triton`) as in every CPU test here.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    import verl  # noqa: F401  (make test-frameworks: a broken install fails, never skips)
else:
    verl = pytest.importorskip("verl", reason="verl is installed by `make test-frameworks`")

SWITCH = "actor_rollout_ref.model.external_lib=megatron_patches.frameworks.verl_reuse"
GRPO = [  # a GRPO run's overrides in the style of verl's GRPO Megatron examples (small sizes)
    "algorithm.adv_estimator=grpo", "data.train_batch_size=4",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
]

WORKER = textwrap.dedent("""
    import sys
    from megatron_patches.support.cpu_support import stub_missing_triton
    stub_missing_triton()  # this CPU machine has no triton (a GPU node has)
    from omegaconf import OmegaConf
    import verl
    if len(sys.argv) > 2:
        verl.__version__ = sys.argv[2]  # a release outside the tested range
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.base import EngineRegistry
    config = OmegaConf.load(sys.argv[1])
    omega_conf_to_dataclass(config.actor_rollout_ref.model)  # ActorRolloutRefWorker.init_model
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    cls = EngineRegistry.get_engine_cls("language_model", actor.megatron.strategy)
    print("ENGINE", cls.__name__)
""")


def _compose(tmp_path, *overrides):
    """verl's ppo_megatron_trainer.yaml + overrides, composed as main_ppo's @hydra.main does."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import LlamaConfig
    model_dir = tmp_path / "model"
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
                intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(model_dir)
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose(config_name="ppo_megatron_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "+actor_rollout_ref.model.load_tokenizer=False",
            *GRPO, *overrides])
    path = tmp_path / "config.yaml"
    OmegaConf.save(config, path, resolve=True)
    return path


def _worker(tmp_path, config, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VERL_ENGINE_DEVICE="cuda", OMP_NUM_THREADS="1")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.run([sys.executable, str(script), str(config), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_verl_switch_selects_the_reuse_engine_in_a_fresh_worker_process(tmp_path):
    on = _worker(tmp_path, _compose(tmp_path, SWITCH))
    assert on.returncode == 0, on.stderr[-3000:]
    assert "ENGINE PrefixReuseMegatronEngine" in on.stdout
    off = _worker(tmp_path, _compose(tmp_path))
    assert off.returncode == 0, off.stderr[-3000:]
    assert "ENGINE MegatronEngineWithLMHead" in off.stdout


def test_verl_switch_refuses_an_untested_verl_release(tmp_path):
    run = _worker(tmp_path, _compose(tmp_path, SWITCH), "0.10.0")
    assert run.returncode != 0
    assert "verl 0.10.0 is not supported" in run.stderr and "verl==0.9.1" in run.stderr


def test_verl_switch_covers_actor_and_ref_in_process():
    """One registry entry serves the actor's and the reference model's TrainingWorker (both ask
    for backend "megatron"); disable() gives verl's engine back."""
    from verl.workers.engine.base import EngineRegistry
    from megatron_patches.frameworks import verl_reuse
    try:
        cls = verl_reuse.enable()
        for device in ("cuda", "cpu"):
            os.environ["VERL_ENGINE_DEVICE"] = device
            assert EngineRegistry.get_engine_cls("language_model", "megatron") is cls
        assert verl_reuse.enabled()
    finally:
        os.environ.pop("VERL_ENGINE_DEVICE", None)
        verl_reuse.disable()
    assert not verl_reuse.enabled()


def test_verl_switch_options_from_the_environment(monkeypatch):
    """Options travel as $PREFIX_REUSE_VERL_OPTIONS (verl forwards ray_kwargs.ray_init.runtime_env
    env_vars to its workers); bad ones fail the switch's import with the option named."""
    from megatron_patches.frameworks import verl_reuse
    try:
        monkeypatch.setenv(verl_reuse.OPTIONS_ENV, '{"min_gain": 1.5, "min_shared_len": 8}')
        cls = verl_reuse.enable()
        assert cls.prefix_reuse_config.min_gain == 1.5 and cls.prefix_reuse_config.min_shared_len == 8
        for bad, named in (('{"min_gian": 1.5}', "min_gian"), ('{"min_gain": 0}', "min_gain"),
                           ('{"temperature": 0.5}', "temperature"), ("min_gain=1", "not JSON")):
            monkeypatch.setenv(verl_reuse.OPTIONS_ENV, bad)
            with pytest.raises(ValueError, match=named):
                verl_reuse.enable()
    finally:
        monkeypatch.delenv(verl_reuse.OPTIONS_ENV, raising=False)
        verl_reuse.disable()
        verl_reuse.enable().prefix_reuse_config = verl_reuse.options_from_env()
        verl_reuse.disable()
