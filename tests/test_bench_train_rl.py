"""`tools/bench.py --adapter megatron-rl` (tools/benchlib/adapter_train_rl.py and
train_rl_worker.py): Megatron-LM RL's training step, stock vs the TrainRLReuse hooks, on the
offline Megatron-LM main tree, tiny model: the JSON fields, the gradient agreement and that
both groups were shared, never timings; a missing tree is a ValueError naming where it looked."""
import importlib.util
import json
import sys

import pytest

from megatron_trees import REPO
from test_bench_verl import TINY, bench, check_fields

pytestmark = pytest.mark.megatron
RL_MODULES = ("httpx", "fastapi", "uvicorn", "openai")


def test_bench_adapter_megatron_rl(tmp_path):
    missing = [m for m in RL_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        import megatron_trees
        megatron_trees.missing(f"Megatron-LM's megatron/rl imports {', '.join(missing)}: run "
                               "make setup")
    import megatron_trees
    megatron_trees.find_tarball("0.20.0")  # skips naming the places looked at when absent
    out = tmp_path / "train_rl.json"
    run = bench("--adapter", "megatron-rl", *TINY, "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    check_fields(result, "megatron-rl", dense_microbatches=6)  # one row per microbatch
    assert result["report"].count("reuse (FLOP gain") == 2, result["report"]


def test_bench_adapter_megatron_rl_without_the_tree_says_where_it_looked(monkeypatch):
    sys.path.insert(0, str(REPO / "tools"))
    from benchlib import adapter_train_rl
    import megatron_trees

    def absent(version, factory=None):
        pytest.skip(f"{megatron_trees.SKIP_PREFIX} {version}: no tarball in /nowhere")
    monkeypatch.setattr(megatron_trees, "find_tarball", absent)
    with pytest.raises(ValueError, match="needs the offline Megatron-LM main tree: .*/nowhere"):
        adapter_train_rl._patched_main_tree(REPO)
