"""A whole Megatron-LM `train_rl.py` run on CPU, stock or `--prefix-reuse`, rollouts replayed.

    python -m torch.distributed.run --nproc-per-node 1 tests/train_rl_run.py \\
        --train-rl TREE/train_rl.py [train_rl's arguments] [--prefix-reuse]
    python tests/train_rl_run.py --save-weights CHECKPOINT_DIR OUT.pt

with a patched Megatron-LM main checkout first on PYTHONPATH and this repository second (run by
tests/test_megatron_rl_train_rl_run.py). It installs the stubs below, then runs
examples/megatron_lm/train_rl_prefix_reuse.py's `main` with the remaining arguments, as a user
runs the launcher: train_rl.py as `__main__` (its argument parsing, `pretrain` -> `train()` loop,
optimizer, `training_log`, `save_checkpoint`), its rollout collection through its own extension
points: `--langrl-env-config` names `TraceReplayAgent` (a `GroupedRolloutGenerator` registered
in megatron.rl.agent.registry.AGENT_REGISTRY, which `get_agent` builds through
`WeightedMultiTask.from_config`), driven by Megatron's own `RolloutPipeline`.

Stubs (each replaces only something that needs CUDA or is absent; none changes the math):
* `ReplayInference` (rl_utils.get_inference_interface): the real one launches Megatron's CUDA
  dynamic inference engine and its HTTP server (`MegatronLocal.launch`). The stand-in is a
  `ReturnsRaw` interface with the engine's lifecycle (resume / suspend / kill /
  set_generation_epoch / merge_global_request_ledgers) and no generation: the replay agent
  never asks it to generate (its `base_generate` raises).
* `TraceReplayAgent`: the agent itself replays a trace (JSON: per collection, per group, the
  prompt tokens and per member the response tokens ending in eod, their inference log-probs and
  the reward) as TokenRollouts, in order; the real agents sample from the inference engine.
* `NullTokenizer.bos_id = None`: prepare_trajectories asks the tokenizer for `bos`, which
  Megatron's text tokenizer reads from `bos_id`, which its NullTokenizer (the file-less
  tokenizer of tiny runs) does not define (an AttributeError, not a CUDA matter): no BOS.
* `_cpu_thd_forward` (GPTModel.forward) and the `wandb` / `hybrid_builders` module stubs:
  tests/train_rl_replay.py's, which say why.
Recorder (changes nothing): `RECORD_ENV` names a JSON-lines file that gets, per `training_log`
call, the iteration, its loss dict and grad norm at full precision (the log line rounds them).
Not run: generation (CUDA inference engine), CUDA graphs, Transformer Engine.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megatron_patches.megatron_lm import compat

AGENT_NAME = "TraceReplayAgent"
RECORD_ENV = "TRAIN_RL_RECORD"
__all__ = ["AGENT_NAME", "RECORD_ENV", "install_stubs", "save_weights", "main"]
TRACE_FORMAT = """JSON: [[{"prompt": [ids], "members": [{"response": [ids ending in eod],
"logprobs": [float per response token], "reward": float}, ...G]}, ...groups] ...collections]"""


def _agent_class():
    from megatron.rl.agent.api import (EpisodeResult, GroupedRolloutGenerator,
                                       GroupRolloutParams, RolloutGenerator)
    from megatron.rl.inference.api import InferenceResponse, LLMChatMessage
    from megatron.rl.types.rollout import TokenRollout

    class TraceReplayAgent(RolloutGenerator, GroupedRolloutGenerator):
        """Replays the trace's groups (TRACE_FORMAT) in order, one per `prepare_group_rollout`
        (the pipeline prepares groups one at a time, in batch order); its G episodes come out
        in rollout_idx order (the pipeline's FIFO infer queue). (RolloutGenerator: the base
        `WeightedMultiTask`'s config asks of every agent.)"""

        trace: str
        env_id: str = "replay"
        cursor: int = 0
        groups: list = []

        def _groups(self):
            if not self.groups:
                self.groups = [g for c in json.loads(Path(self.trace).read_text()) for g in c]
            return self.groups

        async def get_rollout_response(self, request, inference_request):
            raise RuntimeError("TraceReplayAgent replays: it never asks the engine")

        async def get_reward_rollouts(self, request):
            raise RuntimeError("TraceReplayAgent replays grouped rollouts only")

        async def prepare_group_rollout(self, request):
            groups = self._groups()
            if self.cursor >= len(groups):
                raise RuntimeError(f"the trace has {len(groups)} groups: all replayed")
            group, index = groups[self.cursor], self.cursor
            self.cursor += 1
            if len(group["members"]) != request.rollouts_per_group:
                raise RuntimeError(f"trace group {index} has {len(group['members'])} members, "
                                   f"--grpo-group-size is {request.rollouts_per_group}")
            members = iter(group["members"])

            async def run_episode():
                member = next(members)
                response = InferenceResponse(
                    response=LLMChatMessage(role="assistant", content=""),
                    token_ids=group["prompt"] + member["response"],
                    prompt_length=len(group["prompt"]), logprobs=member["logprobs"],
                    finish_reason="stop")
                return EpisodeResult(responses=[response], conversation=[member])

            async def build_rollout(episode):
                (response,), (member,) = episode.responses, episode.conversation
                n = len(response.token_ids) - response.prompt_length
                return TokenRollout(
                    trajectory=[response.token_ids], reward=member["reward"],
                    generation_mask=[[False] * response.prompt_length + [True] * n],
                    logprobs=[response.logprobs], env_id=self.env_id,
                    problem_id=f"trace-{index}")
            return GroupRolloutParams(run_episode=run_episode, build_rollout=build_rollout)
    return TraceReplayAgent


def _replay_inference():
    from megatron.rl.inference.inference_interface import ReturnsRaw

    class ReplayInference(ReturnsRaw):
        """The inference engine's lifecycle without an engine (module doc)."""

        def set_generation_epoch(self, _epoch) -> None:
            pass

        async def resume(self) -> None:
            pass

        async def suspend(self) -> None:
            pass

        async def kill(self) -> None:
            pass

        def merge_global_request_ledgers(self):
            return {}

        async def base_generate(self, request):
            raise RuntimeError("no inference engine on CPU: replay the rollouts")
    return ReplayInference()


def _recording(training_log, path):
    def record(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
               report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        with open(path, "a") as out:
            out.write(json.dumps({"iteration": iteration, "grad_norm": float(grad_norm),
                                  "losses": {k: float(v) for k, v in loss_dict.items()}}) + "\n")
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                            report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)
    return record


def install_stubs() -> None:
    """The module doc's stubs, before train_rl.py runs."""
    from train_rl_replay import _cpu_thd_forward
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from megatron.rl import rl_utils
    from megatron.rl.agent import registry
    from megatron.training import training

    GPTModel.forward = _cpu_thd_forward(GPTModel.forward)
    NullTokenizer.bos_id = None  # its wrapper's `bos` reads bos_id, which NullTokenizer lacks
    registry.AGENT_REGISTRY[AGENT_NAME] = f"{Path(__file__).stem}:{AGENT_NAME}"
    interface = _replay_inference()
    rl_utils.get_inference_interface = lambda args, loop, model: interface
    if os.environ.get(RECORD_ENV):
        training.training_log = _recording(training.training_log, os.environ[RECORD_ENV])


def save_weights(checkpoints: str, out: str) -> None:
    """The floating-point model tensors of every iteration saved under `checkpoints`
    (--ckpt-format torch) as {iteration: {"RANK_DIR/name": tensor}} in `out`, one RANK_DIR per
    model-parallel rank (mp_rank_00, or mp_rank_00_000 / _001 with pipeline stages). Loading
    Megatron's checkpoint needs the checkout's modules: this runs beside the training run."""
    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    weights = {}
    for path in sorted(Path(checkpoints).glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False, map_location="cpu")["model"]
        weights.setdefault(int(path.parts[-3][5:]), {}).update({
            f"{path.parts[-2]}/{k}": v for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point()})
    torch.save(weights, out)


def main(argv) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "megatron_lm"))
    import train_rl_prefix_reuse as launcher

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # this module, for the registry
    from train_rl_replay import _stub_missing_modules

    _stub_missing_modules()  # before megatron.training imports megatron.rl
    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    install_stubs()
    launcher.main(argv)


def __getattr__(name):
    """`TraceReplayAgent`, built when the registry imports it (megatron.rl is importable then)."""
    if name != AGENT_NAME:
        raise AttributeError(name)
    globals()[name] = _agent_class()
    return globals()[name]


if __name__ == "__main__":
    if sys.argv[1] == "--save-weights":
        save_weights(*sys.argv[2:])
    else:
        main(sys.argv[1:])
