"""tools/replay.py and tools/sweep.py end to end on tiny models (behaviour, never timings)."""
import csv
import json

import pytest

from prefix_schedule.traces.synth import SynthConfig
from tools_import import tool

pytestmark = pytest.mark.megatron
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "4", "--num-query-groups", "2"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "rag.jsonl"
    tool("trace").synth(SynthConfig(kind="rag", steps=4, seed=1, groups_per_step=2,
                                    group_sizes=(2, 3), max_seq_len=64, vocab_size=128), path)
    return path


def replay(args):
    module = tool("replay")
    return module.replay(module.parse_args(args), log=lambda *_: None)


def test_replay_fp32_matches_dense_and_resumes_bit_for_bit(megatron_env, trace, tmp_path):
    full = replay(["--trace", str(trace), "--steps", "2"])
    assert full["steps"] == 2 and len(full["rows"]) == 2
    for row in full["rows"]:
        dense, reuse = row["loss"]["dense"], row["loss"]["reuse"]
        assert abs(dense - reuse) <= 1e-5 * max(abs(dense), 1e-3), row
        assert row["grad_norm"]["reuse"] == pytest.approx(row["grad_norm"]["dense"], rel=1e-5)
    assert 0 < full["max_param_diff"] <= 1e-4  # the target (default lr 1e-4, eps 1e-8)
    # test_equivalence's AdamW bar: no more than 3x what another attention kernel moves dense by
    assert full["max_param_diff"] <= max(1e-5, 3 * full["control_max_param_diff"])
    assert full["mean_param_diff"] <= full["rmse_param_diff"] <= full["max_param_diff"]
    assert full["control_max_param_diff"] > 0  # the kernel yardstick moves too
    ckpt = tmp_path / "ckpt"
    first = replay(["--trace", str(trace), "--steps", "1", "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "1"])
    assert first["steps"] == 1 and (ckpt / "step_000001" / "reuse.safetensors").is_file()
    resumed = replay(["--trace", str(trace), "--steps", "2", "--checkpoint-dir", str(ckpt),
                      "--resume"])
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(resumed["rows"]) == strip(full["rows"])
    with pytest.raises(ValueError, match="other settings"):
        replay(["--trace", str(trace), "--steps", "2", "--lr", "2e-3", "--checkpoint-dir",
                str(ckpt), "--resume"])
    with pytest.raises(ValueError, match="has 4 steps"):
        replay(["--trace", str(trace), "--steps", "5"])


def test_replay_bf16_reuse_no_farther_than_bf16_dense(megatron_env, trace, tmp_path):
    module = tool("replay")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert module.main(["--trace", str(trace), "--steps", "2", "--precision", "bf16", "--lr",
                        "1e-3", "--json", str(out_json), "--png", str(out_png)] + MODEL) == 0
    result = json.loads(out_json.read_text())
    for key in ("steps", "max_param_diff", "mean_param_diff", "rmse_param_diff", "rows"):
        assert key in result
    assert result["max_param_diff"] <= 1.5 * result["control_max_param_diff"], result
    assert result["rmse_param_diff"] <= 1.5 * result["control_rmse_param_diff"], result
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| reuse vs dense (bf16 reuse) |" in module.format_summary(result)


def test_two_point_sweep_writes_csv_and_plots_and_resumes(megatron_env, tmp_path):
    sweep = tool("sweep")
    out = tmp_path / "sweep.csv"
    args = ["--points", "48:16:4,8:56:2", "--reps", "1", "--warmup", "0", "--csv", str(out),
            "--png-dir", str(tmp_path), "--vocab-size", "256"] + MODEL
    assert sweep.main(args) == 0
    rows = list(csv.DictReader(open(out)))
    assert [(r["prefix"], r["suffix"], r["group_size"]) for r in rows] == [("48", "16", "4"),
                                                                           ("8", "56", "2")]
    big, small = rows
    assert big["policy"].startswith("reuse") and float(big["ideal"]) > 1.5
    assert small["policy"].startswith("dense (FLOP gain") and float(small["ideal"]) == 1.0
    for r in rows:
        assert float(r["grad_rel_diff"]) <= 1e-5 and float(r["cpu_speedup"]) > 0
    # big: reuse's suffix phase holds the prefix graph plus one microbatch of suffixes, never
    # all four dense rows' activations
    assert -int(big["group_size"]) < float(big["suffix_phase_reduction"]) < 1
    # small, run dense by the policy: both equal-length rows in one microbatch (its budget is four
    # dense rows) hold twice the activations of dense's one-row microbatch (the device-memory
    # model also counts a few bytes that do not scale with rows: within 1e-4)
    assert small["microbatches"] == "1"
    assert abs(float(small["suffix_phase_reduction"]) + 1.0) < 1e-4
    for name in ("speedup.png", "memory.png", "efficiency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert sweep.main(args) == 0  # resumes: both points are in the CSV already
    assert len(list(csv.DictReader(open(out)))) == 2
    assert sweep.main(["--paper", "--list"]) == 0
