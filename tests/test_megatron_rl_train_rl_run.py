"""A whole Megatron-LM `train_rl.py` run, stock vs `--prefix-reuse`, 3 iterations on CPU.

examples/megatron_lm/train_rl_prefix_reuse.py runs the offline Megatron-LM main checkout's own
train_rl.py (its arguments, `pretrain` -> `train()`, SGD optimizer, `training_log`,
`save_checkpoint`) twice with the same arguments, the second time with `--prefix-reuse`; its
rollouts come through its own agent interface from a trace (tests/train_rl_run.py: the replay
agent and every stub, named). Two GRPO collections (`--grpo-iterations 2`): iteration 2 trains
on the rollouts of iteration 1 after a step (ratios != 1, clipped), iteration 3 on fresh ones with
a reference policy that is no longer the current one (KL != 0).

Checked: every training step of the reuse run ran as one reuse step that shared both groups'
prompts (the launcher's `> prefix reuse step:` report lines), and, fp32, each within 1e-5
relative (NaN/inf fail): per iteration the loss and every RL metric of its loss dict and the
grad norm (training_log's arguments, recorded at full precision), and every weight of the
checkpoints saved after iterations 2 and 3; that the reuse run printed its hook lines and the
stock run none; that the trace was really trained on (distinct losses, KL and clipping non-zero
where the data says they must be). The same with `--rl-use-sequence-packing` (bins of 128
tokens: each group of 4 spans two or more bins, and each reuse step's report shows both groups
whole), and the packed stock run equal to the same run unpacked (losses, metrics, grad norms).
And the same with `--pipeline-model-parallel-size 2` (two processes, the weights of both stages'
checkpoints).
"""
import json
import sys

import pytest
import torch

from megatron_lm_runs import REPO, child_env, entry_tree
from reaped import run_reaped
from test_megatron_rl_train_rl import RL_MODULES, _close, _tensors_close

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
ITERS, GROUPS, G, VOCAB, EOD, PAD = 3, 2, 4, 256, 255, 0
RUN = REPO / "tests" / "train_rl_run.py"
LONG = ["--seq-length", "128", "--max-position-embeddings", "128",
        "--inference-max-seq-length", "128"]
"""The packed runs' bins (= rows) of 128 tokens."""


def _trace(path):
    """Three collections of GRPO groups: prompts of 30/34 tokens, G responses of 6-15 tokens
    ending in eod, inference log-probs and rewards."""
    gen = torch.Generator().manual_seed(7)
    collections = []
    for _ in range(ITERS):
        groups = []
        for g in range(GROUPS):
            prompt = torch.randint(3, 250, (30 + 4 * g,), generator=gen).tolist()
            members = []
            for _ in range(G):
                n = int(torch.randint(6, 16, (1,), generator=gen))
                response = torch.randint(3, 250, (n - 1,), generator=gen).tolist() + [EOD]
                members.append(dict(response=response, reward=float(torch.rand(1, generator=gen)),
                                    logprobs=(-torch.rand(n, generator=gen)).tolist()))
            groups.append(dict(prompt=prompt, members=members))
        collections.append(groups)
    path.write_text(json.dumps(collections))


def _args(tree, env_config):
    return [
        "--train-rl", str(tree / "train_rl.py"),
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1",
        "--tokenizer-type", "NullTokenizer", "--null-tokenizer-pad-id", str(PAD),
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", str(GROUPS * G), "--swiglu", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--calculate-per-token-loss",
        "--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
        "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
        "--no-persist-layer-norm", "--distributed-backend", "gloo",
        # SGD: weights follow the gradients linearly (tests/train_rl_replay.py says why)
        "--optimizer", "sgd", "--lr", "0.5", "--min-lr", "0.5", "--lr-decay-style", "constant",
        "--weight-decay", "0", "--clip-grad", "0", "--train-iters", str(ITERS),
        "--perform-rl-step", "--grpo-prompts-per-step", str(GROUPS), "--grpo-group-size", str(G),
        "--grpo-iterations", "2", "--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper",
        "0.28", "--grpo-kl-beta", "0.05", "--grpo-entropy-term-weight", "0.01",
        "--langrl-env-config", str(env_config), "--inference-max-seq-length", "64",
        "--log-interval", "1", "--seed", "1234", "--eval-iters", "0",
        "--ckpt-format", "torch", "--save-interval", "2",
    ]


def _train(tree, tmp, name, argv, weights=True, nproc=1):
    record = tmp / f"{name}.jsonl"
    run = run_reaped([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                      str(RUN), *argv, "--save", str(tmp / f"ckpt-{name}")],
                     env={**child_env(tree), "TRAIN_RL_RECORD": str(record)}, cwd=REPO,
                     timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    lines = [line for line in lines if line["losses"]]  # the last pipeline stage's
    if not weights:
        return dict(log=run.stdout, steps=lines)
    path = tmp / f"{name}-weights.pt"
    saved = run_reaped([sys.executable, "-W", "ignore", str(RUN), "--save-weights",
                        str(tmp / f"ckpt-{name}"), str(path)], env=child_env(tree), cwd=REPO,
                       timeout=300)
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-6000:]
    return dict(log=run.stdout, steps=lines, weights=torch.load(path))


def _setup(tmp_path_factory):
    import importlib.util

    missing = [m for m in (*RL_MODULES, "pybind11", "yaml")
               if importlib.util.find_spec(m) is None]
    if missing:
        import megatron_trees
        megatron_trees.missing(f"Megatron-LM's train_rl.py needs {', '.join(missing)}: run make "
                               "setup (or make test-frameworks)")
    tree = entry_tree("0.20.0", tmp_path_factory)  # skips naming the places when absent
    tmp = tmp_path_factory.mktemp("train_rl_run")
    _trace(tmp / "trace.json")
    env_config = tmp / "env.yaml"
    env_config.write_text(f"- agent_type: TraceReplayAgent\n  agent_args:\n"
                          f"    trace: {tmp / 'trace.json'}\n  weight: 1.0\n")
    return tree, tmp, _args(tree, env_config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tree, tmp, argv = _setup(tmp_path_factory)
    return _train(tree, tmp, "stock", argv), _train(tree, tmp, "reuse", argv + ["--prefix-reuse"])


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    """Bins of 128 tokens (2-3 sequences of 36-49 tokens each: groups split over bins), and
    the same run unpacked (rows of 128) as the packing-free reference."""
    tree, tmp, argv = _setup(tmp_path_factory)
    argv += LONG
    packed = argv + ["--rl-use-sequence-packing",
                     "--rl-sequence-packing-max-sequences-per-bin", "4"]
    return (_train(tree, tmp, "packed-stock", packed),
            _train(tree, tmp, "packed-reuse", packed + ["--prefix-reuse"]),
            _train(tree, tmp, "unpacked-stock", argv, weights=False))


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """PP=2: two processes, one stage each (Megatron's 1F1B stock; the reuse executor's
    pipeline schedule with reuse)."""
    tree, tmp, argv = _setup(tmp_path_factory)
    argv += ["--pipeline-model-parallel-size", "2"]
    return (_train(tree, tmp, "pp-stock", argv, nproc=2),
            _train(tree, tmp, "pp-reuse", argv + ["--prefix-reuse"], nproc=2))


def _assert_reuse_equals_stock(stock, reuse):
    assert "> prefix reuse:" in reuse["log"] and "> prefix reuse" not in stock["log"]
    steps = reuse["log"].split("> prefix reuse step:")[1:]
    assert len(steps) == ITERS, reuse["log"][-3000:]  # every training step ran as reuse ...
    for step in steps:  # ... with both groups whole and shared
        report = step.split(" iteration ")[0]
        assert report.count("reuse (FLOP gain") == GROUPS, report
        assert report.count(f": {G} trajectories") == GROUPS, report
    _assert_steps_equal(stock["steps"], reuse["steps"])
    assert sorted(stock["weights"]) == sorted(reuse["weights"]) == [2, ITERS]
    for it, weights in stock["weights"].items():
        assert weights.keys() == reuse["weights"][it].keys() and len(weights) > 10
        for name, w in weights.items():
            _tensors_close(w, reuse["weights"][it][name], f"{name} after iteration {it}")


def _assert_steps_equal(stock, reuse):
    assert [s["iteration"] for s in stock] == [s["iteration"] for s in reuse] \
        == list(range(1, ITERS + 1))
    for s, r in zip(stock, reuse):
        it = s["iteration"]
        _close(s["grad_norm"], r["grad_norm"], f"grad norm {it}")
        assert s["losses"].keys() == r["losses"].keys() and "lm loss" in s["losses"]
        for key, value in s["losses"].items():
            if value == 0:  # KL at iteration 1 (reference = current), truncation counts
                assert r["losses"][key] == 0, (key, it, r["losses"][key])
            else:
                _close(value, r["losses"][key], f"{key}, iteration {it}")


def test_train_rl_run_prefix_reuse_equals_stock_over_3_iterations(runs):
    _assert_reuse_equals_stock(*runs)


def test_train_rl_run_packed_prefix_reuse_equals_stock_over_3_iterations(packed_runs):
    """--rl-use-sequence-packing: the reuse step regroups the bins' sequences (both groups of
    4 whole in every step's report) and equals train_rl's packed step (its attention through
    the THD stand-in, tests/train_rl_replay.py), which equals the unpacked run."""
    packed_stock, packed_reuse, unpacked = packed_runs
    assert "consumed bins:" in packed_stock["log"] and "consumed bins:" not in unpacked["log"]
    _assert_reuse_equals_stock(packed_stock, packed_reuse)
    _assert_steps_equal(unpacked["steps"], packed_stock["steps"])


def test_train_rl_run_pipeline_parallel_prefix_reuse_equals_stock(pipeline_runs):
    """--pipeline-model-parallel-size 2: the reuse step runs the pipeline, the log-prob passes
    broadcast the last stage's log-probs to both stages (as compute_logprobs_batch does); every
    weight of both stages' checkpoints."""
    stock, reuse = pipeline_runs
    assert {name.split("/")[0] for name in stock["weights"][ITERS]} == {
        "mp_rank_00_000", "mp_rank_00_001"}
    _assert_reuse_equals_stock(stock, reuse)


def test_train_rl_run_trains_on_the_trace(runs):
    """What makes the comparison above discriminating: the run really moved."""
    steps = runs[0]["steps"]
    losses = [s["losses"] for s in steps]
    assert len({round(x["lm loss"], 6) for x in losses}) == ITERS
    assert losses[0]["rl/kl_term"] == 0 and losses[0]["rl/pi_over_pi_old"] == 1
    assert losses[1]["rl/pi_over_pi_old"] != 1  # old rollouts after one step
    assert losses[1]["rl/truncated_from_above"] + losses[1]["rl/truncated_from_below"] > 0
    assert losses[2]["rl/kl_term"] > 0 and losses[2]["rl/pi_over_pi_old"] == 1  # fresh rollouts
    before, after = runs[0]["weights"][2], runs[0]["weights"][ITERS]
    assert any(not torch.equal(before[n], after[n]) for n in before)
