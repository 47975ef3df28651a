"""tools/replay.py under faults (issue 22): a checkpoint is one verified unit, a resume refuses
what it cannot trust, a non-finite step stops before the optimizer, differences are NaN-aware,
and output paths are checked before the work. Tiny model, 1-2 steps each."""
import json
import shutil

import pytest
import torch

from prefix_schedule.traces.synth import SynthConfig
from tools_import import tool

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "rag.jsonl"
    tool("trace").synth(SynthConfig(kind="rag", steps=3, seed=1, groups_per_step=2,
                                    group_sizes=(2, 3), max_seq_len=64, vocab_size=128), path)
    return path


def replay(*args):
    module = tool("replay")
    return module.replay(module.parse_args([str(a) for a in args]), log=lambda *_: None)


def strip(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


@pytest.fixture(scope="module")
def full(megatron_env, trace):
    return replay("--trace", trace, "--steps", 2)


@pytest.fixture(scope="module")
def saved(megatron_env, trace, tmp_path_factory):
    """A checkpoint after steps 0 and 1 (every step)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    replay("--trace", trace, "--steps", 2, "--checkpoint-dir", ckpt, "--checkpoint-every", 1)
    return ckpt


def test_a_kill_during_a_save_resumes_from_the_last_whole_checkpoint(megatron_env, trace,
                                                                     full, tmp_path,
                                                                     monkeypatch):
    """Issue 22: the runs' files were replaced one by one and state.json last; a kill in
    between left step-2 weights with step-1 rows, and --resume trained that step twice."""
    import replay_runs

    ckpt = tmp_path / "ckpt"
    replay("--trace", trace, "--steps", 1, "--checkpoint-dir", ckpt, "--checkpoint-every", 1)
    real_save, calls = replay_runs.Run.save, []

    def dies_on_the_second_file(self, path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-checkpoint")
        real_save(self, path)

    monkeypatch.setattr(replay_runs.Run, "save", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        replay("--trace", trace, "--steps", 2, "--checkpoint-dir", ckpt, "--checkpoint-every", 1,
               "--resume")
    monkeypatch.setattr(replay_runs.Run, "save", real_save)
    resumed = replay("--trace", trace, "--steps", 2, "--checkpoint-dir", ckpt, "--resume")
    assert strip(resumed["rows"]) == strip(full["rows"])
    assert resumed["steps"] == 2


def _copy(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt, ckpt / (ckpt / "LATEST").read_text().strip()


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def _to_dir(path):
    path.unlink()
    path.mkdir()


FAULTS = {
    "truncated safetensors": (lambda d: _truncate(d / "reuse.safetensors"), "truncated"),
    "missing safetensors": (lambda d: (d / "dense.safetensors").unlink(), "is missing"),
    "state.json not JSON": (lambda d: (d / "state.json").write_text("{oops"), "truncated"),
    "state.json wrong keys": (lambda d: (d / "state.json").write_text('{"a": 1}'), "truncated"),
    "state.json a directory": (lambda d: _to_dir(d / "state.json"), "is missing"),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("[1,"), "not valid JSON"),
    "manifest wrong keys": (lambda d: (d / "manifest.json").write_text("{}"),
                            "not a replay checkpoint manifest"),
    "manifest missing": (lambda d: (d / "manifest.json").unlink(), "partial"),
    "LATEST names nothing": (lambda d: (d.parent / "LATEST").write_text("step_000009\n"),
                             "not a checkpoint directory"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_partial_or_corrupt_checkpoint_is_refused(trace, saved, tmp_path, fault):
    ckpt, step_dir = _copy(saved, tmp_path)
    damage, message = FAULTS[fault]
    damage(step_dir)
    with pytest.raises(ValueError, match=message):
        replay("--trace", trace, "--steps", 3, "--checkpoint-dir", ckpt, "--resume")


def test_a_consistent_looking_but_foreign_state_is_refused(trace, saved, tmp_path):
    """A state.json rewritten with its manifest entry (checksums pass): rows and AdamW step
    counts must still agree."""
    import hashlib

    ckpt, step_dir = _copy(saved, tmp_path)
    state = json.loads((step_dir / "state.json").read_text())
    state["rows"] = state["rows"][:1]
    data = json.dumps(state).encode()
    (step_dir / "state.json").write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["state.json"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                       "bytes": len(data)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="holds 1 rows for step 2"):
        replay("--trace", trace, "--steps", 3, "--checkpoint-dir", ckpt, "--resume")
    manifest["step"] = 1
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="AdamW state after \\[2.0\\] steps, the rows after 1"):
        replay("--trace", trace, "--steps", 3, "--checkpoint-dir", ckpt, "--resume")


def test_resume_checks_the_trace_content_and_the_step_count(trace, saved, tmp_path):
    ckpt, _ = _copy(saved, tmp_path)
    moved = tmp_path / "moved.jsonl"
    shutil.copy(trace, moved)  # the same content elsewhere: accepted
    replay("--trace", moved, "--steps", 2, "--checkpoint-dir", ckpt, "--resume")
    lines = moved.read_text().splitlines(keepends=True)
    record = json.loads(lines[1])
    record["responses"][0][0] = (record["responses"][0][0] + 1) % 128
    moved.write_text(lines[0] + json.dumps(record) + "\n" + "".join(lines[2:]))
    with pytest.raises(ValueError, match="trace's content differs"):
        replay("--trace", moved, "--steps", 2, "--checkpoint-dir", ckpt, "--resume")
    with pytest.raises(ValueError, match="after 2 steps, past --steps 1"):  # reported 2 before
        replay("--trace", trace, "--steps", 1, "--checkpoint-dir", ckpt, "--resume")
    with pytest.raises(ValueError, match="holds no replay checkpoint"):  # started over before
        replay("--trace", trace, "--steps", 1, "--checkpoint-dir", tmp_path / "empty", "--resume")


def test_output_paths_are_checked_before_the_work(trace, tmp_path, monkeypatch, capsys):
    module = tool("replay")
    monkeypatch.setattr(module, "replay", lambda *a, **k: pytest.fail("the work started"))
    for flag in ("--json", "--png"):
        assert module.main(["--trace", str(trace), "--steps", "1", flag,
                            str(tmp_path / "missing" / "out")]) == 1
        assert "does not exist; create it first" in capsys.readouterr().err
    assert module.main(["--trace", str(trace), "--steps", "1", "--json", str(tmp_path)]) == 1
    assert "is a directory" in capsys.readouterr().err


def test_a_stale_old_logprob_trains_finite_weights(megatron_env, trace, tmp_path):
    """Issue 22: old_logprobs = -100 on a loss token with a positive advantage overflowed exp,
    the weights went NaN and the table printed 0.000e+00 with exit 0."""
    lines = trace.read_text().splitlines(keepends=True)
    record = json.loads(lines[1])
    assert record["advantages"][0] > 0
    record["old_logprobs"][0][0] = -100.0
    bad = tmp_path / "stale.jsonl"
    bad.write_text(lines[0] + json.dumps(record) + "\n" + "".join(lines[2:]))
    result = replay("--trace", bad, "--steps", 1)
    row = result["rows"][0]
    assert all(torch.isfinite(torch.tensor(v)) for v in row["loss"].values()), row
    assert 0 < result["max_param_diff"] <= 1e-4, result["max_param_diff"]


def test_a_non_finite_gradient_stops_the_step_before_the_optimizer(megatron_env, trace,
                                                                   monkeypatch):
    import benchlib.steps
    import replay_runs

    real = benchlib.steps.reuse_step

    def poisoned(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        next(p for p in model.parameters()).main_grad.view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(benchlib.steps, "reuse_step", poisoned)
    stepped = []
    real_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step",
                        lambda self, *a, **k: stepped.append(1) or real_step(self, *a, **k))
    with pytest.raises(ValueError, match="step 0: run reuse: the gradient of .* holds 1 NaN"):
        replay("--trace", trace, "--steps", 1)
    assert len(stepped) == 1  # dense stepped; reuse stopped before its optimizer
    assert replay_runs.param_diff({"w": torch.ones(2)}, {"w": torch.tensor([1.0, float("nan")])}) \
        == {"max": float("inf"), "mean": float("inf"), "rmse": float("inf")}
