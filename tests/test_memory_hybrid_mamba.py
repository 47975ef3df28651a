"""The accounting model on a HybridModel with Mamba-2, Gated DeltaNet and attention layers
(`G*M-`): ActivationModel counts each mixer by its kind (memory_model_layers.MIXER_BYTES: GDN by
memory_model_gdn, Mamba-2 by memory_model_mamba's reuse path in reuse rows), the state caches per
prefix unit. Measured with both GPU libraries' saved-tensor fakes installed (tests/
fla_saved_fake.py, tests/mamba_saved_fake.py: what fla 0.6.0 and mamba-ssm 2.3.2 / causal-conv1d
1.7.0 save), fp32: the reuse suffix-phase and step peaks within 10% of the bytes the saved-tensor
accounting counts, with and without offload (as tests/test_memory_gdn.py holds GDN hybrids)."""
import dataclasses

import pytest

from prefix_schedule.losses import PolicyLossConfig
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.memory_model import ActivationModel, MemoryOptions

pytestmark = pytest.mark.megatron

LOSS = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)
MAMBA = dict(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=8)
PATTERN = "G*M-"


def test_mamba_layers_are_counted_by_kind():
    dims = ModelDims(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, gated_linear_unit=True, hybrid_pattern=PATTERN,
                     mamba_conv_kernel_dim=4, **GDN, **MAMBA)
    model = ActivationModel(dims=dims, act_bytes=2)
    assert [m for m, _ in model.kinds()] == ["G", "*", "M", None]
    without = ActivationModel(dims=dataclasses.replace(dims, hybrid_pattern="G*--"), act_bytes=2)
    assert model.layers_bytes("suffix") > without.layers_bytes("suffix")  # M saves more than -
    assert model.state_unit() > without.state_unit()  # its SSD state and conv tail


def test_reuse_peaks_of_a_mamba_hybrid_match_measured_bytes(megatron_env, monkeypatch):
    import fla_saved_fake
    import mamba_saved_fake
    from megatron_patches.models.hybrid import build_hybrid_model
    from megatron_patches.models.tiny import TinyLlamaConfig
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.planning.memory_model import reuse_phase_peaks
    from prefix_schedule.planning.planner import plan_microbatches
    from prefix_schedule.runtime.step import ReuseStep
    from test_equivalence import make_batch
    from tools_import import tool

    cfg = TinyLlamaConfig(num_layers=0, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=256,
                          max_seq_len=512)
    hybrid = build_hybrid_model(cfg, PATTERN, **GDN, **MAMBA)
    hybrid.config.finalize_model_grads_func = scale_grads_by_token_count
    mamba_saved_fake.install(monkeypatch)
    dims = ModelDims(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, gated_linear_unit=True, hybrid_pattern=PATTERN,
                     mamba_conv_kernel_dim=4, **GDN, **MAMBA)
    model = ActivationModel(dims=dims, act_bytes=4)
    with fla_saved_fake.installed([hybrid]):
        for prefix, suffix, group, budget in ((200, 40, 3, 40), (300, 20, 4, 80)):
            batch = make_batch(3, [(prefix, [suffix] * group)])
            plan = plan_microbatches(batch, token_budget=budget, max_seq_len=512)
            for offload in (False, True):
                step = ReuseStep(batch, plan, offload_prefix_activations=offload)
                reuse = tool("memory_probe").measure_reuse(
                    hybrid, step, lambda s: reuse_step(hybrid, batch, plan, LOSS, step=s))
                hybrid.zero_grad(set_to_none=True)
                peaks = reuse_phase_peaks(model, plan, MemoryOptions(offload=offload))
                where = f"P={prefix} n={suffix} G={group} offload={offload}"
                print(peaks, reuse.phase_peaks)
                print(f"{PATTERN} reuse {where}: predicted / measured suffix phase "
                      f"{peaks['suffix'] / reuse.suffix_phase_peak_bytes:.3f}, step "
                      f"{peaks['step'] / reuse.peak_saved_bytes:.3f}")
                assert peaks["suffix"] == pytest.approx(reuse.suffix_phase_peak_bytes,
                                                        rel=0.10), where
                assert peaks["step"] == pytest.approx(reuse.peak_saved_bytes, rel=0.10), where
