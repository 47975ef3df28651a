"""Import Megatron-LM RL rollout dumps (megatron/rl, `train_rl.py --langrl-log-dir DIR`).

With a log dir, Megatron-LM writes every iteration's rollouts before training on them
(`get_environment_rollouts` in megatron/rl/rl_utils.py) as
`rollouts_rank{R}_iteration{N}_{env}.json`: a JSON list of groups, each a list of rollouts
(`TokenRollout.model_dump()`, megatron/rl/types/rollout.py):

    {"trajectory": [[..turn 0 token ids..], [..turn 1..]], "reward": 1.0,
     "generation_mask": [[false, ..., true, ...], ...], "logprobs": [[...], ...],
     "env_id": "...", "problem_id": "...", "rollout_status": "ok", ...}

What Megatron-LM then trains (`prepare_data_for_update`), and so what this importer writes:
- one row per rollout: the last turn's tokens (each turn re-encodes the conversation before
  it), its loss positions the union of the turns' generation masks (token p is trained by
  predicting it from p-1: `generation_mask[:, 1:]`); a multi-turn rollout whose turns do not
  extend each other becomes one row per turn (Megatron's fallback);
- advantages from `calculate_grpo_advantages`: (r - mean) / (1e-4 + std), population std over
  the group's real rollouts; empty-trajectory placeholders get 0 and train nothing (dropped here);
- old log-probs: the inference log-probs, scattered onto the generated positions in order
  (Megatron's `align_unpacked_inference_logprobs`); reference log-probs are not in the dump.
Megatron-LM flattens the groups before packing ("expand rollouts getting rid of the groups");
the dump still has them. The group's shared prefix is the longest token prefix its rows share,
ending before the first generated token of any row.

Files of the same iteration from several ranks hold the same rollouts (broadcast before the
dump): the lowest rank's is used. Text `Rollout`s (no token ids) are refused: they need the
tokenizer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from prefix_schedule.traces.format import TraceHeader, group_from_record
from prefix_schedule.traces.io import PathLike, TraceWriter

__all__ = ["import_megatron_rollouts", "megatron_dump_files", "megatron_advantages"]

_NAME = re.compile(r"rollouts_rank(\d+)_iteration(\d+)_")


def megatron_dump_files(paths: list[PathLike]) -> list[Path]:
    """The dump files to import, one per iteration, in iteration order (directories are searched
    for rollouts_rank*_iteration*_*.json; files without that name keep the order given)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(path.glob("rollouts_rank*_iteration*_*.json"))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or directory")
    if not files:
        raise ValueError(f"no rollouts_rank*_iteration*_*.json files under {[str(p) for p in paths]}")
    named = [(m, f) for f in files if (m := _NAME.match(f.name))]
    if len(named) != len(files):
        return files
    best: dict[int, tuple[int, Path]] = {}
    for match, f in named:
        rank, iteration = int(match.group(1)), int(match.group(2))
        if iteration not in best or rank < best[iteration][0]:
            best[iteration] = (rank, f)
    return [best[i][1] for i in sorted(best)]


def megatron_advantages(rewards: list[float], real: list[bool]) -> list[float]:
    """Megatron-LM's calculate_grpo_advantages for one group (placeholders -> 0)."""
    values = [r for r, ok in zip(rewards, real) if ok]
    count = max(len(values), 1)
    mean = sum(values) / count
    std = (sum((v - mean) ** 2 for v in values) / count) ** 0.5
    return [(r - mean) / (1e-4 + std) if ok else 0.0 for r, ok in zip(rewards, real)]


def _reward(rollout: dict, where: str) -> float:
    reward = rollout.get("reward")
    if isinstance(reward, list) and len(reward) == 1:
        reward = reward[0]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"{where}: reward {reward!r}; Megatron-LM's GRPO needs one number per rollout")
    return float(reward)


def _rows(rollout: dict, where: str) -> list[tuple[list, list, Optional[list]]]:
    """(tokens, generated mask, inference logprobs) per training row of one token rollout."""
    turns = rollout["trajectory"]
    if not all(isinstance(t, list) for t in turns):
        raise ValueError(f"{where}: a text Rollout (trajectory of strings); import needs token "
                         "rollouts (TokenRollout) -- tokenize with the training tokenizer first")
    masks, logprobs = rollout.get("generation_mask"), rollout.get("logprobs")
    if masks is None or len(masks) != len(turns):
        raise ValueError(f"{where}: generation_mask is missing or has {len(masks or [])} turns for "
                         f"{len(turns)}; without it the trained tokens are unknown")
    if logprobs is not None and len(logprobs) != len(turns):
        raise ValueError(f"{where}: logprobs has {len(logprobs)} turns for {len(turns)}")
    chain = all(len(a) <= len(b) and b[:len(a)] == a for a, b in zip(turns, turns[1:]))
    if len(turns) == 1 or chain:
        union = [False] * len(turns[-1])
        for mask in masks:
            for p, generated in enumerate(mask):
                union[p] = union[p] or bool(generated)
        lps = None if logprobs is None else [lp for turn in logprobs for lp in turn]
        return [(turns[-1], union, lps)]
    return [(turns[k], [bool(v) for v in masks[k]],
             None if logprobs is None else logprobs[k]) for k in range(len(turns))]


def _shared_prefix(rows: list[tuple[list, list, Optional[list]]]) -> int:
    first = rows[0][0]
    length = min(len(tokens) for tokens, _, _ in rows)
    for tokens, mask, _ in rows:
        generated = next((p for p, g in enumerate(mask) if g), len(tokens))
        length = min(length, generated)
        length = next((i for i in range(length) if tokens[i] != first[i]), length)
    return length


def _old_logprobs(tokens, mask, lps, prefix_len, where, missing) -> tuple[list, list]:
    """(loss mask, old log-probs) over the suffix tokens[prefix_len:]."""
    generated = [p for p, g in enumerate(mask) if g]
    loss = [1 if p < len(mask) and mask[p] else 0 for p in range(prefix_len, len(tokens))]
    if lps is None:
        return loss, None
    if len(lps) > len(generated) or (len(lps) < len(generated) and missing == "error"):
        raise ValueError(f"{where}: {len(lps)} inference log-probs for {len(generated)} generated "
                         "tokens; with --missing-logprobs mask the tokens without one get no loss, "
                         "with --old-logprobs none the trace has no old log-probs")
    old = [0.0] * (len(tokens) - prefix_len)
    for k, p in enumerate(generated):
        if k < len(lps):
            old[p - prefix_len] = float(lps[k])
        else:  # no inference log-prob for this generated token (e.g. an EOD added on the train side)
            loss[p - prefix_len] = 0
    return loss, [0.0 if 0.0 < v <= 1e-6 else v for v in old]  # rounding above log 1 = 0


def group_record(rollouts: list, *, step: int, where: str, old_logprobs: str = "inference",
                 missing: str = "error") -> Optional[dict]:
    """One Megatron-LM group (list of rollout dicts) -> a trace record (None if all placeholders)."""
    if not isinstance(rollouts, list) or not rollouts:
        raise ValueError(f"{where}: expected a non-empty list of rollouts")
    real = [bool(r.get("trajectory")) for r in rollouts]
    rewards = [_reward(r, f"{where}, rollout {i}") if ok else 0.0
               for i, (r, ok) in enumerate(zip(rollouts, real))]
    advantages = megatron_advantages(rewards, real)
    rows, row_adv, row_rewards = [], [], []
    for i, rollout in enumerate(rollouts):
        if real[i]:
            for row in _rows(rollout, f"{where}, rollout {i}"):
                rows.append(row)
                row_adv.append(advantages[i])
                row_rewards.append(rewards[i])
    if not rows:
        return None
    p = _shared_prefix(rows)
    if p < 1:
        raise ValueError(f"{where}: the rollouts share no leading token before their generated "
                         "tokens; a group needs a common prompt")
    record = {"step": step, "prompt": list(rows[0][0][:p]), "responses": [], "advantages": row_adv,
              "loss_mask": [], "rewards": row_rewards}
    use_lps = old_logprobs == "inference" and all(lps is not None for _, _, lps in rows)
    if use_lps:
        record["old_logprobs"] = []
    for k, (tokens, mask, lps) in enumerate(rows):
        if len(tokens) <= p:
            raise ValueError(f"{where}, row {k}: no tokens after the shared {p}-token prompt")
        loss, old = _old_logprobs(tokens, mask, lps if use_lps else None, p, f"{where}, row {k}",
                                  missing)
        record["responses"].append(list(tokens[p:]))
        record["loss_mask"].append(loss)
        if use_lps:
            record["old_logprobs"].append(old)
    return record


def import_megatron_rollouts(paths: list[PathLike], out: PathLike, *, vocab_size: Optional[int] = None,
                             old_logprobs: str = "inference", missing_logprobs: str = "error") -> dict:
    """Convert Megatron-LM rollout dumps (one file per iteration) to a trace; returns a summary
    (steps, groups, dropped placeholder groups, files used)."""
    if old_logprobs not in ("inference", "none") or missing_logprobs not in ("error", "mask"):
        raise ValueError("old_logprobs must be 'inference' or 'none'; missing_logprobs 'error' or 'mask'")
    files = megatron_dump_files(paths)
    header = TraceHeader(vocab_size=vocab_size, source="import-megatron " + " ".join(f.name for f in files))
    summary = {"steps": 0, "groups": 0, "dropped_groups": 0, "files": [str(f) for f in files]}
    with TraceWriter(out, header) as writer:
        for step, path in enumerate(files):
            groups = _load(path)
            for g, rollouts in enumerate(groups):
                where = f"{path.name}: group {g}"
                record = group_record(rollouts, step=step, where=where, old_logprobs=old_logprobs,
                                      missing=missing_logprobs)
                if record is None:
                    summary["dropped_groups"] += 1
                    continue
                group = group_from_record(record, where=where, vocab_size=vocab_size)
                writer.write_group(group, step=step, rewards=record["rewards"])
                summary["groups"] += 1
            summary["steps"] += 1
        if not summary["groups"]:
            raise ValueError(f"{', '.join(summary['files'])}: no group with a real rollout (all "
                             f"{summary['dropped_groups']} are placeholders); nothing to import")
    return summary


def _load(path: Path) -> list:
    try:
        groups = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: byte {exc.start} is not UTF-8; a rollout dump is UTF-8 JSON "
                         "(is it the right file?)") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to parse (is it a rollout dump?)") from None
    if not isinstance(groups, list):
        raise ValueError(f"{path}: expected a JSON list of groups (Megatron-LM's rollout dump)")
    return [g["rollouts"] if isinstance(g, dict) and "rollouts" in g else g for g in groups]
