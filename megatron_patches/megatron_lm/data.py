"""Where the trainer's RL steps come from: a trace file (pluggable readers) or a generator.

A source is anything with `step(iteration) -> GroupBatch` (`StepSource`): random access by the
0-based iteration, so a resumed run (`--load`) reads exactly the step the interrupted run would
have read next. Every rank asks for the same step and gets the same batch; the trainer then gives
each data-parallel rank its groups (`place_groups`).

Readers are registered by name (`register_trace_reader`) with the file extensions they claim
and, optionally, a content test; `--rl-trace-format module:callable` loads one from any module
without registering it. A reader factory is called as `factory(path, args)` (args: Megatron's
parsed arguments) and returns a `StepSource`. The project's own trace format (`tools/trace.py`,
prefix_schedule/traces) registers itself here (trace_source.py), by extension and by content.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple

import torch

from prefix_schedule import Group, GroupBatch, Trajectory
from prefix_schedule.losses import grpo_advantages

__all__ = ["StepSource", "SyntheticSteps", "register_trace_reader", "trace_readers",
           "resolve_trace_reader", "open_step_source", "check_moe_tensor_parallel_rows"]


class StepSource(Protocol):
    """RL steps by iteration: the same `GroupBatch` on every rank for a given iteration."""

    def step(self, iteration: int) -> GroupBatch:
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticSteps:
    """Seeded GRPO-shaped steps: random prompts and responses, group-normalised advantages of a
    token-based reward, behaviour and reference log-probs near the policy's (on-policy-like)."""

    vocab_size: int
    """Token ids are drawn from [0, vocab_size)."""
    num_groups: int
    """Prompts per step (Megatron's --grpo-prompts-per-step)."""
    group_size: int
    """Responses per prompt (Megatron's --grpo-group-size)."""
    prefix_len: int
    """Prompt tokens per group."""
    max_response_len: int
    """Responses have 1 .. max_response_len tokens (at least half of it when it is >= 2)."""
    seed: int = 0
    """Step i's batch depends only on (seed, i)."""
    uniform_groups: bool = False
    """Every group of a step has the same response lengths (tokens differ): the same plan on
    every data-parallel rank, which expert parallelism needs (its token exchanges pair up)."""
    fixed_response_len: bool = False
    """Every response has exactly max_response_len tokens (rows of one length: what MoE with
    TP > 1 needs: `check_moe_tensor_parallel_rows`)."""

    def __post_init__(self):
        for name in ("vocab_size", "num_groups", "group_size", "prefix_len", "max_response_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticSteps.{name}={getattr(self, name)}; give >= 1")

    def step(self, iteration: int) -> GroupBatch:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + iteration)
        low = max(1, self.max_response_len // 2)
        lengths = self._lengths(gen, low) if self.uniform_groups else None
        return GroupBatch(groups=[self._group(gen, low, lengths) for _ in range(self.num_groups)])

    def _lengths(self, gen: torch.Generator, low: int) -> torch.Tensor:
        low = self.max_response_len if self.fixed_response_len else low
        return torch.randint(low, self.max_response_len + 1, (self.group_size,), generator=gen)

    def _group(self, gen: torch.Generator, low: int, lengths=None) -> Group:
        prompt = torch.randint(0, self.vocab_size, (self.prefix_len,), generator=gen)
        lengths = self._lengths(gen, low) if lengths is None else lengths
        responses = [torch.randint(0, self.vocab_size, (int(n),), generator=gen) for n in lengths]
        rewards = torch.tensor([(r < self.vocab_size // 2).float().mean().item()
                                for r in responses])
        advantages = grpo_advantages(rewards)
        return Group(prefix=prompt, trajectories=[
            Trajectory(suffix=r, advantages=float(a),
                       old_logprobs=_logprobs_like(r, gen), ref_logprobs=_logprobs_like(r, gen))
            for r, a in zip(responses, advantages)])


def _logprobs_like(tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Log-probs around a random-init model's (~ -log V), so ratios stay near 1."""
    return -(7.0 + 0.1 * torch.rand(tokens.shape, generator=gen))


ReaderFactory = Callable[[str, object], StepSource]
_READERS: Dict[str, Tuple[ReaderFactory, Tuple[str, ...], Optional[Callable[[str], bool]]]] = {}
_BUILTIN_READER_MODULES: Sequence[str] = ("megatron_patches.megatron_lm.trace_source",)
"""Modules that register trace readers on import, tried when `--rl-trace` is given (the
project's own format, prefix_schedule/traces: `tools/trace.py` writes it)."""


def register_trace_reader(name: str, factory: ReaderFactory, extensions: Sequence[str] = (),
                          sniff: Optional[Callable[[str], bool]] = None) -> None:
    """Make `--rl-trace-format NAME` use `factory`, and files ending in one of `extensions` or
    for which `sniff(path)` is True (their content is this reader's format) too."""
    _READERS[name] = (factory, tuple(extensions), sniff)


def trace_readers() -> Dict[str, Tuple[str, ...]]:
    """name -> extensions of every registered reader (after importing the built-in ones)."""
    _import_builtin_readers()
    return {name: extensions for name, (_, extensions, _) in _READERS.items()}


def _import_builtin_readers() -> None:
    for module in _BUILTIN_READER_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module and not module.startswith(f"{error.name}."):
                raise


def _import_reader(fmt: str) -> ReaderFactory:
    module, _, attr = fmt.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as error:  # ValueError: ":make"
        raise ValueError(f"--rl-trace-format {fmt}: cannot load the reader "
                         f"({type(error).__name__}: {error}); give module:callable of an "
                         "importable module (on PYTHONPATH) "
                         f"or a registered reader ({sorted(_READERS) or 'none'})") from None
    if not callable(factory):
        raise ValueError(f"--rl-trace-format {fmt}: {attr} is not callable; give a factory "
                         "(path, args) -> source")
    return factory


def resolve_trace_reader(path: str, fmt: Optional[str]) -> ReaderFactory:
    """The reader of `path`: `fmt` (a registered name or module:callable), else the one reader
    that recognises the file's content, else the one whose extension it has; ValueError if the
    file is missing or no single reader fits."""
    if not os.path.exists(path):
        raise ValueError(f"--rl-trace {path}: no such file or directory")
    _import_builtin_readers()
    if fmt and ":" in fmt:
        return _import_reader(fmt)
    if fmt:
        if fmt not in _READERS:
            raise ValueError(f"--rl-trace-format {fmt!r} is not a registered trace reader "
                             f"({sorted(_READERS) or 'none registered'}); give one of them or "
                             "module:callable")
        return _READERS[fmt][0]
    matches = [factory for factory, _, sniff in _READERS.values() if sniff and sniff(path)]
    if not matches:
        matches = [factory for factory, exts, _ in _READERS.values()
                   if exts and path.endswith(exts)]
    if len(matches) != 1:
        raise ValueError(f"--rl-trace {path}: {'no' if not matches else 'more than one'} trace "
                         f"reader claims this file (by content or name); name one with "
                         f"--rl-trace-format (registered: {sorted(_READERS) or 'none'}; or "
                         "module:callable)")
    return matches[0]


def open_step_source(args) -> StepSource:
    """The trainer's source: `--rl-trace` through its reader, else `SyntheticSteps` from
    Megatron's --grpo-prompts-per-step / --grpo-group-size / --seed / --seq-length."""
    if args.rl_trace:
        return resolve_trace_reader(args.rl_trace, args.rl_trace_format)(args.rl_trace, args)
    prefix_len = args.rl_synthetic_prefix_len or max(1, args.seq_length * 3 // 4)
    response = args.rl_synthetic_max_response_len or args.seq_length - prefix_len
    if prefix_len + response > args.seq_length or response < 1:
        raise ValueError(f"--rl-synthetic-prefix-len {prefix_len} + --rl-synthetic-max-response-"
                         f"len {response} must be within --seq-length {args.seq_length} (and "
                         "leave room for at least one response token)")
    return SyntheticSteps(vocab_size=args.vocab_size or args.padded_vocab_size,
                          num_groups=args.grpo_prompts_per_step, group_size=args.grpo_group_size,
                          prefix_len=prefix_len, max_response_len=response, seed=args.seed,
                          uniform_groups=args.rl_synthetic_uniform_groups,
                          fixed_response_len=args.rl_synthetic_fixed_response_len)


def check_moe_tensor_parallel_rows(plan, local: GroupBatch, tp: int, dp_rank: int) -> None:
    """ValueError (before compute, on every rank alike: each checks every data-parallel rank's
    plan) unless each dense microbatch of the packing reuse equals holds rows of one length, a
    multiple of TP. Under sequence parallelism Megatron normalises each TP rank's aux-loss and
    z-loss terms by that rank's own valid tokens; reuse equals dense only when every TP rank
    holds as many (megatron_patches/runtime/moe.py [Note: MoE under sequence parallelism]). Applies to
    both runs (megatron_lm/trainer.py), so the dense baseline is the one reuse equals."""
    if tp == 1:
        return
    for mb in plan.microbatches:
        lengths = sorted({local.groups[s.group].context_len(s.trajectory) - 1
                          + local.groups[s.group].trajectories[s.trajectory].suffix.numel()
                          for s in mb.segments})
        if len(lengths) > 1 or lengths[0] % tp:
            raise ValueError(
                f"MoE with --tensor-model-parallel-size {tp}: microbatch {mb.index} of data-"
                f"parallel rank {dp_rank} holds [prompt; response] rows of {lengths} tokens; "
                f"reuse equals stock dense only when every microbatch's rows have one length, "
                f"a multiple of {tp} (Megatron normalises each TP rank's aux loss by its own "
                "valid tokens): give rows of one length (synthetic data: "
                "--rl-synthetic-fixed-response-len with --rl-synthetic-prefix-len + "
                f"--rl-synthetic-max-response-len - 1 a multiple of {tp}), or run MoE at TP=1 "
                "with expert parallelism")
