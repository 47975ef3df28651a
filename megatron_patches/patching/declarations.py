"""The declared source patches to megatron-core: data only (see registry.py for the operations).

Each patch adds one module-level hook (None by default) to a Megatron file and a check of it at
the start of the function Megatron already uses for that job; docs/DESIGN.md, "Hook points in
Megatron", says what each hook is for. A hunk is an exact-text replacement whose `old` text occurs
exactly once in every release the patch declares. Where a release's source differs at an anchor,
the patch is declared again for that release with the same id (`patches_for` picks one per id);
today every anchor is shared by all supported releases. This module imports neither torch nor
megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ATTENTION_CORE_HOOK", "DECLARED_PATCHES", "GDN_STATE_HOOK", "GPT_ROPE_POSITIONS_HOOK",
           "HYBRID_ROPE_POSITIONS_HOOK", "Hunk", "MAMBA_STATE_HOOK", "MLA_REUSE_HOOK", "PATCH_SETS",
           "SCHEDULE_SELECTION_HOOK", "SUPPORTED_RELEASES", "SUPPORTED_VERSIONS", "SourcePatch",
           "TP_GRAD_SUM_HOOK", "patch_set_name",
           "patches_for", "supported_range"]


@dataclass(frozen=True, kw_only=True)
class Hunk:
    """One exact-text replacement in a target file."""

    old: str
    """Stock text; must occur exactly once in the target (anchor with enough context)."""
    new: str
    """Replacement text; must occur exactly once once applied (so revert is exact)."""

    def __post_init__(self):
        if not self.old or not self.new or self.old == self.new:
            raise ValueError("Hunk: old and new must be non-empty and differ")
        if self.old in self.new or self.new in self.old:
            # Either text inside the other makes "applied" and "stock" indistinguishable.
            raise ValueError("Hunk: old must not contain new, nor new old; widen the anchor")


@dataclass(frozen=True, kw_only=True)
class SourcePatch:
    """A named, versioned source patch to one file of Megatron."""

    id: str
    """Short kebab-case name, also the file name of its rendering in patches/."""
    target: str
    """Path of the file relative to the directory that contains `megatron/`."""
    description: str
    """One sentence: what the patch adds and why."""
    supported_versions: tuple[str, ...]
    """megatron-core versions (`MAJOR.MINOR.PATCH`) whose stock text the hunks were written for."""
    hunks: tuple[Hunk, ...]
    """Replacements, applied in order; each anchor is unique in the stock file."""
    hook: str
    """Module-level attribute the patch adds to the target module (None = stock behaviour)."""
    references: tuple[tuple[str, str], ...] = ()
    """(qualname in the target module, name) pairs: once patched, that function's code uses name."""

    def __post_init__(self):
        if not self.id or not self.id.replace("-", "").isalnum() or self.id != self.id.lower():
            raise ValueError(f"SourcePatch.id {self.id!r} must be lower-case kebab-case")
        target = Path(self.target)
        if target.is_absolute() or ".." in target.parts or target.suffix != ".py":
            raise ValueError(f"SourcePatch.target {self.target!r}: a relative path to a .py file")
        bad = [v for v in self.supported_versions if len(v.split(".")) != 3]
        if not self.supported_versions or bad:
            raise ValueError(f"SourcePatch.supported_versions: want MAJOR.MINOR.PATCH, got {bad}")
        if not self.hunks or not all(isinstance(h, Hunk) for h in self.hunks):
            raise ValueError(f"SourcePatch {self.id}: hunks must be a non-empty tuple of Hunk")
        if not self.hook.isidentifier() or not any(self.hook in h.new for h in self.hunks):
            raise ValueError(f"SourcePatch {self.id}: hook {self.hook!r} must be added by a hunk")


SUPPORTED_RELEASES = {
    "0.19.1": "Megatron-LM branch core_r0.19.0 (commit f8837c04ef6c)",
    "0.19.2": "the megatron-core 0.19.2 wheel on PyPI",
    "0.20.0": "Megatron-LM main as of 2026-08-22 (commit d98e8a64ddf3)",
}
"""megatron-core version (`package_info.py`) -> the source it was checked against."""

SUPPORTED_VERSIONS = tuple(SUPPORTED_RELEASES)

PATCH_SETS = {"megatron-core-0.19": ("0.19.1", "0.19.2"), "megatron-core-0.20": ("0.20.0",)}
"""Directory under megatron_patches/patches/ -> the releases whose target files its `.patch`
renderings match byte for byte (0.19.1 and 0.19.2 ship identical target files)."""


def supported_range() -> str:
    """The supported releases in words, for refusals."""
    return "; ".join(f"{v} ({source})" for v, source in SUPPORTED_RELEASES.items())


def patch_set_name(version: str) -> str:
    """The patches/ directory holding the renderings for `version` (a supported version)."""
    (name,) = [name for name, versions in PATCH_SETS.items() if version in versions]
    return name


def _insert(before: str, lines: str, after: str) -> Hunk:
    """A hunk that inserts lines between two adjacent stock snippets (the anchor)."""
    return Hunk(old=before + after, new=before + lines + after)


def _hook_declaration(patch_id: str, hook: str, comment: str) -> str:
    return f"\n# megatron-prefix-reuse (megatron_patches, {patch_id}): {comment}\n{hook} = None\n"


ATTENTION_CORE_HOOK = SourcePatch(
    id="attention-core-hook",
    target="megatron/core/transformer/attention.py",
    description=(
        "Attention._run_core_attention first asks _core_attention_hook (post-RoPE q/k/v), and the "
        "inline core-attention call in Attention.forward goes through _run_core_attention."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "    HAVE_FUSED_QKV_ROPE = False\n",
            _hook_declaration(
                "attention-core-hook", "_core_attention_hook",
                "when set,\n# Attention._run_core_attention calls it first; it returns the core "
                "attention output,\n# or NotImplemented to run the stock core attention module.",
            ),
            "\n\nclass LinearQkvInterface(Protocol):\n",
        ),
        _insert('''\
        """Run the configured core attention module."""
''', '''\
        if _core_attention_hook is not None:
            core_attn_out = _core_attention_hook(
                self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params, **extra_kwargs,
            )
            if core_attn_out is not NotImplemented:
                return core_attn_out
''', '''\
        return apply_module(self.core_attention)(
'''),
        Hunk(old='''\
                with core_attn_manager as query:
                    core_attn_out = apply_module(self.core_attention)(
''', new='''\
                with core_attn_manager as query:
                    # megatron-prefix-reuse: via _run_core_attention so its hook applies here too.
                    core_attn_out = self._run_core_attention(
'''),
    ),
    hook="_core_attention_hook",
    references=(
        ("Attention._run_core_attention", "_core_attention_hook"),
        ("Attention.forward", "_run_core_attention"),
    ),
)

GPT_ROPE_POSITIONS_HOOK = SourcePatch(
    id="gpt-rope-positions-hook",
    target="megatron/core/models/gpt/gpt_model.py",
    description=(
        "GPTModel._preprocess passes the RoPE table it built through _rotary_pos_emb_hook, which "
        "may replace it with per-token positions (a suffix continues at its prefix length)."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "logger = logging.getLogger(__name__)\n",
            _hook_declaration(
                "gpt-rope-positions-hook", "_rotary_pos_emb_hook",
                "when set,\n# GPTModel._preprocess replaces its RoPE table with "
                "hook(model, rotary_pos_emb).",
            ),
            # anchored on the class name only: 0.20 added GraphableMegatronModule to its bases
            "\n\nclass GPTModel(",
        ),
        _insert('''\
                rotary_pos_emb = self.rotary_pos_emb(
                    rotary_seq_len,
                    packed_seq=packed_seq_params is not None
                    and packed_seq_params.qkv_format == 'thd',
                    cp_group=packed_seq_params.cp_group if packed_seq_params is not None else None,
                )
''', '''\
                if _rotary_pos_emb_hook is not None:
                    rotary_pos_emb = _rotary_pos_emb_hook(self, rotary_pos_emb)
''', '''\
        elif self.position_embedding_type == 'yarn':
'''),
    ),
    hook="_rotary_pos_emb_hook",
    references=(("GPTModel._preprocess", "_rotary_pos_emb_hook"),),
)

SCHEDULE_SELECTION_HOOK = SourcePatch(
    id="schedule-selection-hook",
    target="megatron/core/pipeline_parallel/schedules.py",
    description=(
        "get_forward_backward_func first asks _forward_backward_func_hook, so prefix reuse is "
        "selected the way Megatron selects its schedules; a None result keeps the stock choice."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "Shape = Union[List[int], torch.Size]\n",
            _hook_declaration(
                "schedule-selection-hook", "_forward_backward_func_hook",
                "when set,\n# get_forward_backward_func asks it first; a None result keeps "
                "Megatron's choice.",
            ),
            "\n\ndef get_forward_backward_func(\n",
        ),
        _insert('''\
            multi-module (cross-grid) collection is passed, select the bridge schedule.

    """
''', '''\
    if _forward_backward_func_hook is not None:
        forward_backward_func = _forward_backward_func_hook(pp_size=pp_size, vp_size=vp_size)
        if forward_backward_func is not None:
            return forward_backward_func
''', '''\
    if isinstance(schedule_pg_collection, MultiModuleProcessGroupCollection):
'''),
    ),
    hook="_forward_backward_func_hook",
    references=(("get_forward_backward_func", "_forward_backward_func_hook"),),
)

HYBRID_ROPE_POSITIONS_HOOK = SourcePatch(
    id="hybrid-rope-positions-hook",
    target="megatron/core/models/hybrid/hybrid_model.py",
    description=(
        "HybridModel.forward passes the RoPE table it built through _rotary_pos_emb_hook, as "
        "GPTModel._preprocess does (a suffix continues at its prefix length)."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "logger = logging.getLogger(__name__)\n",
            _hook_declaration(
                "hybrid-rope-positions-hook", "_rotary_pos_emb_hook",
                "when set,\n# HybridModel.forward replaces its RoPE table with "
                "hook(model, rotary_pos_emb).",
            ),
            "\n\ndef _hybrid_logging_pg_kwargs(",
        ),
        _insert('''\
            rotary_pos_emb = self.rotary_pos_emb(
                rotary_seq_len,
                packed_seq=packed_seq_params is not None and packed_seq_params.qkv_format == 'thd',
            )
''', '''\
            if _rotary_pos_emb_hook is not None:
                rotary_pos_emb = _rotary_pos_emb_hook(self, rotary_pos_emb)
''', '''\
        elif self.position_embedding_type == 'yarn':
'''),
    ),
    hook="_rotary_pos_emb_hook",
    references=(("HybridModel.forward", "_rotary_pos_emb_hook"),),
)

GDN_STATE_HOOK = SourcePatch(
    id="gdn-state-hook",
    target="megatron/core/ssm/gated_delta_net/gdn.py",
    description=(
        "GatedDeltaNet.forward asks _gdn_state_hook for its short causal conv and its gated delta "
        "rule (stock: initial_state=None at both): a reuse step resumes them from a cached "
        "prefix state; a None answer keeps the stock call."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "from megatron.core.packed_seq_params import PackedSeqParams\n",
            _hook_declaration(
                "gdn-state-hook", "_gdn_state_hook",
                "when set,\n# GatedDeltaNet.forward asks hook(self, 'conv') for a "
                "conv(qkv, weight, bias) and\n# hook(self, 'rule') for a gated delta rule; None "
                "keeps the stock call.",
            ),
            "from megatron.core.ssm.gated_delta_net.common import (\n",
        ),
        Hunk(old='''\
        if self.config.deterministic_mode:
            qkv = qkv.transpose(1, 2).contiguous()  # b, s, d -> b, d, s
''', new='''\
        # megatron-prefix-reuse: a reuse step's conv resumes from the cached prefix inputs.
        state_conv = _gdn_state_hook(self, "conv") if _gdn_state_hook is not None else None
        if state_conv is not None:
            qkv = state_conv(qkv, conv1d_weight, conv1d_bias)
        elif self.config.deterministic_mode:
            qkv = qkv.transpose(1, 2).contiguous()  # b, s, d -> b, d, s
'''),
        Hunk(old='''\
        core_attn_out, _ = self.gated_delta_rule(
''', new='''\
        gated_delta_rule = self.gated_delta_rule
        if _gdn_state_hook is not None:  # megatron-prefix-reuse: resume from a cached state
            gated_delta_rule = _gdn_state_hook(self, "rule") or gated_delta_rule
        core_attn_out, _ = gated_delta_rule(
'''),
    ),
    hook="_gdn_state_hook",
    references=(("GatedDeltaNet.forward", "_gdn_state_hook"),),
)

MAMBA_STATE_HOOK = SourcePatch(
    id="mamba-state-hook",
    target="megatron/core/ssm/mamba_mixer.py",
    description=(
        "MambaMixer._ssm_training asks _mamba_state_hook for the fused conv + scan it calls "
        "(stock: mamba_split_conv1d_scan_combined, no initial state): a reuse step resumes the "
        "conv and the SSD scan from a cached prefix state; a None answer keeps the stock call."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "from megatron.core.ssm.utils import _split_tensor_factory\n",
            _hook_declaration(
                "mamba-state-hook", "_mamba_state_hook",
                "when set,\n# MambaMixer._ssm_training asks hook(self) for a stand-in of "
                "mamba_split_conv1d_scan_combined\n# (same arguments); None keeps the stock call.",
            ),
            "from megatron.core.tensor_parallel import get_cuda_rng_tracker\n",
        ),
        Hunk(old='''\
        y = mamba_split_conv1d_scan_combined(
''', new='''\
        split_conv1d_scan = mamba_split_conv1d_scan_combined
        if _mamba_state_hook is not None:  # megatron-prefix-reuse: resume from a cached state
            split_conv1d_scan = _mamba_state_hook(self) or split_conv1d_scan
        y = split_conv1d_scan(
'''),
    ),
    hook="_mamba_state_hook",
    references=(("MambaMixer._ssm_training", "_mamba_state_hook"),),
)

TP_GRAD_SUM_HOOK = SourcePatch(
    id="tp-grad-sum-hook",
    target="megatron/core/distributed/finalize_model_grads.py",
    description=(
        "_allreduce_non_tensor_model_parallel_grads also sums over TP the gradients of the "
        "parameters _tp_grad_sum_hook(config, name, param) names (stock: only sequence-parallel "
        "and q/k-norm weights): a GDN layer's out_norm weight is replicated on every TP rank "
        "but each rank's gradient holds only its local heads' part (without sequence "
        "parallelism nothing adds them up)."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "from ..transformer.transformer_config import TransformerConfig\n",
            _hook_declaration(
                "tp-grad-sum-hook", "_tp_grad_sum_hook",
                "when set,\n# hook(config, name, param) True sums that parameter's gradient "
                "over TP as well.",
            ),
            "from ..utils import (\n",
        ),
        Hunk(old='''\
                elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                ):
''', new='''\
                elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
                ) or (  # megatron-prefix-reuse: replicated weights with per-rank partial grads
                    _tp_grad_sum_hook is not None and _tp_grad_sum_hook(config, name, param)
                ):
'''),
    ),
    hook="_tp_grad_sum_hook",
    references=(("_allreduce_non_tensor_model_parallel_grads", "_tp_grad_sum_hook"),),
)

MLA_REUSE_HOOK = SourcePatch(
    id="mla-reuse-hook",
    target="megatron/core/transformer/multi_latent_attention.py",
    description=(
        "MultiLatentAttention asks _mla_reuse_hook for its RoPE table (a suffix continues at its "
        "prefix length) and for its core attention (MLA overrides _run_core_attention, so the "
        "attention-core-hook never sees it); a None answer keeps the stock path."
    ),
    supported_versions=SUPPORTED_VERSIONS,
    hunks=(
        _insert(
            "    from megatron.core.packed_seq_params import PackedSeqParams\n",
            _hook_declaration(
                "mla-reuse-hook", "_mla_reuse_hook",
                "when set,\n# MultiLatentAttention asks hook(self, 'rope') for a stand-in "
                "rope(rotary_pos_emb) and\n# hook(self, 'core') for a stand-in of its core "
                "attention (same arguments); None keeps the stock path.",
            ),
            "\n\ndef _prepare_mla_core_attention_value(",
        ),
        _insert('''\
                rotary_pos_emb, mscale = self.rotary_pos_emb(
                    rotary_seq_len, packed_seq=thd_packed_seq
                )

''', '''\
        reuse_rope = _mla_reuse_hook(self, "rope") if _mla_reuse_hook is not None else None
        if reuse_rope is not None:  # megatron-prefix-reuse: per-token RoPE positions
            rotary_pos_emb = reuse_rope(rotary_pos_emb)

''', '''\
        if packed_seq_params is not None and packed_seq_params.qkv_format == 'thd':
'''),
        _insert('''\
        """Run MLA core attention with the THD value pad/trim workaround."""
''', '''\
        reuse_core = _mla_reuse_hook(self, "core") if _mla_reuse_hook is not None else None
        if reuse_core is not None:  # megatron-prefix-reuse: attention over a cached prefix
            return reuse_core(query, key, value, attention_mask, packed_seq_params=packed_seq_params,
                              attn_mask_type=attn_mask_type, **extra_kwargs)
''', '''\
        value, need_v_pad, orig_v_dim, padded_v_dim = _prepare_mla_core_attention_value(
'''),
    ),
    hook="_mla_reuse_hook",
    references=(
        ("MultiLatentAttention._run_core_attention", "_mla_reuse_hook"),
        ("MLASelfAttention.get_query_key_value_tensors", "_mla_reuse_hook"),
    ),
)

DECLARED_PATCHES: tuple[SourcePatch, ...] = (
    ATTENTION_CORE_HOOK, GPT_ROPE_POSITIONS_HOOK, HYBRID_ROPE_POSITIONS_HOOK,
    SCHEDULE_SELECTION_HOOK, GDN_STATE_HOOK, MAMBA_STATE_HOOK, TP_GRAD_SUM_HOOK, MLA_REUSE_HOOK,
)
"""Every declaration, all releases; a release's set is `patches_for(version)`."""


def patches_for(version: str, declared: tuple[SourcePatch, ...] = DECLARED_PATCHES,
                ) -> tuple[SourcePatch, ...]:
    """The patches for one release: per id, the declaration that lists `version`.

    ValueError naming the supported range when no declaration does.
    """
    chosen: dict[str, SourcePatch] = {}
    for patch in declared:
        if version in patch.supported_versions:
            if patch.id in chosen:
                raise AssertionError(f"{patch.id} is declared twice for megatron-core {version}")
            chosen[patch.id] = patch
    ids = list(dict.fromkeys(patch.id for patch in declared))
    missing = [patch_id for patch_id in ids if patch_id not in chosen]
    if missing:
        raise ValueError(
            f"megatron-core {version} is not supported (no declaration of {', '.join(missing)} "
            f"for it); supported: {supported_range()}"
        )
    return tuple(chosen[patch_id] for patch_id in ids)


for _version in SUPPORTED_VERSIONS:  # every release: every patch exactly once, one patch set
    patches_for(_version)
    patch_set_name(_version)
