"""The trace format: round trips, one clear error per malformed field, streaming, synthetic
traces (reproducible, realistic shares), the CLI. No Megatron."""
import gzip
import json

import pytest
import torch

from prefix_schedule.planning.data import Group, GroupBatch, Trajectory
from prefix_schedule.traces import (TraceHeader, TraceWriter, read_header, read_steps,
                                    validate_trace)
from prefix_schedule.traces.synth import SynthConfig, synth_steps
from tools_import import tool

HEADER = {"format": "prefix-reuse-trace", "version": 1, "vocab_size": 100, "source": "test",
          "metadata": {}}
GOOD = {"step": 0, "prompt": [1, 2, 3], "responses": [[4, 5], [6]], "advantages": [0.5, [1.0]],
        "loss_mask": [[1, 0], [1]], "old_logprobs": [[-1.0, -2.0], [-0.5]],
        "ref_logprobs": [[-1.5, -2.5], [-0.25]]}


def write_lines(path, *records, header=HEADER):
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_round_trip_keeps_every_value(tmp_path):
    gen = torch.Generator().manual_seed(0)
    groups = [Group(prefix=torch.randint(0, 50, (7,), generator=gen), trajectories=[
        Trajectory(suffix=torch.randint(0, 50, (n,), generator=gen),
                   loss_mask=(torch.rand(n, generator=gen) > 0.3).float(),
                   advantages=torch.randn(n, generator=gen),
                   old_logprobs=-torch.rand(n, generator=gen), ref_logprobs=None)
        for n in (3, 5)]) for _ in range(3)]
    for name in ("t.jsonl", "t.jsonl.gz"):
        with TraceWriter(tmp_path / name, TraceHeader(vocab_size=50, source="x")) as w:
            w.write_group(groups[0], step=0)
            w.write_group(groups[1], step=0)
            w.write_group(groups[2], step=1)
        steps = list(read_steps(tmp_path / name))
        assert [len(b.groups) for b in steps] == [2, 1]
        for got, want in zip([g for b in steps for g in b.groups], groups):
            assert torch.equal(got.prefix, want.prefix)
            for a, b in zip(got.trajectories, want.trajectories):
                for field in ("suffix", "loss_mask", "advantages", "old_logprobs"):
                    assert torch.equal(getattr(a, field), getattr(b, field)), field
                assert a.ref_logprobs is None
    assert gzip.open(tmp_path / "t.jsonl.gz").read(1) == b"{"
    assert read_header(tmp_path / "t.jsonl").vocab_size == 50


BAD = [  # (change to GOOD, words the error must contain)
    ({"responses": []}, "at least one response"),
    ({"prompt": []}, "prompt: expected a non-empty list"),
    ({"responses": [[4, 5], []], "advantages": [0.5, 1.0]}, "response 1: tokens"),
    ({"advantages": [float("nan"), [1.0]]}, "response 0: advantages is nan"),
    ({"advantages": [[0.5, float("nan")], [1.0]]}, "advantages[1] is nan"),
    ({"advantages": [0.5]}, "\"advantages\" has 1 entries but there are 2 responses"),
    ({"advantages": [[0.5], [1.0]]}, "advantages has 1 entries but the response has 2 tokens"),
    ({"advantages": [2e6, 1.0]}, "normalise the advantages"),
    ({"loss_mask": [[1, 0, 1], [1]]}, "loss_mask has 3 entries"),
    ({"loss_mask": [[1, 2], [1]]}, "only 0 and 1"),
    ({"old_logprobs": [[-1.0, 0.5], [-0.5]]}, "log-probability is <= 0"),
    ({"ref_logprobs": [[-1.0, float("inf")], [-0.5]]}, "ref_logprobs[1] is inf"),
    ({"prompt": [1, 2, 300]}, "prompt[2] is token 300, outside [0, 100)"),
    ({"responses": [[4, -5], [6]]}, "tokens[1] is token -5"),
    ({"responses": [[4, 5.0], [6]]}, "token ids must be integers"),
    ({"advantage": [1, 2]}, "unknown field(s) ['advantage']"),
    ({"prompt": None}, "prompt: expected a non-empty list"),
]


@pytest.mark.parametrize("change,words", BAD, ids=[w[:30] for _, w in BAD])
def test_every_malformed_field_is_named(tmp_path, change, words):
    record = {**GOOD, **change}
    path = write_lines(tmp_path / "t.jsonl", GOOD, record)
    with pytest.raises(ValueError) as info:
        validate_trace(path)
    message = str(info.value)
    assert words in message, message
    assert "t.jsonl:3 (step 0, group 1)" in message, message


def test_missing_fields_bad_json_header_and_step_order(tmp_path):
    missing = {k: v for k, v in GOOD.items() if k != "advantages"}
    cases = [
        ((GOOD, missing), "missing field(s) ['advantages']"),
        ((GOOD, "{not json"), "t.jsonl:3: not valid JSON"),
        ((GOOD, {**GOOD, "step": 2}), "step 2 after step 0"),
        ((GOOD, {**GOOD, "step": -1}), "t.jsonl:3: step -1 after step 0"),
        ((GOOD, {**GOOD, "step": "1"}), "step='1'; give the optimizer step as an int"),
        ((GOOD, {**GOOD, "step": 1}, {**GOOD, "step": 0}), "step 0 after step 1"),
        ((), "header but no groups"),
        ((GOOD, {**GOOD, "step": 1, "old_logprobs": None}), "old_logprobs are absent"),
    ]
    for records, words in cases:
        path = write_lines(tmp_path / "t.jsonl", *records)
        with pytest.raises(ValueError, match=None) as info:
            validate_trace(path)
        assert words in str(info.value), (words, str(info.value))
    for header, words in (({**HEADER, "version": 2}, "version 2 is not supported"),
                          ({"step": 0}, "not a trace header"),
                          ({**HEADER, "vocab": 3}, "unknown field(s) ['vocab']")):
        with pytest.raises(ValueError, match=None) as info:
            validate_trace(write_lines(tmp_path / "h.jsonl", GOOD, header=header))
        assert words in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="no such file"):
        validate_trace(tmp_path / "absent.jsonl")


def test_vocab_size_override_and_mixed_logprobs_in_a_step(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", GOOD)
    assert validate_trace(path).num_groups == 1
    with pytest.raises(ValueError, match="outside \\[0, 5\\)"):
        validate_trace(path, vocab_size=5)
    mixed = write_lines(tmp_path / "m.jsonl", GOOD, {k: v for k, v in GOOD.items()
                                                     if k != "ref_logprobs"})
    with pytest.raises(ValueError, match="step 0: .*ref_logprobs"):
        list(read_steps(mixed))


def test_reader_streams_a_step_at_a_time(tmp_path):
    """Step 0 arrives before the malformed line of step 1 is read."""
    path = write_lines(tmp_path / "t.jsonl", GOOD, GOOD, {**GOOD, "step": 1}, "{broken")
    steps = read_steps(path)
    first = next(steps)
    assert isinstance(first, GroupBatch) and len(first.groups) == 2
    with pytest.raises(ValueError, match=":5: not valid JSON"):
        next(steps)
    assert [len(b.groups) for b in read_steps(path, stop=1)] == [2]


def test_writer_refuses_out_of_order_steps(tmp_path):
    group = Group(prefix=[1, 2], trajectories=[Trajectory(suffix=[3], advantages=1.0)])
    with TraceWriter(tmp_path / "t.jsonl", TraceHeader()) as w:
        with pytest.raises(ValueError, match="write steps 0, 1, 2"):
            w.write_group(group, step=1)
        w.write_group(group, step=0)
        with pytest.raises(ValueError, match="in order"):
            w.write_group(group, step=2)


@pytest.mark.parametrize("kind,low,high", [("rag", 0.80, 0.98), ("math", 0.02, 0.12)])
def test_synth_is_reproducible_with_realistic_shares(tmp_path, kind, low, high):
    main = tool("trace").main

    args = ["synth", "--kind", kind, "--steps", "6", "--seed", "3", "--max-seq-len", "400",
            "--vocab-size", "300", "--group-sizes", "8,64"]
    assert main(args + ["--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(args + ["--out", str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert main(args[:6] + ["4"] + args[7:] + ["--out", str(tmp_path / "c.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    stats = validate_trace(tmp_path / "a.jsonl")
    shares = stats.prefix_shares
    assert low - 0.01 <= min(shares) and max(shares) <= high + 0.01, (min(shares), max(shares))
    assert set(stats.group_sizes) <= {8, 64} and stats.max_seq_len <= 400
    assert stats.has_old_logprobs and stats.has_ref_logprobs
    summary = stats.summary()
    ideal = summary["ideal_speedup"]["llama3-8b"]
    assert (ideal > 3) if kind == "rag" else (1.0 < ideal < 1.2), ideal
    assert main(["stats", str(tmp_path / "a.jsonl"), "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 6
    write_lines(tmp_path / "bad.jsonl", {**GOOD, "advantages": [float("nan"), 1.0]})
    assert main(["validate", str(tmp_path / "bad.jsonl")]) == 1


def test_synth_config_refuses_bad_values():
    with pytest.raises(ValueError, match="kind="):
        SynthConfig(kind="code", steps=1)
    with pytest.raises(ValueError, match="group_sizes"):
        SynthConfig(kind="rag", steps=1, group_sizes=(0,))
    batch, rewards = next(synth_steps(SynthConfig(kind="math", steps=1, group_sizes=(16,))))
    assert all(len(g.trajectories) == 16 for g in batch.groups) and len(rewards[0]) == 16
