"""`tools/bench.py --adapter verl`: verl 0.9.1's engine step, dense vs prefix reuse.

Dense = verl's own `MegatronEngineWithLMHead.forward_backward_batch` (its dynamic batch size,
micro-batches balanced to one sample's tokens: one sample per micro-batch, as the generic
bench's dense step); reuse = the registered `megatron_prefix_reuse` engine
(megatron_patches/frameworks/verl.py); both with verl's own `ppo_loss` (KL loss on), on the same
verl actor batch: `--num-groups` prompts of `--prefix-len` tokens, `--group-size` samples each,
responses of `--suffix-len` tokens. The engines, the batch and the stubs are
benchlib/verl_harness.py's (shared with tests/test_verl_adapter.py, which names them).
Where verl is not importable: ValueError naming the environment (bench.py exits 2).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from benchlib.adapter_common import (adapter_result, bench_models, ideal_speedup, overhead_of,
                                    time_paths)
from benchlib.config import BenchConfig
from benchlib import verl_harness as harness

__all__ = ["run_verl_bench", "verl_step_batch"]


def verl_step_batch(config: BenchConfig):
    """The bench's workload as verl's actor batch (verl_harness.verl_batch)."""
    return harness.verl_batch([(config.prefix_len, config.group_size)] * config.num_groups,
                              seed=config.seed, vocab_size=config.vocab_size,
                              response_lens=(config.suffix_len, config.suffix_len + 1),
                              max_token_len_per_gpu=config.prefix_len + config.suffix_len)


def run_verl_bench(config: BenchConfig, raw_times: Dict[str, List[float]]) -> dict:
    """The --adapter verl result (benchlib/adapter_bench.py's fields)."""
    if not harness.verl_available():
        raise ValueError(f"--adapter verl: {harness.VERL_MISSING}")
    from megatron_patches.frameworks.verl import check_verl_version, rollout_from_verl
    check_verl_version()
    with harness.cpu_platform():
        return _run(config, raw_times, rollout_from_verl)


def _run(config: BenchConfig, raw_times, rollout_from_verl) -> dict:
    import megatron_patches
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from megatron_patches.frameworks.verl import register_engine
    from megatron_patches.training import max_relative_diff, param_grads, zero_grads
    models = bench_models(config)
    for model in models.values():
        harness.stub_te_padding_mask(model)
    engines = {"dense": harness.verl_engine(MegatronEngineWithLMHead, models["dense"],
                                            vocab_size=config.vocab_size),
               "reuse": harness.verl_engine(register_engine(), models["reuse"],
                                            vocab_size=config.vocab_size)}
    data, loss = verl_step_batch(config), harness.ppo_loss_function()
    outputs: dict = {}

    def dense(engine):
        with megatron_patches.use_prefix_reuse_schedule(False):
            return engine.forward_backward_batch(data.clone(), loss)

    def reuse():
        outputs["reuse"] = engines["reuse"].forward_backward_batch(data.clone(), loss)

    def dense_timed():
        outputs["dense"] = dense(engines["dense"])
    times = time_paths({"dense": dense_timed, "reuse": reuse},
                       {n: (lambda m=m: zero_grads(m)) for n, m in models.items()}, config)
    raw_times.update(times)
    reuse_grads = param_grads(models["reuse"])
    zero_grads(models["reuse"])  # the reference: verl's dense step, stock local attention
    reference = dense(harness.verl_engine(MegatronEngineWithLMHead, models["reuse"],
                                          vocab_size=config.vocab_size))
    diff = max_relative_diff(param_grads(models["reuse"]), reuse_grads)
    ideal, num_reuse = ideal_speedup(models["reuse"], rollout_from_verl(data))
    result = adapter_result(config, times, diff=diff,
                            finite=all(torch.isfinite(g).all() for g in reuse_grads.values()),
                            num_microbatches={"dense": len(outputs["dense"]["loss"]),
                                              "reuse": num_reuse},
                            ideal=ideal, overhead=overhead_of(config, models["reuse"]))
    dense_loss, reuse_loss = sum(reference["loss"]), sum(outputs["reuse"]["loss"])
    result["loss"] = {"dense": float(dense_loss), "reuse": float(reuse_loss)}
    return result
