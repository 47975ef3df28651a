"""verl's own worker and trainer steps, stock vs the switch on, 3 steps (make test-frameworks).

Config: verl's `ppo_megatron_trainer.yaml` composed with Hydra as `main_ppo` does, GRPO overrides
(tests/test_verl_switch.py's), `actor_rollout_ref.model.use_remove_padding=False` (verl's THD
path packs for TE attention, CUDA only). Workers: verl's `ActorRolloutRefWorker.init_model`
builds the actor (role "actor") and the reference (role "ref") from that config -- its
HFModelConfig (importing `external_lib`: the switch), McoreActorConfig, `ppo_loss` partial and
engine settings -- and the trainer's own `RayPPOTrainer._compute_old_log_prob`,
`_compute_ref_log_prob` and `_update_actor` drive them (`compute_log_prob`,
`compute_ref_log_prob`, `update_actor` -> `TrainingWorker.train_mini_batch` over verl's
mini-batches). The rollout is replayed: one GRPO batch (shared prompts, 4 samples per uid,
advantages from verl's `compute_grpo_outcome_advantage` on fixed rewards) is fed each step.
Compared after every step: old and ref log-probs and entropy (as the trainer stores them),
every metric verl logs that does not depend on the micro-batch partition (loss, pg_loss,
kl_loss, grad_norm, lr; pg_clipfrac / ppo_kl are per-micro-batch means in verl itself), and
after 3 steps every weight (fp32, 1e-5, NaN/inf fail).

Stubbed (named), because they need Ray, CUDA or a checkpoint: `TrainingWorker.__init__`'s Ray
process group and `MegatronEngine.__init__/initialize` (the engine class still comes from
verl's `EngineRegistry` lookup; the harness gives it the tiny model and the real
McoreEngineConfig from the composed config), the optimizer (plain SGD, lr 0.05, returning the
gradient norm: no Megatron DistributedOptimizer on CPU), the FLOP counter's device (it asks
CUDA for the GPU's name: told it is the CPU, for verl's MFU metric), gloo's missing AVG
all-reduce (the worker averages its loss over DP: SUM / group size instead), the Ray worker group (the trainer methods call the worker objects directly),
the rollout (replayed batch). Not run: `RayPPOTrainer.fit` itself (its rollout manager starts
vLLM/SGLang servers through Ray; see docs/FRAMEWORKS.md).
"""
import copy
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    import ray  # noqa: F401  (verl's workers are Ray actors: make test-frameworks needs Ray too)
    import verl  # noqa: F401  (make test-frameworks: a broken install fails, never skips)
else:
    verl = pytest.importorskip("verl", reason="verl is installed by `make test-frameworks`")

from framework_data import SMALL, assert_grads_equal  # noqa: E402
from test_verl_switch import GRPO  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from benchlib import verl_harness as harness  # noqa: E402

pytestmark = pytest.mark.megatron
STEPS, LR = 3, 0.05


@pytest.fixture(scope="module", autouse=True)
def cpu_platform():
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # verl's own override: the engine a GPU node gets
    with harness.cpu_platform():
        yield
    os.environ.pop("VERL_ENGINE_DEVICE", None)


def _config(tmp_path, switch):
    from hydra import compose, initialize_config_dir
    from transformers import LlamaConfig
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=SMALL["vocab_size"],
                hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(tmp_path / "model")
    overrides = [f"actor_rollout_ref.model.path={tmp_path / 'model'}",
                 "+actor_rollout_ref.model.load_tokenizer=False", *GRPO,
                 "actor_rollout_ref.model.use_remove_padding=False",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    if switch:
        overrides.append("actor_rollout_ref.model.external_lib=megatron_patches.frameworks.verl_reuse")
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=overrides)


def _model(seed):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count
    torch.manual_seed(seed)
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    model.config.calculate_per_token_loss = False
    harness.stub_te_padding_mask(model)
    return model


def _stub_engine(engine, model):
    """The optimizer, lr scheduler, initialize and DP group stubs (module docstring)."""
    def step():
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum(g.float().pow(2).sum() for g in grads))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        return norm
    engine.initialize = lambda: None
    engine._is_offload_param = engine._is_offload_optimizer = False  # set by initialize
    engine.optimizer_zero_grad = lambda: [setattr(p, "grad", None) for p in model.parameters()]
    engine.optimizer_step = step
    engine.lr_scheduler_step = lambda: LR
    return engine


def _worker_classes(models):
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine_workers import TrainingWorker

    class StubInitTrainingWorker(TrainingWorker):
        """TrainingWorker.__init__ without Ray's process group and verl's engine construction
        (module docstring); the rest as verl's __init__ sets it."""

        def __init__(self, config):
            self.config, self.model_config = config, config.model_config
            self.engine_config, self.optimizer_config = config.engine_config, config.optimizer_config
            self.checkpoint_config, self.device_name = config.checkpoint_config, "cpu"
            self.engine_config.use_remove_padding = self.model_config.get("use_remove_padding", False)
            self.engine_config.use_fused_kernels = self.model_config.get("use_fused_kernels", False)
            self.profiler = DistProfiler(rank=0, config=None)
            self.model_config.model_type = config.model_type
            cls = EngineRegistry.get_engine_cls(config.model_type, self.engine_config.strategy)
            model = models["ref" if self.engine_config.forward_only else "actor"]
            self.engine = _stub_engine(harness.verl_engine(cls, model, vocab_size=SMALL["vocab_size"]),
                                       model)
            self.engine.engine_config = self.engine_config
            from verl.utils.flops_counter import FlopsCounter
            self.flops_counter, self.loss_fn = FlopsCounter(self.model_config.hf_config), None
            self._Worker__dispatch_dp_rank, self._Worker__collect_dp_rank = {}, {}
            self._register_dispatch_collect_info(mesh_name="train", dp_rank=0, is_collect=True)
    return StubInitTrainingWorker


def _worker(config, role, worker_cls):
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine_workers import ActorRolloutRefWorker
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)  # Ray's actor construction
    worker.config, worker.role = copy.deepcopy(config.actor_rollout_ref), role
    worker.distillation_config, worker.distillation_enabled = None, False
    worker.actor = worker.ref = worker.rollout = None
    worker._is_actor, worker._is_rollout, worker._is_ref = role == "actor", False, role == "ref"
    worker.enable_routing_replay, worker._omega_profiler_config = False, {}
    worker.profiler = DistProfiler(rank=0, config=None)
    worker._Worker__dispatch_dp_rank, worker._Worker__collect_dp_rank = {}, {}
    worker.actor_worker_cls = worker.ref_worker_cls = worker_cls
    worker.init_model()  # verl's own
    return worker


def _rollout(seed=11):
    """The replayed rollout: verl's padded batch (DataProto), GRPO advantages by verl."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    td = harness.verl_batch(((40, 4), (34, 4)), seed=seed, vocab_size=SMALL["vocab_size"],
                            response_lens=(10, 16), shared_response=6, padded=True)
    uid = np.array(list(td["uid"]), dtype=object)
    tensors = {k: td[k] for k in ("prompts", "responses", "input_ids", "attention_mask",
                                  "position_ids", "response_mask")}
    rewards = torch.zeros_like(tensors["response_mask"])
    last = tensors["response_mask"].cumsum(1).argmax(1)
    rewards[torch.arange(len(uid)), last] = torch.rand(len(uid), generator=torch.Generator().manual_seed(seed))
    adv, _ = compute_grpo_outcome_advantage(rewards, tensors["response_mask"], uid)
    tensors["advantages"] = adv
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info={
        "temperature": 1.0,  # fit sets these two as below
        "global_token_num": torch.sum(tensors["attention_mask"], dim=-1).tolist()})


def _run(tmp_path, switch):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from megatron_patches.frameworks import verl_reuse
    verl_reuse.disable()  # the switch is the config's external_lib import, nothing else:
    sys.modules.pop(verl_reuse.__name__, None)  # imported afresh there, as in a new worker process
    config = _config(tmp_path, switch)
    models = {"actor": _model(1), "ref": _model(2)}
    cls = _worker_classes(models)
    actor, ref = _worker(config, "actor", cls), _worker(config, "ref", cls)
    engines = (type(actor.actor.engine).__name__, type(ref.ref.engine).__name__)
    reports = [actor.actor.engine, ref.ref.engine]
    trainer = types.SimpleNamespace(config=config, actor_rollout_wg=actor, ref_policy_wg=ref,
                                    ref_in_actor=False, distillation_config=None)
    steps = []
    for _ in range(STEPS):
        batch = _rollout()
        old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
        batch = batch.union(old)
        batch = batch.union(RayPPOTrainer._compute_ref_log_prob(trainer, batch))
        metrics = RayPPOTrainer._update_actor(trainer, batch).meta_info["metrics"]
        steps.append((batch, metrics))
    for engine in reports if switch else ():  # the groups were shared, not run dense
        assert float(engine.prefix_reuse_report.split("(FLOP-ideal): ")[1].rstrip("x")) > 1.2
    sys.modules.get(verl_reuse.__name__, verl_reuse).disable()
    return engines, steps, models["actor"]


def test_verl_worker_three_steps_switch_equals_stock(megatron_env, tmp_path, monkeypatch):
    import verl.utils.flops_counter as flops_counter
    monkeypatch.setattr(flops_counter, "get_torch_device", lambda: torch.cpu)  # MFU's peak: CPU
    all_reduce = torch.distributed.all_reduce

    def gloo_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if op == torch.distributed.ReduceOp.AVG:  # gloo has no AVG: SUM / group size
            all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
            return tensor.div_(torch.distributed.get_world_size(group))
        return all_reduce(tensor, op=op, group=group, async_op=async_op)
    monkeypatch.setattr(torch.distributed, "all_reduce", gloo_all_reduce)
    stock_engines, stock, stock_model = _run(tmp_path / "stock", switch=False)
    reuse_engines, reuse, reuse_model = _run(tmp_path / "reuse", switch=True)
    assert stock_engines == ("MegatronEngineWithLMHead",) * 2
    assert reuse_engines == ("PrefixReuseMegatronEngine",) * 2
    for (db, dm), (rb, rm) in zip(stock, reuse):
        mask = db.batch["response_mask"].bool()
        for key in ("old_log_probs", "entropys", "ref_log_prob"):
            d, r = db.batch[key], rb.batch[key]
            assert torch.isfinite(d).all() and torch.isfinite(r).all(), key
            torch.testing.assert_close(r[mask], d[mask], rtol=1e-5, atol=1e-5, msg=key)
        compared = [k for k in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm",
                                "actor/lr") if k in dm]
        assert {"actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"} <= set(compared), dm
        for key in compared:
            d, r = np.asarray(dm[key], dtype=np.float64), np.asarray(rm[key], dtype=np.float64)
            assert np.isfinite(d).all() and np.isfinite(r).all(), key
            np.testing.assert_allclose(r, d, rtol=1e-5, atol=1e-7, err_msg=key)
    assert_grads_equal({n: p.detach().clone() for n, p in stock_model.named_parameters()},
                       {n: p.detach().clone() for n, p in reuse_model.named_parameters()})
