"""tools/sweep.py's resume (issue 22): a point is skipped only when recorded under every
setting that changes it, and a truncated last CSV row is not a point that was measured.
The measurement is faked (no model): this tests the bookkeeping only."""
import csv

import pytest

from tools_import import tool


@pytest.fixture
def sweep(monkeypatch):
    module = tool("sweep")
    calls = []

    def fake_measure(models, dims, *, prefix_len, suffix_len, group_size, **kwargs):
        calls.append((prefix_len, suffix_len, group_size, kwargs["seed"], kwargs["reps"]))
        return {"dense_s": 2.0, "reuse_s": 1.0, "dense_cpu_s": 2.0, "reuse_cpu_s": 1.0,
                "ideal": 2.0, "ideal_full_reuse": 2.0, "microbatches": 1, "policy": "reuse",
                "grad_rel_diff": 0.0}

    monkeypatch.setattr(module, "measure_point", fake_measure)
    monkeypatch.setattr(module, "Models", lambda *a, **k: object())
    module.calls = calls
    return module


BASE = ["--points", "48:16:4,8:56:2", "--no-memory"]


def _rows(path):
    return list(csv.DictReader(open(path)))


@pytest.mark.parametrize("changed", [["--min-gain", "1.7"], ["--token-budget", "96"],
                                     ["--seed", "3"], ["--reps", "5"], ["--warmup", "2"],
                                     ["--threads", "2"], ["--no-policy"]])
def test_a_point_recorded_under_other_settings_is_measured_again(sweep, tmp_path, changed):
    out = str(tmp_path / "s.csv")
    assert sweep.main(BASE + ["--csv", out]) == 0
    assert len(sweep.calls) == 2
    assert sweep.main(BASE + ["--csv", out]) == 0  # same settings: both skipped
    assert len(sweep.calls) == 2
    assert sweep.main(BASE + ["--csv", out] + changed) == 0
    assert len(sweep.calls) == 4, f"{changed} resumed points measured under other settings"
    assert len(_rows(out)) == 4


def test_a_truncated_last_row_is_measured_again(sweep, tmp_path):
    out = tmp_path / "s.csv"
    assert sweep.main(BASE + ["--csv", str(out)]) == 0
    out.write_bytes(out.read_bytes()[:-7])  # killed while writing the second row
    assert sweep.main(BASE + ["--csv", str(out)]) == 0
    assert [c[:3] for c in sweep.calls] == [(48, 16, 4), (8, 56, 2), (8, 56, 2)]
    rows = _rows(out)
    assert [(r["prefix"], r["group_size"]) for r in rows] == [("48", "4"), ("8", "2")]
    assert all(None not in r.values() and None not in r for r in rows)


def test_a_csv_of_other_columns_is_refused(sweep, tmp_path, capsys):
    out = tmp_path / "s.csv"
    out.write_text("total,prefix,suffix\n1536,256,1280\n")
    assert sweep.main(BASE + ["--csv", str(out)]) == 1
    assert "not this sweep.py's" in capsys.readouterr().err
    assert sweep.calls == []
