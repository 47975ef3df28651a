"""What Gated DeltaNet layers save for backward (planning/memory_model_gdn.py, [Note: GDN saved
tensors]) against the saved-tensor accounting (prefix_schedule.runtime.memory) of real Megatron
GDN layers run with fakes of fla 0.6.0's Functions that save what the real ones save
(tests/fla_saved_fake.py): one layer to the byte (fp32), every GDN mixer of a tiny model's dense
and reuse steps to the byte, and a fake saving one tensor more or less breaks the equality."""
import dataclasses
import math

import pytest
import torch

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model import ActivationModel
from prefix_schedule.planning.memory_model_gdn import FLA_CHUNK, gdn_mixer_bytes

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)
DIMS = ModelDims(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, gated_linear_unit=True,
                 linear_attention_freq=2, **GDN)


def test_formula_by_hand():
    m = gdn_mixer_bytes(DIMS, 2)
    h, qk, vd, hv, hk = 64, 32, 64, 4, 2
    norm, conv = 2 * 3 * h + 4, 2 * (2 * qk + 2 * vd + 2 * hv)
    l2, gates = 2 * 2 * qk + 4 * 2 * hk, 4 * 2 * hv + 2 * hv
    rule = 2 * (2 * hv * 16 + vd + 64 * hv) + 4 * hv
    out = 2 * 4 * vd + 4 * (hv + 2 * vd)
    assert m.to_state_per_token == norm + conv + l2 + gates + rule
    assert m.per_token == m.to_state_per_token + out and m.per_sequence == 2 * 2 * hv
    # reuse: the larger of a prefix row's torch conv per segment and a suffix row's varlen fla
    # conv per token, a [D, W] conv state (W = 4) and the rule's state per sequence
    r = gdn_mixer_bytes(DIMS, 2, reuse=True)
    assert r.per_token - m.per_token == max(2 * 2 * (2 * qk + vd), conv) - conv + 16 / 64
    assert r.per_sequence == 4 * hv * 16 * 16 + 2 * 4 * (2 * qk + vd) + 32 + 2 * 2 * hv
    with pytest.raises(ValueError, match="linear_"):
        gdn_mixer_bytes(dataclasses.replace(DIMS, linear_num_value_heads=0), 2)
    with pytest.raises(ValueError, match="act_bytes"):
        gdn_mixer_bytes(DIMS, 0)


class _MixerMeter:
    """A DeviceMemoryMeter that also sums the bytes of every storage first saved inside a GDN
    layer's mixer half (its input norm through out_proj), per GDN forward."""

    def __init__(self, model):
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
        from prefix_schedule.runtime.memory import DeviceMemoryMeter

        outer = self
        self.inside, self.forwards = False, []  # per GDN forward: [bytes, completed]

        class Meter(DeviceMemoryMeter):
            def pack(self, tensor):
                from prefix_schedule.runtime.memory import storage_key

                key, nbytes = storage_key(tensor)
                if outer.inside and key not in self._live and key not in self._excluded:
                    outer.forwards[-1][0] += nbytes
                return super().pack(tensor)

        self.meter = Meter(exclude=list(model.parameters()))
        self.handles = []
        for layer in model.modules():  # GPTModel's and HybridModel's GDN layers
            if isinstance(getattr(layer, "self_attention", None), GatedDeltaNet):
                self.handles += [
                    layer.input_layernorm.register_forward_pre_hook(self._enter),
                    layer.self_attention.register_forward_hook(self._done),
                    layer.self_attention.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, *_):
        self.inside = True
        self.forwards.append([0, False])

    def _done(self, *_):
        self.forwards[-1][1] = True

    def _leave(self, *_):
        self.inside = False

    def close(self):
        for handle in self.handles:
            handle.remove()


def _exact(dims, a, tokens, lengths, *, reuse, completed=True, varlen_conv=False):
    """The bytes the fakes make the layer save for one call: the formula's per-token terms, and
    the per-sequence ones as they are (chunk indices rounded up per sequence, cu_seqlens and
    exp(A_log) once per call). Reuse rows save the conv of their path: a suffix row's varlen fla
    call (`varlen_conv`) keeps the in_proj output view and one [D, W] initial state per sequence;
    a prefix row's torch conv per segment keeps [tail; x] and the SiLU output."""
    m = gdn_mixer_bytes(dims, a, reuse=reuse)
    per_token = m.per_token if completed else m.to_state_per_token
    hv = dims.linear_num_value_heads
    per_call = 2 * a * hv
    if not reuse:
        return per_token * tokens + per_call
    qk = dims.linear_num_key_heads * dims.linear_key_head_dim
    vd = hv * dims.linear_value_head_dim
    channels, width = 2 * qk + vd, dims.linear_conv_kernel_dim
    fla_conv, torch_conv = a * (2 * qk + 2 * vd + 2 * hv), a * 2 * channels
    conv = fla_conv if varlen_conv else torch_conv
    state = 4 * hv * dims.linear_key_head_dim * dims.linear_value_head_dim
    tail = a * channels * (width if varlen_conv else width - 1)
    indices = 16 * sum(math.ceil(n / FLA_CHUNK) for n in lengths)
    exact = (per_token - max(fla_conv, torch_conv) + conv - 16 / FLA_CHUNK) * tokens + \
        len(lengths) * (state + tail) + 8 * (len(lengths) + 1) + indices + per_call
    assert exact <= per_token * tokens + m.per_sequence * len(lengths)  # the model's bound
    return exact


def _model(layers, dtype=torch.float32):
    from megatron_patches.models.gdn import build_gdn_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=len(layers), hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512, params_dtype=dtype)
    model = build_gdn_model(cfg, linear_attention_freq=layers)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


@pytest.fixture(scope="module")
def gdn_model(megatron_env):
    import fla_saved_fake

    model = _model([1, 0, 1])  # GDN, attention, GDN: a prefix's last layer stops at its state
    with fla_saved_fake.installed([model]):
        yield model


def _layer_bytes(model, tokens):
    from prefix_schedule.runtime.memory import DeviceMemoryMeter

    layer = model.decoder.layers[0]
    x = torch.randn(tokens, 1, 64, requires_grad=True)
    with DeviceMemoryMeter(exclude=list(model.parameters())) as meter:
        out, _ = layer(x, attention_mask=None)
    return meter.saved_bytes, out


@pytest.mark.megatron
@pytest.mark.parametrize("tokens", [10, 70])
def test_one_gdn_layer_saves_what_the_formula_says(gdn_model, tokens):
    """A whole GDN layer (mixer half + MLP half), dense, fp32: measured == predicted."""
    import fla_saved_fake

    before = dict(fla_saved_fake.calls)
    measured, out = _layer_bytes(gdn_model, tokens)
    out.sum().backward()  # the fakes' backward runs
    assert all(fla_saved_fake.calls[k] == before[k] + 1 for k in before), "fla fakes not called"
    predicted = _exact(DIMS, 4, tokens, [tokens], reuse=False) + \
        tokens * ActivationModel(dims=DIMS, act_bytes=4).mlp()
    assert measured == predicted
    gdn_model.zero_grad(set_to_none=True)


@pytest.mark.megatron
@pytest.mark.parametrize("change", ["one more", "one less"])
def test_a_fake_saving_one_tensor_more_or_less_breaks_the_equality(gdn_model, change):
    import fla_saved_fake

    def mutate(saved):
        if change == "one more":  # fla would keep g as given as well
            return saved + (saved[5].clone(),)
        return saved[:8] + (None,) + saved[9:]  # no A

    fla_saved_fake.mutate = mutate
    try:
        measured, _ = _layer_bytes(gdn_model, 10)
    finally:
        fla_saved_fake.mutate = None
    predicted = _exact(DIMS, 4, 10, [10], reuse=False) + \
        10 * ActivationModel(dims=DIMS, act_bytes=4).mlp()
    assert measured == predicted + (40 * 4 if change == "one more" else -4 * 10 * 4 * 64)


HYBRID = "G*-G-"  # HybridModel: the last mixer (GDN) is followed by an MLP layer


@pytest.fixture(scope="module")
def hybrid_model(megatron_env):
    import fla_saved_fake
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    model = build_hybrid_model(cfg, HYBRID, **GDN)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    with fla_saved_fake.installed([model]):
        yield model


@pytest.mark.megatron
@pytest.mark.parametrize("kind", ["dense", "reuse", "hybrid dense", "hybrid reuse"])
def test_every_gdn_mixer_of_a_step_saves_what_the_formula_says(request, kind):
    """A tiny model's whole step (fp32): each GDN mixer's forward saves the predicted bytes, in
    dense rows and in reuse rows (packed groups from their own states; prefix rows, whose last
    mixer stops once its state is made, to_state_per_token); a GPTModel (GDN, attention, GDN)
    and a HybridModel (`G*-G-`)."""
    import fla_saved_fake
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.memory import watch_step
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import make_batch

    gdn_model = request.getfixturevalue("hybrid_model" if "hybrid" in kind else "gdn_model")
    kind = kind.split()[-1]
    batch = make_batch(11, [(33, [6, 9, 4]), (70, [8, 3])])
    probe = _MixerMeter(gdn_model)
    fla_saved_fake.rows.clear()
    fla_saved_fake.varlen_conv.clear()
    try:
        if kind == "dense":
            with probe.meter:
                dense_step(gdn_model, batch, LOSS)
        else:
            plan = plan_microbatches(batch, token_budget=20, max_seq_len=512)
            step = ReuseStep(batch, plan)
            watch_step(step, probe.meter)
            with probe.meter:
                reuse_step(gdn_model, batch, plan, LOSS, step=step)
    finally:
        probe.close()
        gdn_model.zero_grad(set_to_none=True)
    calls = list(fla_saved_fake.rows)
    assert len(calls) == len(probe.forwards) > 0
    if kind == "reuse":
        assert any(len(lengths) > 1 for _, lengths in calls), "a packed row must hold several"
        assert not all(done for _, done in probe.forwards), "a prefix must stop at a state"
    varlen = list(fla_saved_fake.varlen_conv)  # suffix rows: the hook's varlen fla conv
    assert len(varlen) == len(calls) and any(varlen) == (kind == "reuse")
    for (tokens, lengths), (measured, done), var in zip(calls, probe.forwards, varlen):
        assert measured == _exact(DIMS, 4, tokens, lengths, reuse=kind == "reuse",
                                  completed=done, varlen_conv=var), (tokens, lengths, done, var)


def _qwen_like(recompute):
    """GDN, gated attention (partial RoPE), GDN; the dense twin's attention through fused SDPA
    (the accounting model's attention, no s^2 term) on the same parameters."""
    from megatron.core.transformer.attention import Attention
    from megatron_patches.models.gdn import build_gdn_model
    from megatron_patches.models.tiny import FusedSDPACoreAttention, TinyLlamaConfig
    from megatron_patches.training import scale_grads_by_token_count

    options = (dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1) if recompute == "full" else {})
    cfg = TinyLlamaConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=1024)
    model = build_gdn_model(cfg, linear_attention_freq=2, attention_output_gate=True,
                            rotary_percent=0.5, **options)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    dense = build_gdn_model(cfg, linear_attention_freq=2, attention_output_gate=True,
                            rotary_percent=0.5, **options)
    dense.load_state_dict(model.state_dict())
    dense.config.finalize_model_grads_func = scale_grads_by_token_count
    for m in dense.modules():
        if isinstance(m, Attention):
            m.core_attention = FusedSDPACoreAttention(m.config, m.layer_number, None, None)
    return model, dense


@pytest.mark.megatron
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_step_predictions_of_a_gdn_hybrid_match_measured_bytes(megatron_env, recompute):
    """The accounting model of the Qwen3.5-like tiny hybrid (fp32, with the fla fakes) within
    10% of the measured bytes, as tests/test_memory_model.py holds attention models: dense
    peak (recompute none and full), reuse suffix phase and whole step, with and without
    offload; and reuse under full recompute (docs/DESIGN.md [Note: prefix full recompute])."""
    import fla_saved_fake
    from megatron_patches.training import dense_step, reuse_step
    from prefix_schedule.planning.memory_model import (MemoryOptions, dense_peak_bytes,
                                                       reuse_phase_peaks)
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import make_batch
    from tools_import import tool

    probe = tool("memory_probe")
    dims = dataclasses.replace(DIMS, attention_output_gate=True)
    model = ActivationModel(dims=dims, act_bytes=4, rotary_percent=0.5)
    local, fused = _qwen_like(recompute)
    offloads = [False, True] if recompute == "none" else [False]  # offload excludes full
    with fla_saved_fake.installed([local, fused]):
        for prefix, suffix, group, budget in ((200, 40, 3, 40), (400, 80, 2, 160),
                                              (300, 20, 4, 80)):
            batch = make_batch(3, [(prefix, [suffix] * group)])
            plan = plan_microbatches(batch, token_budget=budget, max_seq_len=1024)
            dense = probe.measure_dense(fused, lambda: dense_step(fused, batch, LOSS))
            predicted = dense_peak_bytes(model, [prefix + suffix - 1], recompute)
            print(f"dense P={prefix} n={suffix}: predicted / measured "
                  f"{predicted / dense.peak_saved_bytes:.3f}")
            assert predicted == pytest.approx(dense.peak_saved_bytes, rel=0.10)
            for offload in offloads:
                step = ReuseStep(batch, plan, offload_prefix_activations=offload)
                reuse = probe.measure_reuse(
                    local, step, lambda s: reuse_step(local, batch, plan, LOSS, step=s))
                peaks = reuse_phase_peaks(model, plan, MemoryOptions(offload=offload,
                                                                     recompute=recompute))
                where = f"P={prefix} n={suffix} G={group} offload={offload}"
                print(f"reuse {where}: predicted / measured suffix phase "
                      f"{peaks['suffix'] / reuse.suffix_phase_peak_bytes:.3f}, step "
                      f"{peaks['step'] / reuse.peak_saved_bytes:.3f}")
                assert peaks["suffix"] == pytest.approx(reuse.suffix_phase_peak_bytes,
                                                        rel=0.10), where
                assert peaks["step"] == pytest.approx(reuse.peak_saved_bytes, rel=0.10), where
            local.zero_grad(set_to_none=True)
            fused.zero_grad(set_to_none=True)


def test_budget_planner_takes_full_recompute_for_gdn_gptmodels_and_hybridmodels():
    """Reuse runs full recompute with GDN layers in a GPTModel (tests/test_gdn_recompute.py) and
    in a HybridModel (tests/test_hybrid_recompute.py), so the planner may choose it for both;
    under a budget below the plain step's peak it fits the budget."""
    from prefix_schedule.planning.memory_model import MemoryOptions
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import make_batch

    batch = make_batch(3, [(120, [20, 24, 16]), (90, [18, 30])])
    full = [MemoryOptions(recompute="full")]
    hybrid = dataclasses.replace(DIMS, num_layers=len(HYBRID), hybrid_pattern=HYBRID,
                                 linear_attention_freq=None)
    for dims in (DIMS, hybrid):
        model = ActivationModel(dims=dims, act_bytes=4)
        plan = plan_microbatches(batch, token_budget=64, max_seq_len=512,
                                 memory_budget_bytes=10 ** 9, memory_model=model,
                                 memory_options=full)
        assert plan.memory.options.recompute == "full"
        plain = plan_microbatches(batch, token_budget=64, max_seq_len=512,
                                  memory_budget_bytes=10 ** 9, memory_model=model)
        budget = int(plain.memory.peaks["step"] * 0.7)
        plan = plan_microbatches(batch, token_budget=64, max_seq_len=512,
                                 memory_budget_bytes=budget, memory_model=model)
        assert plan.memory.peaks["step"] <= budget


@pytest.mark.megatron
def test_reuse_predictions_of_a_hybrid_model_match_measured_bytes(hybrid_model):
    """HybridModel `G*-G-` (fp32, fla fakes): the reuse suffix phase and step within 10% of the
    measured bytes, with and without offload (the dense twin's local attention saves its s^2
    scores, which the model leaves out: not compared here)."""
    from megatron_patches.training import reuse_step
    from prefix_schedule.planning.memory_model import MemoryOptions, reuse_phase_peaks
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import make_batch
    from tools_import import tool

    dims = dataclasses.replace(DIMS, num_layers=len(HYBRID), hybrid_pattern=HYBRID,
                               linear_attention_freq=None)
    model = ActivationModel(dims=dims, act_bytes=4)
    assert (model.num_mixers("G"), model.num_mixers("*")) == (2, 1)
    for prefix, suffix, group, budget in ((200, 40, 3, 40), (300, 20, 4, 80)):
        batch = make_batch(3, [(prefix, [suffix] * group)])
        plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512)
        for offload in (False, True):
            step = ReuseStep(batch, plan, offload_prefix_activations=offload)
            reuse = tool("memory_probe").measure_reuse(
                hybrid_model, step, lambda s: reuse_step(hybrid_model, batch, plan, LOSS, step=s))
            hybrid_model.zero_grad(set_to_none=True)
            peaks = reuse_phase_peaks(model, plan, MemoryOptions(offload=offload))
            where = f"P={prefix} n={suffix} G={group} offload={offload}"
            print(f"hybrid reuse {where}: predicted / measured suffix phase "
                  f"{peaks['suffix'] / reuse.suffix_phase_peak_bytes:.3f}, step "
                  f"{peaks['step'] / reuse.peak_saved_bytes:.3f}")
            assert peaks["suffix"] == pytest.approx(reuse.suffix_phase_peak_bytes, rel=0.10), where
            assert peaks["step"] == pytest.approx(reuse.peak_saved_bytes, rel=0.10), where
