"""Importers: the generic one-line-per-trajectory layout and Megatron-LM's rollout dumps."""
import json

import pytest
import torch

from prefix_schedule.traces import read_steps
from prefix_schedule.traces.generic import import_generic
from prefix_schedule.traces.megatron_rl import (import_megatron_rollouts, megatron_advantages,
                                                megatron_dump_files)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generic_groups_by_id_or_prompt_and_keeps_order(tmp_path):
    rows = [
        {"step": 10, "group": "a", "prompt": [1, 2, 3], "response": [4, 5], "advantage": 1.0,
         "response_mask": [True, False], "old_logprobs": [-1.0, -2.0], "reward": 1.0},
        {"step": 10, "group": "b", "prompt": [9, 9], "response": [7], "advantage": -1.0,
         "response_mask": [1], "old_logprobs": [-0.5], "reward": 0.0},
        {"step": 10, "group": "a", "prompt": [1, 2, 3], "response": [6], "advantage": [0.25],
         "response_mask": [1], "old_logprobs": [-0.1], "reward": 0.5},
        {"step": 11, "prompt": [5, 6], "response": [1, 1, 1], "advantage": 0.0},
        {"step": 11, "prompt": [5, 6], "response": [2], "advantage": 0.0},
        {"step": 11, "prompt": [8], "response": [2], "advantage": 0.0},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert import_generic(src, tmp_path / "t.jsonl", vocab_size=16) == 2
    step0, step1 = list(read_steps(tmp_path / "t.jsonl"))
    a, b = step0.groups
    assert a.prefix.tolist() == [1, 2, 3] and [t.suffix.tolist() for t in a.trajectories] == [[4, 5], [6]]
    assert a.trajectories[0].loss_mask.tolist() == [1.0, 0.0]
    assert a.trajectories[1].advantages.tolist() == [0.25]
    assert a.trajectories[0].old_logprobs.tolist() == [-1.0, -2.0] and b.prefix.tolist() == [9, 9]
    assert [len(g.trajectories) for g in step1.groups] == [2, 1]
    assert step1.groups[0].trajectories[0].old_logprobs is None


@pytest.mark.parametrize("rows,words", [
    ([{"step": 0, "group": 1, "prompt": [1, 2], "response": [3], "advantage": 0.0},
      {"step": 0, "group": 1, "prompt": [1, 5], "response": [3], "advantage": 0.0}],
     "differs from its first trajectory's (line 1) at token 1"),
    ([{"step": 0, "prompt": [1], "response": [3], "advantage": 0.0},
      {"step": 1, "prompt": [1], "response": [3], "advantage": 0.0},
      {"step": 0, "prompt": [1], "response": [3], "advantage": 0.0}], "step 0 appears again"),
    ([{"step": 0, "prompt": [1], "response": [3], "advantage": 0.0, "old_logprobs": [-1.0]},
      {"step": 0, "prompt": [1], "response": [3], "advantage": 0.0}], "old_logprobs is missing"),
    ([{"step": 0, "prompt": [1], "response": [3]}], "missing field(s) ['advantage']"),
    ([{"step": 0, "prompt": [1], "response": [3], "advantage": float("nan")}],
     "response 0: advantages is nan"),
    ([{"step": 0, "prompt": [1], "response": [99], "advantage": 0.0}], "token 99, outside [0, 16)"),
    ([{"step": 0, "prompt": [1], "response": [3], "advantages": 0.0}], "unknown field(s)"),
])
def test_generic_errors_name_the_line(tmp_path, rows, words):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(ValueError) as info:
        import_generic(src, tmp_path / "t.jsonl", vocab_size=16)
    assert words in str(info.value), str(info.value)


def rollout(tokens, generated_from, reward, logprobs=True, turns=None):
    """A TokenRollout.model_dump() of one turn (or `turns`: list of (tokens, gen_from))."""
    turns = turns or [(tokens, generated_from)]
    masks = [[p >= g for p in range(len(t))] for t, g in turns]
    lps = [[-0.1 * (k + 1) for k in range(sum(m))] for m in masks] if logprobs else None
    return {"trajectory": [t for t, _ in turns], "reward": reward, "generation_mask": masks,
            "logprobs": lps, "env_id": "env", "problem_id": "p", "completion_ids": [],
            "generation_cap": None, "rollout_status": "ok", "failure_reason": None}


def dump(tmp_path, rank, iteration, groups):
    path = tmp_path / f"rollouts_rank{rank}_iteration{iteration}_env.json"
    path.write_text(json.dumps(groups))
    return path


def test_megatron_rollouts_become_groups(tmp_path):
    prompt = [1, 7, 7, 7]
    g0 = [rollout(prompt + [3, 4, 2], 4, 1.0), rollout(prompt + [5, 2], 4, 0.0),
          {**rollout([], 0, 0.0), "trajectory": [], "generation_mask": [], "logprobs": []}]
    multi = rollout(None, None, 2.0, turns=[(prompt + [3], 4), (prompt + [3, 9, 9, 6], 7)])
    g1 = [multi, rollout(prompt + [3, 8], 4, 0.0)]
    dump(tmp_path, 1, 5, [[g0[0]]])  # another rank's copy of iteration 5: not used
    dump(tmp_path, 0, 5, [g0, g1])
    dump(tmp_path, 0, 7, [[g0[2]], g0[:2]])  # an all-placeholder group is dropped
    files = megatron_dump_files([tmp_path])
    assert [f.name for f in files] == ["rollouts_rank0_iteration5_env.json",
                                       "rollouts_rank0_iteration7_env.json"]
    summary = import_megatron_rollouts([tmp_path], tmp_path / "t.jsonl", vocab_size=16)
    assert summary["steps"] == 2 and summary["groups"] == 3 and summary["dropped_groups"] == 1
    step0, step1 = list(read_steps(tmp_path / "t.jsonl"))
    a, b = step0.groups
    assert a.prefix.tolist() == prompt and len(a.trajectories) == 2  # placeholder dropped
    adv = megatron_advantages([1.0, 0.0, 0.0], [True, True, False])
    assert adv[2] == 0.0 and adv[0] == pytest.approx(0.5 / (1e-4 + 0.5))
    assert a.trajectories[0].advantages.tolist() == pytest.approx([adv[0]] * 3)
    assert a.trajectories[0].old_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3])
    # multi-turn chain: one row, loss on both generated spans, not on the tool tokens 9, 9
    assert b.prefix.tolist() == prompt + [3][:0]
    first = b.trajectories[0]
    assert first.suffix.tolist() == [3, 9, 9, 6] and first.loss_mask.tolist() == [1, 0, 0, 1]
    assert first.old_logprobs.tolist() == pytest.approx([-0.1, 0.0, 0.0, -0.1])
    assert len(step1.groups) == 1


def test_megatron_refusals_and_missing_logprobs(tmp_path):
    prompt = [1, 2]
    short = rollout(prompt + [3, 4], 2, 1.0)
    short["logprobs"] = [[-0.5]]  # one log-prob for two generated tokens
    path = dump(tmp_path, 0, 0, [[short, rollout(prompt + [5], 2, 0.0)]])
    with pytest.raises(ValueError, match="1 inference log-probs for 2 generated tokens"):
        import_megatron_rollouts([path], tmp_path / "t.jsonl")
    import_megatron_rollouts([path], tmp_path / "t.jsonl", missing_logprobs="mask")
    t = next(read_steps(tmp_path / "t.jsonl")).groups[0].trajectories[0]
    assert t.loss_mask.tolist() == [1, 0] and t.old_logprobs.tolist() == [-0.5, 0.0]
    import_megatron_rollouts([path], tmp_path / "n.jsonl", old_logprobs="none")
    assert next(read_steps(tmp_path / "n.jsonl")).groups[0].trajectories[0].old_logprobs is None
    text = dump(tmp_path, 0, 1, [[{"trajectory": ["hello"], "reward": 1.0}]])
    with pytest.raises(ValueError, match="text Rollout"):
        import_megatron_rollouts([text], tmp_path / "x.jsonl")
    apart = dump(tmp_path, 0, 2, [[rollout([1, 3], 1, 1.0), rollout([2, 3], 1, 0.0)]])
    with pytest.raises(ValueError, match="share no leading token"):
        import_megatron_rollouts([apart], tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="no such file"):
        megatron_dump_files([tmp_path / "absent"])


def test_megatron_non_chain_turns_become_rows(tmp_path):
    turns = [([1, 2, 5, 6], 2), ([1, 2, 7], 2)]  # turn 1 does not extend turn 0
    path = dump(tmp_path, 0, 0, [[rollout(None, None, 1.0, turns=turns)]])
    import_megatron_rollouts([path], tmp_path / "t.jsonl")
    group = next(read_steps(tmp_path / "t.jsonl")).groups[0]
    assert group.prefix.tolist() == [1, 2]
    assert [t.suffix.tolist() for t in group.trajectories] == [[5, 6], [7]]
    assert all(torch.all(t.loss_mask == 1) for t in group.trajectories)


def test_importers_from_the_command_line(tmp_path, capsys):
    from tools_import import tool

    main = tool("trace").main
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"step": 0, "prompt": [1, 2], "response": [3], "advantage": 1.0},
        {"step": 0, "prompt": [1, 2], "response": [4, 5], "advantage": -1.0}])
    assert main(["import-generic", str(src), "--out", str(tmp_path / "g.jsonl")]) == 0
    assert main(["validate", str(tmp_path / "g.jsonl")]) == 0
    dump(tmp_path, 0, 3, [[rollout([1, 2, 3], 2, 1.0), rollout([1, 2, 4], 2, 0.0)]])
    assert main(["import-megatron", str(tmp_path), "--out", str(tmp_path / "m.jsonl.gz"),
                 "--vocab-size", "8"]) == 0
    assert "1 steps, 1 groups" in capsys.readouterr().out
    assert main(["stats", str(tmp_path / "m.jsonl.gz")]) == 0
    assert main(["import-megatron", str(tmp_path), "--out", str(tmp_path / "x.jsonl"),
                 "--vocab-size", "4"]) == 1
    assert "outside [0, 4)" in capsys.readouterr().err
