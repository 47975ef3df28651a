"""tools/layout_move.py (the planned megatron_patches/ subpackage move): its reference rewrite.
The move itself is applied once, by the lead, after the merges (the script's docstring)."""
from tools_import import tool


def test_rewrite_points_every_reference_at_the_new_place():
    move = tool("layout_move")
    text = ("    from megatron_patches import models  # stubs a missing triton\n"
            "from megatron_patches import install, layers, stage_runner as runner\n"
            "import megatron_patches.moe as moe\n"
            "x = megatron_patches.models.build_model; y = 'megatron_patches.moe.route'\n"
            "see megatron_patches/p2p.py, megatron_patches.megatron_lm.main, "
            "megatron_patches.training\n")
    assert move.rewrite(text) == (
        "    from megatron_patches.models import tiny as models  # stubs a missing triton\n"
        "from megatron_patches import install\n"
        "from megatron_patches.runtime import layers\n"
        "from megatron_patches.runtime import stage_runner as runner\n"
        "import megatron_patches.runtime.moe as moe\n"
        "x = megatron_patches.models.tiny.build_model; y = 'megatron_patches.runtime.moe.route'\n"
        "see megatron_patches/runtime/p2p.py, megatron_patches.megatron_lm.main, "
        "megatron_patches.training\n")


def test_the_plan_places_each_module_once_in_a_declared_subpackage():
    move = tool("layout_move")
    targets = list(move.MOVES.values())
    assert len(set(targets)) == len(targets)
    assert {t.split(".")[0] for t in targets} == set(move.SUBPACKAGES)
    assert not set(move.MOVES) & move.STAYS
