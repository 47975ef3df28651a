"""Every TransformerConfig field classified for prefix reuse (megatron_patches/config/config_support.py):
the table covers the dataclass exactly, refused values are ValueErrors before compute, supported
options keep reuse equal to dense, and build_model honours or refuses what it is given."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from prefix_schedule.planning.planner import plan_microbatches
from prefix_schedule.runtime.step import ReuseStep
from test_equivalence import LOSS as LOSS_, assert_equal_step, make_batch, run_both

pytestmark = pytest.mark.megatron

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=512)


def _config_cls():
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig


def _model(fused_attention=False, **overrides):
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import scale_grads_by_token_count

    model = build_model(TinyLlamaConfig(**SMALL), fused_attention=fused_attention, **overrides)
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    return model


def test_every_transformer_config_field_is_classified(megatron_env):
    """Fails listing the fields a newer Megatron added (classify them in config_support.py)
    and the stale names of fields it removed."""
    from megatron_patches.config.config_support import FIELD_RULES, unclassified_fields

    cls = _config_cls()
    assert unclassified_fields(cls) == [], "unclassified TransformerConfig fields"
    names = {f.name for f in dataclasses.fields(cls)}
    assert sorted(set(FIELD_RULES) - names) == [], "classified fields that no longer exist"
    assert {r.kind for r in FIELD_RULES.values()} == {"supported", "irrelevant", "refused"}
    for name, rule in FIELD_RULES.items():
        assert rule.why, name
        if rule.kind == "refused":
            assert rule.allowed is not None and rule.fix, name


def test_each_refused_value_is_a_value_error_naming_the_field(megatron_env):
    from megatron_patches.config.config_support import FIELD_RULES, check_config_supported

    config = _model().config
    check_config_supported(config)  # the test models' settings pass
    for name, rule in FIELD_RULES.items():
        if rule.allowed is None:
            continue
        assert rule.allowed(getattr(config, name)), f"{name}: the default config is refused"
        bad = copy.copy(config)
        object.__setattr__(bad, name, rule.example)
        with pytest.raises(ValueError, match=name):
            check_config_supported(bad)


def test_an_unclassified_field_is_refused_unless_default(megatron_env):
    from megatron_patches.config.config_support import check_config_supported

    @dataclasses.dataclass
    class NewerConfig(_config_cls()):
        shiny_new_attention: bool = False

    config = _model().config
    newer = NewerConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                           if f.init and not f.name.startswith("_")})
    check_config_supported(newer)
    newer.shiny_new_attention = True
    with pytest.raises(ValueError, match="shiny_new_attention=True is not classified"):
        check_config_supported(newer)


def _call_reuse(model, step):
    from megatron_patches.runtime.executor import forward_backward_prefix_reuse
    from megatron_patches.rl import make_policy_forward_step
    from test_equivalence import LOSS

    calls = []

    def forward_step(it, m):
        calls.append(1)
        return make_policy_forward_step(LOSS)(it, m)

    with pytest.raises(ValueError) as info:
        forward_backward_prefix_reuse(forward_step_func=forward_step, data_iterator=step,
                                      model=[model], num_microbatches=step.num_microbatches)
    assert not calls, "compute ran before the input was refused"
    return str(info.value)


@pytest.mark.parametrize("override", [
    dict(window_size=(4, 2)),
    dict(softmax_type="off-by-one"),
    dict(apply_query_key_layer_scaling=True),
    dict(fp32_residual_connection=True),
])
def test_real_models_with_refused_options_fail_before_compute(megatron_env, override):
    model = _model(**override)
    batch = make_batch(9, [(10, [3, 4])])
    step = ReuseStep(batch, plan_microbatches(batch, token_budget=8, max_seq_len=512))
    assert next(iter(override)) in _call_reuse(model, step)


VARIANTS = {
    "add_bias_linear": dict(add_bias_linear=True),
    "add_qkv_bias": dict(add_qkv_bias=True),
    "gated_linear_unit/activation_func": dict(gated_linear_unit=False, activation_func=F.gelu),
    "normalization": dict(normalization="LayerNorm"),
    "qk_l2_norm": dict(qk_l2_norm=True),
    "rotary_interleaved": dict(rotary_interleaved=True),
    "softmax_scale": dict(softmax_scale=0.7),
    "apply_residual_connection_post_layernorm": dict(apply_residual_connection_post_layernorm=True),
    "attention_output_gate": dict(attention_output_gate=True),
    "recompute_modules": dict(recompute_granularity="selective",
                              recompute_modules=["core_attn", "mlp"]),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_supported_option_reuse_equals_dense(megatron_env, name):
    model = _model(**VARIANTS[name])
    with torch.no_grad():  # leave init: biases 0 and norm weights 1 would hide them
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = make_batch(4, [(17, [5, 3, 6]), (1, [4]), (9, [1, 2])])
    assert_equal_step(*run_both(model, batch, 8, run_singletons_dense=False)[:4])


def test_every_supported_variant_is_classified_as_supported(megatron_env):
    from megatron_patches.config.config_support import FIELD_RULES

    for overrides in VARIANTS.values():
        for field in overrides:
            assert FIELD_RULES[field].kind == "supported", field


def test_build_model_honours_qk_layernorm_and_rope_options(megatron_env):
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_patches.models.tiny import TinyLlamaConfig, build_model

    model = _model(qk_layernorm=True)  # as a TransformerConfig override too
    attention = model.decoder.layers[0].self_attention
    assert not isinstance(attention.q_layernorm, IdentityOp)
    assert attention.q_layernorm.weight.shape == (SMALL["hidden_size"] // 4,)
    qwen = build_model(TinyLlamaConfig(**{**SMALL, "kv_channels": 24, "rotary_base": 1e6}))
    assert qwen.config.kv_channels == 24
    assert qwen.rotary_pos_emb.inv_freq.shape == (12,)
    assert float(qwen.rotary_pos_emb.inv_freq[1]) == pytest.approx(1e6 ** (-2 / 24), rel=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(qk_layernorm=True, qk_l2_norm=True), "exclusive"),
    (dict(fused_attention=True, window_size=(4, 0)), "window_size"),
    (dict(fused_attention=True, apply_query_key_layer_scaling=True),
     "apply_query_key_layer_scaling"),
])
def test_build_model_refuses_what_its_spec_cannot_build(megatron_env, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _model(**kwargs)


@pytest.mark.parametrize("shape, message", [
    (dict(kv_channels=7), "even head dim"),
    (dict(rotary_base=0), "rotary_base"),
    (dict(rope_scaling_factor=0.5), "rope_scaling_factor"),
    (dict(hidden_size=66), "kv_channels"),
])
def test_tiny_config_refuses_impossible_shapes(megatron_env, shape, message):
    from megatron_patches.models.tiny import TinyLlamaConfig

    with pytest.raises(ValueError, match=message):
        TinyLlamaConfig(**{**SMALL, **shape})


def test_mla_config_fields_are_classified_and_cross_field_rules_refused(megatron_env):
    """MLATransformerConfig's own fields (MLA_RULES) are all classified; MLA with CP > 1, RoPE
    fusion or latent caching is a ValueError naming the option (before compute)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron_patches.config.config_support import (FIELD_RULES, MLA_RULES,
                                                        check_config_supported,
                                                        unclassified_fields)
    from mla_models import mla_model

    assert unclassified_fields(MLATransformerConfig) == []
    names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    assert set(MLA_RULES) <= names and not set(MLA_RULES) & set(FIELD_RULES)
    config = mla_model().config
    check_config_supported(config)
    for name, value, words in (("context_parallel_size", 2, "context_parallel_size=1"),
                               ("apply_rope_fusion", True, "apply_rope_fusion=False"),
                               ("sequence_parallel", True, "sequence_parallel=False"),
                               ("virtual_pipeline_model_parallel_size", 2, "virtual pipeline"),
                               ("cache_mla_latents", True, "cache_mla_latents"),
                               ("experimental_attention_variant", "dsa", "top-k"),
                               ("mtp_num_layers", 1, "mtp_num_layers")):
        bad = copy.copy(config)
        object.__setattr__(bad, name, value)
        with pytest.raises(ValueError, match=words):
            check_config_supported(bad)


def test_mtp_and_dsa_are_refused_before_compute(megatron_env):
    """A reuse step on a model built with MTP layers or DSA attention stops with the flag and
    the reason, before any forward (no gradient written)."""
    from megatron_patches.training import reuse_step
    from mla_models import mla_model

    batch = make_batch(3, [(12, [4, 5])])
    plan = plan_microbatches(batch, token_budget=16, max_seq_len=512)
    model = mla_model()
    for name, value, words in (("mtp_num_layers", 1, "mtp_num_layers.*final hidden states"),
                               ("experimental_attention_variant", "dsa", "dsa.*indexer")):
        object.__setattr__(model.config, name, value)
        with pytest.raises(ValueError, match=words):
            reuse_step(model, batch, plan, LOSS_)
        object.__setattr__(model.config, name, None)
        assert all(p.grad is None for p in model.parameters())
