"""Megatron-LM RL (`train_rl.py`) rollouts replayed from a trace file, through its own agent API.

`--langrl-env-config` names agents from `megatron.rl.agent.registry.AGENT_REGISTRY`, which
`get_agent` builds through `WeightedMultiTask.from_config`; `register_replay_agent()` adds
`TraceReplayAgent` (a `GroupedRolloutGenerator`) there and `write_env_config(trace, directory)`
writes the YAML that names it. Megatron's own `RolloutPipeline` drives it and
`get_environment_rollouts` collects and broadcasts its groups as in a generating run; the agent
hands the trace's prompt and response tokens, inference log-probs and rewards to the pipeline
instead of sampling them from the inference engine.

`ReplayInference` is the engine-less inference interface a replayed run needs without CUDA:
`rl_utils.get_inference_interface` launches Megatron's CUDA dynamic inference engine and its
server (`MegatronLocal.launch`); this is a `ReturnsRaw` interface with the engine's lifecycle
(resume / suspend / kill / set_generation_epoch / merge_global_request_ledgers) and no
generation: the replay agent never asks it to generate.

The trace: `TRACE_FORMAT` (prefix_schedule/traces/train_rl_replay.py, with `check_trace` and
`synth_trace`, which writes a random one: tools/train_rl_trace.py).
Used by examples/megatron_lm/train_rl_prefix_reuse.py (`--replay-trace`) and its tests.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefix_schedule.traces.train_rl_replay import TRACE_FORMAT, check_trace, synth_trace

AGENT_NAME = "TraceReplayAgent"
__all__ = ["AGENT_NAME", "TRACE_FORMAT", "register_replay_agent", "write_env_config",
           "replay_inference", "synth_trace", "check_trace"]


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
                raise RuntimeError(f"the trace {self.trace} has {len(groups)} groups, all "
                                   "replayed: give a longer trace or fewer --train-iters")
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


def register_replay_agent() -> None:
    """`TraceReplayAgent` in Megatron's agent registry (built when the registry imports it)."""
    from megatron.rl.agent import registry

    registry.AGENT_REGISTRY[AGENT_NAME] = f"{__name__}:{AGENT_NAME}"


def write_env_config(trace: str, directory: str) -> str:
    """A `--langrl-env-config` YAML naming TraceReplayAgent on `trace`; returns its path."""
    path = Path(directory) / "replay-env.yaml"
    path.write_text(f"- agent_type: {AGENT_NAME}\n  agent_args:\n"
                    f"    trace: {json.dumps(str(Path(trace).resolve()))}\n  weight: 1.0\n")
    return str(path)


def replay_inference():
    """The engine-less inference interface (module doc)."""
    from megatron.rl.inference.inference_interface import ReturnsRaw

    class ReplayInference(ReturnsRaw):
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
            raise RuntimeError("no inference engine here: replay the rollouts (--replay-trace)")
    return ReplayInference()


def __getattr__(name):
    """`TraceReplayAgent`, built when the registry imports it (megatron.rl is importable then)."""
    if name != AGENT_NAME:
        raise AttributeError(name)
    globals()[name] = _agent_class()
    return globals()[name]
