"""What Nemotron-H's squared-ReLU MLP (`-`, no gate) and its attention without RoPE (`*`,
position_embedding_type "none") save, against the saved-tensor accounting
(prefix_schedule.runtime.memory) of real Megatron HybridModel layers on CPU (fp32): each `-` and
`*` layer forward of a dense step and a reuse step equals ActivationModel's count to the byte
(act x (3h + 2f) + fp32 for the MLP; [Note: attention without RoPE] in memory_model_layers.py
for attention: GQA 4:1, whose query reshape copies q, MHA and MQA, which keep a view; a prefix
row stopping at its K/V keeps the input norm and the fused QKV output, K included). Then the
`nemotron-h-8b-tiny` twin (M-M*M-, mamba-ssm's saved-tensor fakes: tests/mamba_saved_fake.py)
as tools/capacity.py maps it: its parameter count equals static_bytes' and its dense peak and
reuse suffix-phase and step peaks are within 10% of the measured bytes, with and without
offload. Dense attention is torch's fused SDPA (FusedSDPACoreAttention), as the model assumes."""
import dataclasses

import pytest
import torch

from prefix_schedule.losses import PolicyLossConfig
from tools_import import tool

pytestmark = pytest.mark.megatron

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
TINY = "nemotron-h-8b-tiny"


def _build(spec, monkeypatch):
    """Our HybridModel of Nemotron-H `spec` (test_hf_checkpoints_nemotron's: squared ReLU, no
    positions), fp32, with fused SDPA as its dense core attention."""
    from megatron_patches.models import hybrid
    from megatron_patches.models.tiny import FusedSDPACoreAttention
    from megatron_patches.training import scale_grads_by_token_count
    from test_hf_checkpoints_nemotron import megatron_model

    local_spec = hybrid.get_gpt_layer_local_spec

    def fused_spec(*args, **kwargs):
        spec_ = local_spec(*args, **kwargs)
        spec_.submodules.self_attention.submodules.core_attention = FusedSDPACoreAttention
        return spec_

    monkeypatch.setattr(hybrid, "get_gpt_layer_local_spec", fused_spec)
    model = megatron_model(spec, dtype=torch.float32)
    monkeypatch.setattr(hybrid, "get_gpt_layer_local_spec", local_spec)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


def _layer_records(model, batch, plan):
    """(action kind, "*" or "-", row tokens, device bytes the layer forward added) per attention
    and MLP layer forward of a dense step and a reuse step."""
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.runtime.memory import DeviceMemoryMeter, watch_step
    from prefix_schedule.runtime.step import ReuseStep

    records, state = [], {}

    def before(module, args, kwargs):
        state["start"] = state["meter"].device_bytes()
        state["tokens"] = (args[0] if args else kwargs["hidden_states"]).shape[0]

    def after(module, args, output):
        symbol = "-" if isinstance(module, MLPLayer) else "*"
        records.append((state["kind"], symbol, state["tokens"],
                        state["meter"].device_bytes() - state["start"]))

    layers = [m for m in model.modules() if type(m) in (TransformerLayer, MLPLayer)]
    handles = [h for m in layers for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                           m.register_forward_hook(after, always_call=True))]
    try:
        state["kind"] = "dense"
        with DeviceMemoryMeter(exclude=list(model.parameters())) as state["meter"]:
            dense_step(model, batch, LOSS)
        step = ReuseStep(batch, plan)
        state["meter"] = DeviceMemoryMeter(exclude=list(model.parameters()))
        watch_step(step, state["meter"])
        step.observers.append((lambda action: state.update(kind=action and action.kind.value),
                               lambda microbatch: None))
        with state["meter"]:
            reuse_step(model, batch, plan, LOSS, step=step)
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return records


@pytest.mark.parametrize("groups", [2, 8, 1], ids=["gqa-4:1", "mha", "mqa"])
def test_mlp_and_attention_layers_save_what_the_model_counts(megatron_env, monkeypatch, groups):
    from prefix_schedule.planning.memory_model import ActivationModel
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import make_batch

    capacity = tool("capacity")
    spec = dataclasses.replace(capacity.MODELS[TINY], num_layers=2, hybrid_layer_pattern="*-",
                               num_query_groups=groups)
    model = _build(spec, monkeypatch)
    counted = capacity.activation_models(spec, capacity.Layout(), act_bytes=4)[0]
    assert isinstance(counted, ActivationModel) and counted.rotary_percent == 0
    assert counted._query_copied() == (groups == 2)
    batch = make_batch(3, [(33, [6, 9, 4]), (20, [7, 5])], vocab=spec.vocab_size)
    plan = plan_microbatches(batch, token_budget=20, max_seq_len=256)
    records = _layer_records(model, batch, plan)
    per_token = {("dense", "*"): counted.attention(), ("SF", "*"): counted.mixer("*", "suffix"),
                 # the prefix stops at its only attention layer's K/V: input norm, fused QKV
                 ("PF", "*"): counted.dormant_layers(), **{
                     (kind, "-"): counted.mlp("-") for kind in ("dense", "PF", "SF")}}
    assert {(kind, symbol) for kind, symbol, _, _ in records} == set(per_token) - {("PF", "-")}
    for kind, symbol, tokens, measured in records:
        assert measured == tokens * per_token[kind, symbol], (kind, symbol, tokens)
    h, f, q, kv = 64, 160, 64, 8 * groups
    assert counted.mlp("-") == 4 * (3 * h + 2 * f) + 4  # a SwiGLU MLP would save 5 f
    assert counted.attention() == 4 * (3 * h + 2 * q + 2 * kv + (q if groups == 2 else 0)) + 4 * 9


def test_nemotron_tiny_peaks_match_measured_bytes(megatron_env, monkeypatch):
    import mamba_saved_fake
    from prefix_schedule.planning.memory_model import (MemoryOptions, dense_peak_bytes,
                                                       reuse_phase_peaks)
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from megatron_patches.training import dense_step, reuse_step
    from test_equivalence import make_batch

    capacity, probe = tool("capacity"), tool("memory_probe")
    spec = capacity.MODELS[TINY]
    model = _build(spec, monkeypatch)
    params = sum(p.numel() for p in model.parameters())
    assert capacity.static_bytes(spec, capacity.Layout(dp=1))["weights"] == 2 * params
    mamba_saved_fake.install(monkeypatch)
    counted = capacity.activation_models(spec, capacity.Layout(), act_bytes=4)[0]
    for prefix, suffix, group, budget in ((200, 40, 3, 40), (220, 20, 4, 80)):
        batch = make_batch(3, [(prefix, [suffix] * group)], vocab=spec.vocab_size)
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=256)
        dense = probe.measure_dense(model, lambda: dense_step(model, batch, LOSS))
        model.zero_grad(set_to_none=True)
        predicted = dense_peak_bytes(counted, [prefix + suffix - 1])
        where = f"P={prefix} n={suffix} G={group}"
        print(f"{TINY} dense {where}: predicted / measured "
              f"{predicted / dense.peak_saved_bytes:.3f}")
        assert predicted == pytest.approx(dense.peak_saved_bytes, rel=0.10), where
        for offload in (False, True):
            step = ReuseStep(batch, plan, offload_prefix_activations=offload)
            reuse = probe.measure_reuse(model, step,
                                        lambda s: reuse_step(model, batch, plan, LOSS, step=s))
            model.zero_grad(set_to_none=True)
            peaks = reuse_phase_peaks(counted, plan, MemoryOptions(offload=offload))
            print(f"{TINY} reuse {where} offload={offload}: predicted / measured suffix phase "
                  f"{peaks['suffix'] / reuse.suffix_phase_peak_bytes:.3f}, step "
                  f"{peaks['step'] / reuse.peak_saved_bytes:.3f}")
            assert peaks["suffix"] == pytest.approx(reuse.suffix_phase_peak_bytes, rel=0.10), \
                (where, offload)
            assert peaks["step"] == pytest.approx(reuse.peak_saved_bytes, rel=0.10), \
                (where, offload)
