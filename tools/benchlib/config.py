"""tools/bench.py's configuration: one dataclass field per command-line flag.

To add a flag, add a field with a default and a docstring (the --help text) to BenchConfig, and
its check to `__post_init__` if it needs one: `build_parser` derives `--the-name` from the field
(int, Optional[int] -> default None, bool -> store_true, str with metadata["choices"]).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path
from typing import Dict, Optional

from benchlib.capacity import check_budget_config, dense_rows
from benchlib.hybrid import check_hybrid, hybrid_dims
from benchlib.workload import config_batch
from prefix_schedule.attention import backends as attention_backends
from prefix_schedule.planning.data import GroupBatch
from prefix_schedule.planning.flops import ModelDims
from prefix_schedule.planning.placement import Placement, place_groups

__all__ = ["BenchConfig", "RECOMPUTE", "build_parser", "config_from_args"]

RECOMPUTE = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Workload, model shape, parallel layout and measurement settings of one benchmark run."""

    prefix_len: int = 1024
    """Shared prompt tokens per group (P >= 2, so that something is cached)."""
    suffix_len: int = 64
    """Response tokens per trajectory (n >= 1)."""
    group_size: int = 8
    """Trajectories per group (G >= 1)."""
    num_groups: int = 2
    """Groups in the step."""
    num_layers: int = 4
    """Transformer layers."""
    hidden_size: int = 256
    """Model width."""
    ffn_hidden_size: int = 688
    """SwiGLU inner width."""
    num_attention_heads: int = 8
    """Query heads."""
    num_query_groups: int = 2
    """K/V heads (GQA)."""
    vocab_size: int = 2048
    """Vocabulary size."""
    token_budget: Optional[int] = None
    """Tokens per suffix microbatch; None = group_size * suffix_len (one group's suffixes)."""
    dense_micro_batch_size: Optional[int] = None
    """Rows per microbatch of the batched dense path (same model and kernels as dense, rows of
    equal length, micro_batch_size > 1); None = as many [prefix; suffix] rows as fit the token
    budget, so dense and reuse microbatches hold up to the same number of tokens; it is not
    timed when that is 1 row (it would be the dense path)."""
    prefix_chunk_tokens: Optional[int] = None
    """Run each cached prefix as chunks of at most this many tokens (one pipeline job each);
    None = one chunk per group."""
    steps: int = 3
    """Timed steps per path (the median is reported)."""
    warmup: int = 1
    """Untimed steps per path before timing (every path gets the same number)."""
    threads: int = 2
    """torch.set_num_threads (split evenly over the processes of a parallel layout)."""
    seed: int = 0
    """Seed of the weights and the data."""
    pp: int = 1
    """Pipeline-parallel stages (world size = pp * tp * dp processes on this machine)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    dp: int = 1
    """Data-parallel ranks (groups placed by prefix_schedule.planning.placement.place_groups)."""
    vpp: int = 1
    """Model chunks per pipeline rank (virtual pipeline stages; needs --pp >= 2 and --num-layers
    a multiple of pp * vpp): dense runs Megatron's interleaved 1F1B, reuse the interleaved plan."""
    production: bool = False
    """Megatron-LM's production settings (what its argument parser sets, see
    tests/megatron_lm_args.py): deallocate_pipeline_outputs=True, batch_p2p_comm (overlap_p2p_comm
    with --vpp > 1), and Megatron's DDP on every path with overlap_grad_reduce, the distributed
    optimizer's reduce-scatter layout and grad_sync_func (align_grad_reduce)."""
    cp: int = 1
    """Context-parallel ranks of the reuse path (benchlib/cp.py: dense then runs CP=1 x DP=cp
    on the same processes; the JSON adds the bytes each phase moves across the CP group)."""
    attention_backend: str = dataclasses.field(default="auto", metadata={
        "choices": (attention_backends.AUTO,) + attention_backends.BACKEND_NAMES})
    """Shared-prefix attention kernel of the reuse path: auto or a name of
    prefix_schedule.attention.backends.BACKEND_NAMES."""
    timeout: int = 900
    """Seconds the multi-process run may take, start-up included, before it is killed as hung."""
    skip_stock: bool = False
    """Do not time the stock (unfused) dense path; it still gives the one-step gradient reference."""
    tree: Optional[str] = None
    """DEPTHxBRANCHING (e.g. 3x4): each group is a prefix tree of DEPTH levels of --node-len
    tokens (the root, BRANCHING children, BRANCHING children each, ...) with --group-size
    trajectories of --suffix-len tokens under each leaf node (with 1, a leaf is read by one
    trajectory only: its tokens lead that trajectory's row, as detection would make it);
    --prefix-len is then unused. None: one shared prompt per group."""
    node_len: Optional[int] = None
    """Tokens per tree node with --tree (default: --prefix-len)."""
    num_experts: Optional[int] = None
    """MoE in every layer with this many experts (each ffn_hidden_size wide), dropless top-k
    softmax routing, aux_loss (coefficient 0.01), alltoall dispatcher; None: dense MLPs. Dense
    paths then pack each microbatch as the reuse plan's (docs/DESIGN.md "MoE")."""
    moe_router_topk: int = 2
    """MoE: experts per token."""
    ep: int = 1
    """MoE: expert-parallel ranks (carved out of the --dp ranks, as Megatron does)."""
    offload_prefix_activations: bool = False
    """Reuse path: keep Phase A's saved activations in (pinned) host memory until Phase C
    (prefix_schedule/runtime/offload.py); dense has no dormant activations to offload."""
    recompute: str = dataclasses.field(default="none", metadata={"choices": RECOMPUTE})
    """Activation recompute of every path (dense and reuse alike): none, selective (core
    attention) or full (uniform, one layer per checkpoint)."""
    memory_budget_mib: Optional[float] = None
    """Each path picks its packing within this many MiB of predicted device bytes
    (benchlib/capacity.py): reuse via plan_microbatches(memory_budget_bytes=...) (packing,
    prefix chunks, offload), dense the most rows per microbatch that fit; the JSON's
    memory_budget reports both and the speedup at equal memory."""
    adapter: Optional[str] = None
    """Run the step through a framework adapter: generic, verl or megatron-rl
    (benchlib/adapter_bench.py; one process): the framework's dense step vs the adapter, and
    the adapter's own overhead."""
    overhead_groups: int = 512
    """--adapter: groups of the adapter-overhead measurement (detection + planning, no model)."""
    overhead_group_size: int = 16
    """--adapter: trajectories per group of the adapter-overhead measurement."""
    linear_attention_freq: Optional[int] = None
    """A GPTModel with Gated DeltaNet layers, every N-th layer softmax attention (4: Qwen3.5's
    layout, attention_output_gate, rotary_percent 0.25; shapes in benchlib/hybrid.py)."""
    hybrid_pattern: Optional[str] = None
    """A HybridModel of one layer per symbol (* attention, - MLP, G Gated DeltaNet, M Mamba-2;
    e.g. G*M-), as many as --num-layers; with --pp N, `|` may mark the N stages (G*|M-), else
    the layers split evenly (benchlib/hybrid.py)."""

    def __post_init__(self) -> None:
        minimums = dict(prefix_len=2, suffix_len=1, group_size=1, num_groups=1, num_layers=1,
                        hidden_size=1, ffn_hidden_size=1, num_attention_heads=1,
                        num_query_groups=1, vocab_size=2, steps=1, warmup=0, threads=1, seed=0,
                        pp=1, tp=1, dp=1, vpp=1, cp=1, timeout=1, moe_router_topk=1, ep=1,
                        overhead_groups=1, overhead_group_size=1)
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}; give an int >= {minimum}")
        if self.token_budget is None:
            object.__setattr__(self, "token_budget", self.group_size * self.suffix_len)
        elif self.token_budget < self.suffix_len:
            raise ValueError(f"--token-budget={self.token_budget} is smaller than a suffix row "
                             f"({self.suffix_len} tokens); use --token-budget >= {self.suffix_len}")
        for name in ("prefix_chunk_tokens", "dense_micro_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)}; give an int >= 1")
        self._check_tree()
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"--recompute={self.recompute!r}; choose one of {RECOMPUTE}")
        choices = (attention_backends.AUTO,) + attention_backends.BACKEND_NAMES
        if self.attention_backend not in choices:
            raise ValueError(f"--attention-backend={self.attention_backend!r}; choose one of {choices}")
        check_hybrid(self)
        self._check_layout()
        self._check_moe()
        self._check_memory_budget()

    def _check_memory_budget(self) -> None:
        check_budget_config(self)
        if self.memory_budget_mib is not None and self.dense_micro_batch_size is None:
            object.__setattr__(self, "dense_micro_batch_size", dense_rows(self))

    def _check_moe(self) -> None:
        if self.num_experts is None:
            if self.ep > 1:
                raise ValueError(f"--ep={self.ep} needs MoE layers: give --num-experts")
            return
        if self.num_experts < 1 or self.moe_router_topk > self.num_experts:
            raise ValueError(f"--num-experts={self.num_experts} --moe-router-topk="
                             f"{self.moe_router_topk}; give 1 <= topk <= experts")
        if self.dp % self.ep or self.num_experts % self.ep:
            raise ValueError(f"--ep={self.ep} must divide --dp={self.dp} (expert-parallel ranks "
                             f"are data-parallel ranks) and --num-experts={self.num_experts}")
        if self.tp > 1:
            raise ValueError("the bench runs MoE with --tp 1 (MoE with TP needs sequence "
                             "parallelism: tests/test_moe_parallel.py, docs/DESIGN.md \"MoE\")")
        if self.ep > 1 and len(set(self.rows_per_rank())) > 1:
            raise ValueError(f"--ep={self.ep}: the one-row-per-microbatch dense path exchanges "
                             "tokens in every microbatch, so every data-parallel rank needs as "
                             f"many trajectories; they get {self.rows_per_rank()}: change "
                             "--num-groups / --group-size")
        if self.tree is not None:
            raise ValueError("--tree with --num-experts: MoE router statistics over prefix trees "
                             "(a node's tokens counted once per trajectory below it) are not "
                             "supported yet; drop one of them")

    def _check_tree(self) -> None:
        if self.tree is None:
            if self.node_len is not None:
                raise ValueError("--node-len needs --tree DEPTHxBRANCHING")
            return
        parts = self.tree.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--tree={self.tree!r}; give DEPTHxBRANCHING with ints >= 1, e.g. 3x4")
        if self.node_len is None:
            object.__setattr__(self, "node_len", self.prefix_len)
        if self.node_len < 2:
            raise ValueError(f"--node-len={self.node_len}; give an int >= 2")

    @property
    def tree_shape(self) -> Optional[tuple[int, int]]:
        """(depth, branching) with --tree, else None."""
        if self.tree is None:
            return None
        depth, branching = self.tree.lower().split("x")
        return int(depth), int(branching)

    @property
    def context_len(self) -> int:
        """Tokens before a suffix: the prompt, or a tree's DEPTH nodes."""
        return self.prefix_len if self.tree is None else self.tree_shape[0] * self.node_len

    @property
    def max_seq_len(self) -> int:
        return self.context_len + self.suffix_len

    def _check_layout(self) -> None:
        """What Megatron needs of the shape for this layout, said before any process starts."""
        if self.num_layers % (self.pp * self.vpp):
            raise ValueError(f"--num-layers={self.num_layers} does not split over --pp={self.pp} x "
                             f"--vpp={self.vpp} stages; give a multiple of {self.pp * self.vpp}")
        if self.vpp > 1:
            self._check_interleaving()
        for name in ("num_attention_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) % self.tp:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} is not a multiple "
                                 f"of --tp={self.tp}")
        if self.cp > 1 and self.dp > 1:
            raise ValueError("--cp > 1 with --dp > 1 is not benchmarked yet; use --dp 1")
        if self.cp > 1:
            others = [flag for flag, on in (("--vpp", self.vpp > 1), ("--production", self.production),
                                            ("--tree", self.tree is not None),
                                            ("--num-experts", self.num_experts is not None)) if on]
            if others:
                raise ValueError(f"--cp > 1 runs its own paths (benchlib/cp.py), not with "
                                 f"{', '.join(others)}; drop them or use --cp 1")
        if self.num_query_groups % self.tp and self.tp % self.num_query_groups:
            raise ValueError(f"--num-query-groups={self.num_query_groups} must be a multiple or a "
                             f"divisor of --tp={self.tp}")

    def _check_interleaving(self) -> None:
        """Megatron's interleaved schedule runs M dense microbatches in groups of PP per virtual
        stage (microbatch_group_size_per_vp_stage = PP): M >= PP and M % PP == 0 on every rank."""
        if self.pp < 2:
            raise ValueError(f"--vpp={self.vpp} interleaves pipeline ranks; give --pp >= 2")
        shares = self.rows_per_rank()
        bad = [m for m in shares if m < self.pp or m % self.pp]
        if bad:
            raise ValueError(f"--vpp={self.vpp}: Megatron's interleaved dense schedule needs a "
                             f"multiple of --pp={self.pp} rows per data-parallel rank, the ranks "
                             f"get {shares}; change --num-groups / --group-size")

    def rows_per_rank(self) -> list:
        """Dense rows (trajectories) of each data-parallel rank's share of the batch."""
        batch = config_batch(self)
        if self.dp == 1:
            return [sum(len(g.trajectories) for g in batch.groups)]
        return [sum(len(g.trajectories) for g in r.batch.groups)
                for r in self.placement(batch).ranks]

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp * self.cp

    @property
    def row_len(self) -> int:
        """Tokens of one dense [prefix; suffix] row (the last token only predicts)."""
        return self.context_len + self.suffix_len - 1

    @property
    def dense_rows_per_microbatch(self) -> int:
        """Rows per microbatch of the batched dense path (1: the path is not timed)."""
        rows = (self.dense_micro_batch_size if self.dense_micro_batch_size is not None
                else max(1, self.token_budget // self.row_len))
        if self.vpp > 1 and rows > 1:  # interleaving needs a multiple of PP microbatches
            counts = [-(-m // rows) for m in self.rows_per_rank()]
            if any(c < self.pp or c % self.pp for c in counts):
                return 1
        return rows

    def model_dims(self) -> ModelDims:
        """The FLOP-model view of the model (validates the head arithmetic too)."""
        return ModelDims(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         ffn_hidden_size=self.ffn_hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         num_query_groups=self.num_query_groups, vocab_size=self.vocab_size,
                         gated_linear_unit=True, num_experts=self.num_experts,
                         moe_router_topk=self.moe_router_topk if self.num_experts else 0,
                         **hybrid_dims(self))

    def moe_overrides(self) -> dict:
        """TransformerConfig fields of the MoE layers ({} without --num-experts)."""
        if self.num_experts is None:
            return {}
        return dict(num_moe_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                    moe_ffn_hidden_size=self.ffn_hidden_size, moe_aux_loss_coeff=0.01,
                    moe_router_load_balancing_type="aux_loss",
                    moe_token_dispatcher_type="alltoall", expert_model_parallel_size=self.ep)

    def recompute_options(self) -> Dict[str, object]:
        """TransformerConfig fields of `recompute` (the same for every path)."""
        return {"none": {},
                "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                "full": dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1)}[self.recompute]

    def placement(self, batch: GroupBatch) -> Optional[Placement]:
        """The DP placement of `batch` (None without DP); every rank computes the same one."""
        if self.dp == 1:
            return None
        return place_groups(batch, dp_size=self.dp, dims=self.model_dims(),
                            token_budget=self.token_budget,
                            max_seq_len=self.max_seq_len)


    def cp_dense_placement(self, batch: GroupBatch) -> Placement:
        """With --cp N the dense path runs the batch as CP=1 x DP=N on the same processes
        (benchlib/cp.py): its shares, or a ValueError naming --cp."""
        rows = sum(len(g.trajectories) for g in batch.groups)
        if rows < self.cp:
            raise ValueError(f"--cp={self.cp}: the dense path runs the batch as CP=1 x DP="
                             f"{self.cp} on the same processes and needs a trajectory per "
                             f"process, the batch has {rows}; raise --group-size x --num-groups "
                             f"to at least {self.cp} or lower --cp")
        return place_groups(batch, dp_size=self.cp, token_budget=self.token_budget,
                            max_seq_len=self.prefix_len + self.suffix_len)


def _field_docs() -> Dict[str, str]:
    """BenchConfig's attribute docstrings (the --help text of each flag)."""
    tree = ast.parse(Path(__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BenchConfig").body
    return {a.target.id: " ".join(d.value.value.split()) for a, d in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr)
            and isinstance(d.value, ast.Constant)}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; every flag's help ends with its default."""


def build_parser(description: str) -> argparse.ArgumentParser:
    """One flag per BenchConfig field (its help shows its default), plus --json."""
    p = argparse.ArgumentParser(description=description, formatter_class=_HelpFormatter)
    defaults, docs = BenchConfig(), _field_docs()
    for field in dataclasses.fields(BenchConfig):
        flag, default, help_ = "--" + field.name.replace("_", "-"), getattr(defaults, field.name), docs.get(field.name)
        if field.type == "bool":
            p.add_argument(flag, action="store_true", help=help_)
        elif field.type == "Optional[int]":
            p.add_argument(flag, type=int, default=None, help=help_)
        elif field.type == "Optional[float]":
            p.add_argument(flag, type=float, default=None, help=help_)
        elif field.type == "Optional[str]":
            p.add_argument(flag, default=None, help=help_)
        elif field.type == "str":
            p.add_argument(flag, default=default, choices=field.metadata.get("choices"), help=help_)
        else:
            p.add_argument(flag, type=int, default=default, help=help_)
    p.add_argument("--json", type=Path, default=None, help="write the result dict here")
    return p


def config_from_args(parser: argparse.ArgumentParser, argv=None) -> tuple[BenchConfig, Optional[Path]]:
    """Command line -> (BenchConfig, JSON output path or None); ValueError on bad values."""
    args = vars(parser.parse_args(argv))
    out = args.pop("json")
    return BenchConfig(**args), out
