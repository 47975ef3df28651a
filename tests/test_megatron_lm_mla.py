"""MLA through the Megatron-LM entry point (examples/megatron_lm/train_grpo.py) on the offline
core_r0.19.0 tree (CPU, gloo, one process): the DeepSeek-V3 tiny twin from its Megatron-LM
arguments (megatron_patches/models/model_configs_mla.py: MLA with yarn, a dense first layer,
MoE after with sigmoid grouped routing and expert bias). Without Transformer Engine the entry
point gives its MLA layers Megatron's local core attention sized for MLA
(megatron_patches/megatron_lm/model.py, `_local_mla_core_attention`). Prefix reuse == stock
dense over the dense packing reuse equals, over two Adam steps (rows of one length:
see below): policy loss, Megatron's logged
`load_balancing_loss`, every gradient (DDP's main_grad) and every weight within 1e-5."""

import pytest

from megatron_lm_runs import assert_dumps_equal, entry_tree, small_args, torchrun
from test_megatron_lm_entry import _ok
from test_megatron_lm_moe import _load_balancing

pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # two entry-point runs (~3.5 min here)
TOL = 1e-5


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return entry_tree("0.19.1", tmp_path_factory)


def test_deepseek_v3_tiny_reuse_equals_dense_two_adam_steps(tree, tmp_path):
    from megatron_patches.models.model_configs_mla import MLA_MODELS

    common = [*MLA_MODELS["deepseek-v3-tiny"].megatron_args(), *small_args(2), "--adam-eps", "1",
              "--lr", "0.1", "--min-lr", "0.1", "--rl-synthetic-uniform-groups",
              # rows of one length: stock Megatron 0.19's expert-bias count fails on a padding
              # mask (routing_map [N, E] & ~padding_mask [N], tests/test_moe.py)
              "--rl-synthetic-prefix-len", "48", "--rl-synthetic-max-response-len", "15",
              "--rl-synthetic-fixed-response-len"]
    dense = torchrun(tree, 1, [*common, "--prefix-reuse-dump-params", str(tmp_path / "d")])
    reuse = torchrun(tree, 1, [*common, "--prefix-reuse", "--prefix-reuse-dump-params",
                               str(tmp_path / "r")])
    d, r = _ok(dense), _ok(reuse)
    assert sorted(d) == sorted(r) == [1, 2]
    dense_lb = _load_balancing(dense.stdout + dense.stderr)
    reuse_lb = _load_balancing(reuse.stdout + reuse.stderr)
    assert sorted(dense_lb) == sorted(reuse_lb) == [1, 2]
    for i in d:
        assert abs(d[i][0] - r[i][0]) <= TOL * abs(d[i][0]), (i, d[i], r[i])
        assert abs(dense_lb[i] - reuse_lb[i]) <= TOL * dense_lb[i], (i, dense_lb, reuse_lb)
    assert_dumps_equal(tmp_path / "d", tmp_path / "r", 2, TOL,
                       may_be_zero=lambda name: "local_experts" in name)
