"""The peer: AReaL 1.0.4's tree training (`enable_tree_training`, areal/models/tree_attn/) beside
dense and prefix reuse (make test-frameworks).

- exactness: AReaL's own engine step with `enable_tree_training=True` (its trie packer
  `build_packed_tree_batch`, `build_tree_attn_kwargs`, its `PytorchFlexAttention` core attention
  in every layer, `gather_packed_tree_logprobs_entropy`, `grpo_loss_fn`) == AReaL's own dense step
  on the same model and batch, fp32 1e-5; prefix reuse against the same dense step is
  tests/test_fw_areal.py. Emulated: the FlexAttention KERNEL (`_flex_attention`, torch.compile'd
  `flex_attention`): FlexAttention has no backward on CPU ("FlexAttention does not support
  backward on CPU", torch 2.13), so `flex_attention_math` computes what flex_attention defines
  for AReaL's call (no score_mod): scores q.k x scale, the BlockMask's own `mask_mod` evaluated at
  every (q, kv) pair as the mask, softmax, a query row with no allowed key gives 0 (flex's rule),
  GQA by repeating K/V heads; AReaL's PytorchFlexAttention module, its BlockMask building
  (`create_block_mask_from_dense`) and everything around them run unchanged. The layer spec is patched as `patch_bridge_for_tree_training` patches mbridge's
  (core attention PytorchFlexAttention, attn_mask_type arbitrary) on the tiny model instead of an
  mbridge-built one. Other stubs: tools/benchlib/areal_harness.py.
- tokens: prefix 4096, G=16, suffix 256 at budgets 2k / 8k / 64k and a multi-turn tree
  (tools/benchlib/areal_peer.py; `tools/peer_areal.py` prints the table). Deterministic counts.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from benchlib import areal_harness as harness  # noqa: E402

if os.environ.get("PREFIX_REUSE_REQUIRE_FRAMEWORKS") == "1":
    harness.install_import_stubs()
    import areal.models.tree_attn.tree  # noqa: F401  (make test-frameworks: fails, never skips)
elif not harness.areal_available():
    pytest.skip(harness.AREAL_MISSING, allow_module_level=True)
else:
    harness.install_import_stubs()

from framework_data import SMALL, assert_grads_equal  # noqa: E402
from benchlib import areal_peer as peer  # noqa: E402


def flex_attention_math(query, key, value, block_mask=None, score_mod=None, scale=None,
                        enable_gqa=False):
    """flex_attention's definition for AReaL's call (module docstring); [B, H, S, D]."""
    assert score_mod is None, "AReaL's call passes no score_mod"
    heads, s_q, s_kv, dim = query.shape[1], query.shape[2], key.shape[2], query.shape[3]
    allowed = block_mask.mask_mod(0, 0, torch.arange(s_q, device=query.device)[:, None],
                                  torch.arange(s_kv, device=query.device)[None, :]).bool()
    if enable_gqa:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    scores = (query @ key.transpose(-1, -2)) * (dim ** -0.5 if scale is None else scale)
    empty = ~allowed.any(-1)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(empty[:, None], 0.0)
    return (scores.softmax(-1) @ value).masked_fill(empty[:, None], 0.0)


def _tree_model(monkeypatch):
    import areal.models.tree_attn.module_megatron as tree_module
    from megatron.core.transformer.enums import AttnMaskType
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    monkeypatch.setattr(tree_module, "_flex_attention", flex_attention_math)  # (docstring)
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = False
    for layer in model.decoder.layers:  # what patch_bridge_for_tree_training does to the spec
        attention = layer.self_attention
        attention.core_attention = tree_module.PytorchFlexAttention(
            model.config, attention.layer_number, AttnMaskType.arbitrary, "self")
        attention.attn_mask_type = AttnMaskType.arbitrary
    return model


def _dense_model():
    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    model = build_model(TinyLlamaConfig(**SMALL))
    model.config.calculate_per_token_loss = False
    harness.stub_padding_mask(model)
    return model


def _step(engine, batch):
    from areal.utils import stats_tracker
    stats_tracker.export_all(reduce_group=None)
    stats = engine.train_batch({k: v.clone() for k, v in batch.items()},
                               loss_fn=harness.grpo_loss(), loss_weight_fn=harness.loss_weight_fn)
    return stats, engine.optimizer.grads[-1]


def _tree_vs_dense(monkeypatch, groups):
    from areal.api.cli_args import MicroBatchSpec
    from megatron_patches.training import max_relative_diff
    batch = harness.areal_batch(groups, seed=3, vocab_size=SMALL["vocab_size"])
    dense = harness.areal_engine(_dense_model(), harness.actor_config(prefix_reuse=False))
    tree = harness.areal_engine(_tree_model(monkeypatch), harness.actor_config(
        prefix_reuse=False, enable_tree_training=True, pad_to_maximum=True,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=128)))
    tree.use_padded_seq = False  # the tree path feeds [1, budget] rows with a tree mask
    d_stats, d_grads = _step(dense, batch)
    t_stats, t_grads = _step(tree, batch)
    assert d_stats["grad_norm"] > 0 and t_stats["grad_norm"] > 0
    for name, g in t_grads.items():
        assert torch.isfinite(g).all(), f"{name}: NaN or inf in AReaL tree gradient"
    return d_grads, t_grads, max_relative_diff(d_grads, t_grads), t_stats


@pytest.mark.megatron
def test_areal_tree_one_sequence_per_tree_equals_dense(megatron_env, monkeypatch):
    """Unrelated prompts whose sequences do not fit two to a 128-token tree: every tree holds one
    sequence at packed positions 0..n-1, and AReaL's tree step == its dense step (fp32 1e-5).
    This checks the harness and the FlexAttention emulation."""
    d_grads, t_grads, _, _ = _tree_vs_dense(monkeypatch, ((70, 1), (72, 1), (74, 1)))
    assert_grads_equal(d_grads, t_grads)


@pytest.mark.megatron
def test_areal_tree_shared_prefix_vs_dense(megatron_env, monkeypatch):
    """Groups sharing a prompt, packed as tries: AReaL's tree step against its dense step. With
    Megatron-core's RoPE (`position_embedding_type='rope'`) GPTModel ignores `position_ids` for
    the rotary angles (gpt_model.py: `rotary_pos_emb(rotary_seq_len)`, positions 0..S-1 of the
    packed row), so a sibling packed after another sits at the wrong rotary position and the
    gradients differ from dense. Measured here: see the assertion message; this pins that the
    difference is far above fp32 noise (docs/FRAMEWORKS.md "The peer")."""
    _, _, diff, stats = _tree_vs_dense(monkeypatch, ((36, 4), (30, 3)))
    print(f"AReaL tree vs dense, shared prefixes: max relative gradient difference {diff:.3e}, "
          f"{stats['num_micro_batches']} tree micro-batches")
    assert diff > 1e-3, f"AReaL tree == dense within {diff:.3e}: update the docs' finding"


def test_emulated_counts_match_the_full_packer():
    """The counts use AReaL's packer core; the whole build_packed_tree_batch agrees (small)."""
    sequences = peer.grpo_workload(200, 6, 30, vocab=256)
    for budget in (128, 256, 512):
        fast = peer.count_areal_tree(sequences, budget)
        full = peer.count_areal_tree(sequences, budget, full_packer=True)
        assert (fast.micro_batches, fast.tokens_fed, fast.distinct_tokens) == \
            (full.micro_batches, full.tokens_fed, full.distinct_tokens), (fast, full)


def test_token_counts_prefix_4096_g16_suffix_256():
    rows = {(r["budget"], r["method"].split()[0]): r
            for r in peer.compare(peer.grpo_workload(), (2048, 8192, 65536))}
    assert rows[(2048, "AReaL")]["note"].startswith("refused: Sequence length 4352")
    assert rows[(2048, "dense")]["note"].startswith("refused")
    assert (rows[(8192, "AReaL")]["micro_batches"], rows[(8192, "AReaL")]["tokens_fed"]) == (1, 8192)
    assert (rows[(65536, "AReaL")]["tokens_fed"], rows[(65536, "AReaL")]["distinct_tokens"]) == \
        (65536, 8192)
    for budget in (8192, 65536):
        assert rows[(budget, "dense")]["tokens_fed"] == 16 * 4352
    for budget in (2048, 8192, 65536):
        assert rows[(budget, "ours")]["tokens_fed"] == 4095 + 16 * 256


def test_token_counts_multi_turn():
    rows = {(r["budget"], r["method"].split()[0]): r
            for r in peer.compare(peer.multi_turn_workload(), (8192, 65536))}
    assert rows[(8192, "AReaL")]["micro_batches"] == 3
    assert rows[(8192, "AReaL")]["distinct_tokens"] == 24064  # the system prompt in each tree
    assert rows[(65536, "AReaL")]["distinct_tokens"] == 19456
    for budget in (8192, 65536):
        assert rows[(budget, "ours")]["tokens_fed"] == 19452
        assert rows[(budget, "dense")]["tokens_fed"] == 110592
