"""What the executor owes Megatron beyond the math (one process, PP=1).

- Every tensor the runtime creates lives on the model's device: run with a stand-in model on
  the "meta" device (the CPU is the default device here, as it is on a GPU node), the token
  count that reaches `finalize_model_grads` (which all-reduces it over NCCL) must be on the
  model's device with Megatron's dtype (torch.int, as its schedules create it).
- The policy forward step moves the host items to the model's device (as Megatron's get_batch).
- FP8: `set_is_first_microbatch` (what Megatron's forward_step calls so Transformer Engine
  recasts its FP8 weights) comes before the step's first forward, which is a prefix forward.
- `defer_embedding_wgrad_compute`: the buffer is cleared before the step and drained before
  `finalize_model_grads`, as in Megatron's schedules; a plan whose backwards do not follow the
  forwards' order on the last stage is refused before compute (the drain pairs them in order).
"""

import pytest
import torch

from test_equivalence import LOSS, make_batch

pytestmark = pytest.mark.megatron

TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
            num_query_groups=1, vocab_size=256, max_seq_len=128)


class _MetaStage(torch.nn.Module):
    """A one-stage 'model' whose parameters live on the meta device."""

    max_sequence_length, vocab_size = 64, 256  # what the executor checks the batch against

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.ones(3, device="meta"))

    def set_input_tensor(self, _tensors):
        pass

    def forward(self, rows):
        return self.weight.sum() * torch.ones(rows, device="meta")


def _meta_forward_step(data_iterator, model):
    item = next(data_iterator)
    rows = item["tokens"].shape[1]
    output = model(rows)

    def loss_func(out):
        return out.sum(), torch.tensor(rows, dtype=torch.int, device="meta"), {}

    return output, loss_func


def _meta_step(events, lowered_text=None, **config_overrides):
    """A reuse step (dense groups only: nothing cached) through the executor on the meta stage;
    `lowered_text` replaces the step's lowered schedule."""
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse
    from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config
    from prefix_schedule.pipeline import Schedule
    from prefix_schedule.pipeline.lowering import lower
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep

    config = make_transformer_config(TinyLlamaConfig(**TINY))
    for name, value in config_overrides.items():
        setattr(config, name, value)  # after validation: e.g. defer_embedding_wgrad at PP=1
    model = _MetaStage(config)
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    config.finalize_model_grads_func = lambda models, num_tokens, **_: events.append(
        ("finalize", num_tokens.device, num_tokens.dtype))
    batch = make_batch(5, [(1, [3, 4]), (1, [5])])  # prefix length 1: dense rows, no cache
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=5, max_seq_len=64))
    if lowered_text is not None:
        step.lowered = lower(Schedule.from_text(lowered_text))
    forward_backward_prefix_reuse(forward_step_func=_meta_forward_step, data_iterator=step,
                                  model=[model], num_microbatches=step.num_microbatches)
    return step


def test_runtime_tensors_follow_the_model_device(megatron_env):
    events = []
    _meta_step(events)
    assert events[-1] == ("finalize", torch.device("meta"), torch.int), events[-1]


def test_policy_forward_step_moves_items_to_the_model_device(megatron_env):
    from megatron_patches.rl import make_policy_forward_step
    from prefix_schedule.planning.inputs import build_suffix_inputs
    from prefix_schedule.planning.planner import plan_microbatches

    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1, device="meta"))

        def forward(self, tokens, position_ids, mask):
            seen.append((tokens.device, position_ids.device))
            return tokens

    batch = make_batch(6, [(6, [3])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=64)
    item = build_suffix_inputs(batch, plan.microbatches[0])
    make_policy_forward_step(LOSS)(iter([item]), Recorder())
    assert seen == [(torch.device("meta"), torch.device("meta"))]


def test_deferred_embedding_wgrad_is_cleared_and_drained(megatron_env, monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    events = []
    monkeypatch.setattr(schedules, "clear_embedding_activation_buffer",
                        lambda config, model, is_last: events.append(("clear", is_last)) or "emb")
    monkeypatch.setattr(schedules, "finish_embedding_wgrad_compute",
                        lambda config, module, is_last, tp: events.append(("drain", module)))
    _meta_step(events, defer_embedding_wgrad_compute=True)
    assert events[0] == ("clear", True) and events[-2] == ("drain", "emb"), events
    assert events[-1][0] == "finalize" and events.count("forward") == 3


def test_deferred_embedding_wgrad_refuses_backwards_out_of_forward_order(megatron_env):
    events = []
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        _meta_step(events, "0: 0SF0 0SF1 0SF2 0SB1 0SB0 0SB2\n",  # SB1 before SB0
                   defer_embedding_wgrad_compute=True)
    assert "forward" not in events


def test_step_first_forward_sets_is_first_microbatch(megatron_env):
    """Two steps: each begins with a prefix forward (Phase A); the FP8 recast flag must be set
    before it, once per step (Megatron's forward_step does it for the first microbatch)."""
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.context import PrefixForwardContext, current_context

    model = build_model(TinyLlamaConfig(**TINY))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    events = []
    model.set_is_first_microbatch = lambda: events.append("first")
    model.register_forward_pre_hook(lambda *_: events.append(
        "prefix" if isinstance(current_context(), PrefixForwardContext) else "suffix"))
    for seed in (7, 8):
        batch = make_batch(seed, [(12, [3, 4]), (9, [5])])
        reuse_step(model, batch, plan_microbatches(batch, token_budget=8, max_seq_len=64), LOSS)
        model.zero_grad(set_to_none=True)
    starts = [i for i, e in enumerate(events) if e == "first"]
    assert len(starts) == 2 and starts[0] == 0, events
    assert events[1] == "prefix" and events[starts[1] + 1] == "prefix", events


def test_model_chunks_must_match_the_planned_layout(megatron_env):
    """A step planned for one model chunk per rank, given two chunks (virtual stages), is refused
    before any compute, with the constructor call that fixes it."""
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse
    from megatron_patches.models.tiny import TinyLlamaConfig, make_transformer_config
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep

    events = []
    model = _MetaStage(make_transformer_config(TinyLlamaConfig(**TINY)))
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    batch = make_batch(5, [(1, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=5, max_seq_len=64))
    with pytest.raises(ValueError, match="num_model_chunks=1"):
        forward_backward_prefix_reuse(forward_step_func=_meta_forward_step, data_iterator=step,
                                      model=[model, model], num_microbatches=step.num_microbatches)
    assert not events
