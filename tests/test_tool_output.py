"""The tools' shared output helpers: progress (tqdm on a terminal, plain lines elsewhere) and the
matplotlib plots re-made from saved results (sweep CSV, replay JSON) without measuring."""
import csv
import io
import json
import re

import matplotlib.image
import pytest

from tools_import import TOOLS, tool

REPO = TOOLS.parent


def progress_module():
    tool("plan")  # puts tools/ on sys.path
    from benchlib import progress

    return progress


def test_progress_prints_one_plain_line_per_item_off_a_terminal():
    progress = progress_module()
    out = io.StringIO()
    with progress.Progress(3, name="sweep", unit="point", stream=out, tty=False) as bar:
        bar.step("G=2: speedup 1.10x")
        bar.step()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"sweep 1/3 points \[\d+s<\d+s\]: G=2: speedup 1\.10x", lines[0]), lines
    assert re.fullmatch(r"sweep 2/3 points \[\d+s<\d+s\]", lines[1]), lines
    assert [progress.format_seconds(s) for s in (4.4, 185, 7260)] == ["4s", "3m05s", "2h01m"]


def test_progress_draws_a_tqdm_bar_with_an_eta_on_a_terminal():
    progress = progress_module()
    out = io.StringIO()
    bar = progress.Progress(4, name="replay", stream=out, tty=True, start=1)
    bar.step("step 1 loss ...")
    bar.close()
    text = out.getvalue()
    assert "step 1 loss ..." in text
    assert re.search(r"replay: +50%.*2/4 \[.*<.*step", text), text  # tqdm's bar: count, ETA, rate


def test_progress_refuses_a_start_past_the_total():
    with pytest.raises(ValueError, match="start"):
        progress_module().Progress(2, name="replay", start=3, tty=False)


def _assert_png(path):
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05, f"{path} is blank"


def test_sweep_plots_remake_the_pngs_from_a_csv(tmp_path):
    rows = list(csv.DictReader(open(REPO / "docs" / "sweep" / "sweep.csv")))
    policy = [r for r in rows if r["policy_on"] == "True"][:6]
    small = tmp_path / "sweep.csv"
    with open(small, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(policy)
    assert tool("sweep_plots").main([str(small), str(tmp_path / "out")]) == 0
    for name in ("speedup.png", "memory.png", "efficiency.png"):
        _assert_png(tmp_path / "out" / name)


def test_replay_replots_a_saved_result_without_training(tmp_path, capsys):
    rows = [{"step": s, "loss": {"dense": 1.0 - s / 10, "reuse": 1.0 - s / 10, "control": 0.9},
             "grad_norm": {"dense": 2.0, "reuse": 2.0, "control": 2.1},
             "param_diff": {n: {"max": 1e-6 * (s + 1), "mean": 1e-9, "rmse": 2e-8}
                            for n in ("reuse", "control", "reuse_vs_control")}}
            for s in range(5)]
    result = {"steps": 5, "trace": "rag.jsonl", "precision": "fp32", "rows": rows,
              "runs": {"control": "fp32, dense with fused-SDPA attention"}}
    saved, png = tmp_path / "r.json", tmp_path / "r.png"
    saved.write_text(json.dumps(result))
    replay = tool("replay")
    assert replay.main(["--replot", str(saved), str(png)]) == 0
    _assert_png(png)
    assert replay.main(["--replot", str(tmp_path / "missing.json"), str(png)]) == 1
    assert "not a replay --json result" in capsys.readouterr().err
