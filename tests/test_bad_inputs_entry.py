"""Bad arguments of the Megatron-LM entry point (issue 37), refused by our checks before Megatron
builds anything (megatron_patches/megatron_lm/arguments.py), each naming the flag and the fix.
In-process: the checks on a parsed namespace, no Megatron, no process."""
from __future__ import annotations

import pytest

from megatron_patches.megatron_lm.arguments import check_prefix_reuse_args
from test_megatron_lm_units import _args

GDN = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4)
MAMBA = dict(hybrid_layer_pattern="M-M*M-")

REFUSED = [  # (overrides, words the message must hold)
    ({**GDN, "linear_attention_freq": -1}, ["--linear-attention-freq -1", "N >= 1"]),
    ({**GDN, "linear_attention_freq": 0}, ["--linear-attention-freq 0", "N >= 1"]),
    ({"linear_attention_freq": -3}, ["--linear-attention-freq -3"]),
    ({"hybrid_layer_pattern": ""}, ["--hybrid-layer-pattern ''", "no layers"]),
    ({"hybrid_layer_pattern": "|"}, ["--hybrid-layer-pattern '|'", "no layers"]),
    ({**GDN, "context_parallel_size": 2, "prefix_reuse": True},
     ["--context-parallel-size 2", "Gated DeltaNet", "--context-parallel-size 1"]),
    ({**MAMBA, "context_parallel_size": 2, "prefix_reuse": True},
     ["--context-parallel-size 2", "Mamba", "--context-parallel-size 1"]),
]

ACCEPTED = [
    GDN, MAMBA, {**GDN, "linear_attention_freq": [1, 1, 1, 0]},
    {**GDN, "linear_attention_freq": 1, "context_parallel_size": 2, "prefix_reuse": True},
    {"hybrid_layer_pattern": "**--", "context_parallel_size": 2, "prefix_reuse": True},
    {**MAMBA, "context_parallel_size": 2},  # dense: Megatron's own checks decide
]


@pytest.mark.parametrize("overrides, words", REFUSED, ids=[str(c[0]) for c in REFUSED])
def test_layer_pattern_arguments_are_refused_before_building(overrides, words):
    with pytest.raises(ValueError) as info:
        check_prefix_reuse_args(_args(**overrides))
    assert all(w in str(info.value) for w in words), info.value


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[str(c) for c in ACCEPTED])
def test_layer_patterns_that_build_are_accepted(overrides):
    check_prefix_reuse_args(_args(**overrides))


def test_output_directories_are_checked_before_the_run(tmp_path):
    """--save to a read-only directory failed after iteration 1; now a write probe refuses it
    before any compute (root included: chattr +i, else sysfs)."""
    from test_bad_inputs_tools_limits import read_only_dir

    from megatron_patches.megatron_lm.arguments import check_output_dirs

    (tmp_path / "file").write_text("x")
    ro_gen = read_only_dir(tmp_path)
    ro = next(ro_gen)
    try:
        cases = [(dict(save=str(ro / "ckpt")), ["--save", "cannot write"]),
                 (dict(save=str(tmp_path / "file")), ["--save", "is a file"]),
                 (dict(export_hf=str(tmp_path / "file" / "hf")), ["--export-hf", "is a file"]),
                 (dict(tensorboard_dir=str(ro)), ["--tensorboard-dir", "cannot write"])]
        for overrides, words in cases:
            with pytest.raises(ValueError) as info:
                check_output_dirs(_args(**overrides))
            assert all(w in str(info.value) for w in words), info.value
        check_output_dirs(_args(save=str(tmp_path / "new" / "ckpt")))
        assert not (tmp_path / "new").exists()
    finally:
        next(ro_gen, None)


def _trace(tmp_path, name="t.jsonl.gz", max_seq_len=64, steps=3):
    import subprocess as _  # noqa: F401  (tools run in-process)
    from tools_import import tool

    path = tmp_path / name
    assert tool("trace").main(["synth", "--kind", "rag", "--steps", str(steps), "--max-seq-len",
                               str(max_seq_len), "--vocab-size", "512", "--out", str(path)]) == 0
    return path


def _truncated(tmp_path):
    good = _trace(tmp_path, steps=8)
    data = good.read_bytes()
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(data[:len(data) * 2 // 3])
    return bad


TRACE_CASES = [  # (make the trace, --seq-length, words)
    (_truncated, 64, ["corrupt or truncated", "cut.jsonl.gz"]),
    (lambda p: _trace(p, max_seq_len=64), 16, ["over --seq-length 16", "--seq-length"]),
]


@pytest.mark.parametrize("make, seq_length, words", TRACE_CASES, ids=["truncated gz", "long rows"])
def test_rl_trace_is_read_whole_before_iteration_1(make, seq_length, words, tmp_path):
    from types import SimpleNamespace

    from megatron_patches.megatron_lm import data

    args = SimpleNamespace(rl_trace=str(make(tmp_path)), rl_trace_format=None,
                           padded_vocab_size=512, seq_length=seq_length)
    with pytest.raises(ValueError) as info:
        data.open_step_source(args)
    assert all(w in str(info.value) for w in words), info.value
