"""Dense vs AReaL's tree training vs prefix reuse, on the token measure (tools/peer_areal.py,
tests/test_fw_areal_tree.py).

For one batch of sequences and one micro-batch token budget, counted, not timed (tokens are
deterministic; step times on a shared CPU are noise):
- dense: AReaL's own dense split (`split_padded_tensor_dict_into_mb_list` with
  `max_tokens_per_mb` = budget): micro-batches and tokens fed (every sequence whole); a
  sequence longer than the budget is AReaL's refusal (its packer raises);
- AReaL tree: AReaL's own trie packer (`_greedy_build_tries`, the core of
  `build_packed_tree_batch`, which its engine calls with `enable_tree_training`;
  `pad_to_maximum=True`, which it requires): trees, tree tokens (the trie's distinct tokens) and
  tokens fed to the model (each tree padded to the budget, as build_packed_tree_batch pads). A
  sequence longer than the budget is AReaL's refusal (a tree must fit one micro-batch);
- ours: the prefix-reuse plan (prefix_schedule detect + plan_with_policy, token budget = the
  budget, prefixes longer than the budget cut into chunks of the budget): prefix tokens (run once
  per shared node) + suffix micro-batch rows, padding included.
Nothing runs a model here: AReaL's tree attention (FlexAttention, torch.compile'd, or its Triton
kernel) is not needed to count what it computes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["PeerCounts", "grpo_workload", "multi_turn_workload", "padded_batch", "count_dense",
           "count_areal_tree", "count_ours", "compare", "format_rows"]


@dataclass
class PeerCounts:
    method: str
    budget: int
    micro_batches: Optional[int]
    tokens_fed: Optional[int]
    """Tokens through the model's layers (padding included): the work measure."""
    distinct_tokens: Optional[int]
    """Tokens of real data computed (padding excluded)."""
    note: str = ""


def grpo_workload(prefix: int = 4096, group: int = 16, suffix: int = 256, *, seed: int = 0,
                  vocab: int = 32000) -> List[torch.Tensor]:
    """One prompt of `prefix` tokens, `group` responses of `suffix` tokens each."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (prefix,), generator=gen)
    return [torch.cat([prompt, torch.randint(1, vocab, (suffix,), generator=gen)])
            for _ in range(group)]


def multi_turn_workload(*, system: int = 1024, conversations: int = 4, turns: int = 3,
                        turn: int = 512, samples: int = 4, answer: int = 256, seed: int = 1,
                        vocab: int = 32000) -> List[torch.Tensor]:
    """A multi-turn tree: one system prompt; `conversations` conversations of `turns` turns of
    `turn` tokens each; at every turn `samples` sampled answers of `answer` tokens (each a
    sequence: the history so far + its answer). A tree of depth turns + 1."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(1, vocab, (n,), generator=gen)
    head = tokens(system)
    out = []
    for _ in range(conversations):
        history = head
        for _ in range(turns):
            history = torch.cat([history, tokens(turn)])
            out += [torch.cat([history, tokens(answer)]) for _ in range(samples)]
    return out


def padded_batch(sequences: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """AReaL's padded batch of `sequences` (right padding)."""
    S = max(s.numel() for s in sequences)
    ids = torch.zeros(len(sequences), S, dtype=torch.int64)
    mask = torch.zeros(len(sequences), S, dtype=torch.bool)
    for b, s in enumerate(sequences):
        ids[b, :s.numel()], mask[b, :s.numel()] = s, True
    return {"input_ids": ids, "attention_mask": mask,
            "loss_mask": mask.int(), "logprobs": torch.zeros(ids.shape)}


def count_dense(sequences, budget: int) -> PeerCounts:
    from areal.api.cli_args import MicroBatchSpec
    from areal.utils.data import split_padded_tensor_dict_into_mb_list
    tokens = sum(s.numel() for s in sequences)
    longest = max(s.numel() for s in sequences)
    try:
        mbs = split_padded_tensor_dict_into_mb_list(padded_batch(sequences),
                                                    MicroBatchSpec(max_tokens_per_mb=budget))
    except (RuntimeError, ValueError) as error:  # AReaL's packer: a sequence over the budget
        return PeerCounts("dense (AReaL split)", budget, None, None, None,
                          f"refused: a {longest}-token sequence does not fit ({str(error)[-40:]})")
    return PeerCounts("dense (AReaL split)", budget, len(mbs.mbs), tokens, tokens, "")


def count_areal_tree(sequences, budget: int, *, full_packer: bool = False) -> PeerCounts:
    """AReaL's trie packing at `budget`. Counted with `_greedy_build_tries`, the packer core that
    `build_packed_tree_batch` calls (`full_packer=True` runs the whole function: it also builds a
    dense budget x budget attention mask per tree and sums it in int64, 32 GiB at a 64k budget,
    so it is for small budgets only; tests/test_fw_areal_tree.py checks both agree)."""
    from areal.api.cli_args import MicroBatchSpec
    from areal.models.tree_attn.tree import _greedy_build_tries, build_packed_tree_batch
    data = padded_batch(sequences)
    try:
        if full_packer:
            mbs = build_packed_tree_batch(data, mb_spec=MicroBatchSpec(max_tokens_per_mb=budget),
                                          pad_to_maximum=True)
            trees, fed = len(mbs.mbs), sum(mbs.padded_to_lengths)
            real = sum(mbs.group_lens)
        else:
            from areal.models.tree_attn.constants import BLOCK_SIZE
            if budget % BLOCK_SIZE:  # build_packed_tree_batch's own check (pad_to_maximum)
                raise ValueError(f"max_tokens_per_tree ({budget}) must be a multiple of {BLOCK_SIZE}")
            tries, lens = _greedy_build_tries(data, budget)
            trees, fed, real = len(tries), len(tries) * budget, sum(lens)
    except ValueError as error:
        return PeerCounts("AReaL tree", budget, None, None, None, f"refused: {error}")
    return PeerCounts("AReaL tree", budget, trees, fed, real,
                      "each tree padded to the budget (pad_to_maximum, required)")


def count_ours(sequences, budget: int, *, min_shared_len: int = 8) -> PeerCounts:
    from prefix_schedule.planning.detect import FlatTrajectory, detect_prefix_trees
    from prefix_schedule.planning.flops import ModelDims
    from prefix_schedule.planning.policy import ReusePolicy, plan_with_policy
    flats = []
    for s in sequences:  # prompt-free loss placement: every non-shared token trains
        mask = torch.zeros(s.numel())
        flats.append(FlatTrajectory(tokens=s, loss_mask=mask, advantages=torch.zeros(s.numel())))
    shared = _shared_lengths(sequences)
    for f, n in zip(flats, shared):
        f.loss_mask[max(n, 1):] = 1.0
    detection = detect_prefix_trees(flats, min_shared_len=min_shared_len)
    longest_prefix = max(g.context_len(len(g.trajectories) - 1) for g in detection.batch.groups)
    chunk = budget if longest_prefix > budget else None
    dims = ModelDims(num_layers=32, hidden_size=4096, ffn_hidden_size=11008,
                     num_attention_heads=32, num_query_groups=8, vocab_size=32000,
                     gated_linear_unit=True, kv_channels=128)
    planned = plan_with_policy(detection.batch, policy=ReusePolicy(dims=dims, token_budget=budget),
                               max_seq_len=max(s.numel() for s in sequences) + 1,
                               prefix_chunk_tokens=chunk)
    plan = planned.plan
    prefix = sum(p.length for p in plan.prefixes)
    rows = sum(mb.row_length for mb in plan.microbatches)
    real = prefix + sum(mb.num_tokens for mb in plan.microbatches)
    units = len(plan.prefixes) if chunk is None else sum(-(-p.length // chunk) for p in plan.prefixes)
    return PeerCounts("ours (prefix reuse)", budget, len(plan.microbatches) + units, prefix + rows,
                      real, f"{prefix} prefix tokens once"
                      + (f", in chunks of {chunk}" if chunk else ""))


def _shared_lengths(sequences) -> List[int]:
    """Per sequence, the longest prefix it shares with another (its loss starts after)."""
    out = []
    for i, s in enumerate(sequences):
        best = 0
        for j, t in enumerate(sequences):
            if i != j:
                n = min(s.numel(), t.numel())
                differ = (s[:n] != t[:n]).nonzero()
                best = max(best, int(differ[0]) if differ.numel() else n)
        out.append(best)
    return out


def compare(sequences, budgets: Sequence[int]) -> List[dict]:
    rows = []
    for budget in budgets:
        for count in (count_dense, count_areal_tree, count_ours):
            rows.append(asdict(count(sequences, budget)))
    return rows


def format_rows(rows: List[dict]) -> str:
    head = f"{'budget':>7} {'method':<20} {'mbs':>4} {'tokens fed':>11} {'real tokens':>11}  note"
    lines = [head]
    for r in rows:
        def num(v):
            return "-" if v is None else str(v)
        lines.append(f"{r['budget']:>7} {r['method']:<20} {num(r['micro_batches']):>4} "
                     f"{num(r['tokens_fed']):>11} {num(r['distinct_tokens']):>11}  {r['note']}")
    return "\n".join(lines)
