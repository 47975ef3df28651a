"""The library versions the GPU backends support, and what their call sites depend on per version.

Supported: Transformer Engine 2.2 - 2.19 and flash-attn 2.6 - 2.8 (by major.minor; any patch or
.postN release of those). Other versions are refused with the reason (`LibraryUnsupported`,
reported by the backend's `available`): the low-level APIs below change without deprecation.

Every entry was read in the library's own source at that version's git tag
(github.com/NVIDIA/TransformerEngine tags v2.2 ... v2.18 and branch release_v2.19 at 2.19.0 --
TE 2.20 stays refused: no v2.20 tag or release branch could be read here --,
github.com/Dao-AILab/flash-attention tags v2.6.0 ... v2.8.3.post1); docs/KERNEL_VERSIONS.md lists file and function per fact. The fakes in
tests/fake_attention_libs.py are built from the same tables, version by version.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prefix_schedule.attention.backends._base import LibraryUnsupported

__all__ = ["FLASH_SUPPORTED", "FlashApi", "TEApi", "TE_SUPPORTED", "TORCH_SUPPORTED",
           "check_torch_flash_schemas", "flash_api", "get_max_tokens", "schema_args", "te_api",
           "torch_flash_version", "version_tuple"]

TE_SUPPORTED = ((2, 2), (2, 19))
"""Inclusive (major, minor) range of Transformer Engine."""
FLASH_SUPPORTED = ((2, 6), (2, 8))
"""Inclusive (major, minor) range of flash-attn 2."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.7.4.post1' -> (2, 7, 4); '2.10.0.dev0+abc' -> (2, 10, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", str(text).split("+")[0])[:3])


def _check_range(name: str, text: str, supported) -> tuple[int, ...]:
    version = version_tuple(text)
    (lo, hi) = supported
    if not lo <= version[:2] <= hi:
        raise LibraryUnsupported(
            f"{name} {text} is outside the versions whose call signatures were checked "
            f"({lo[0]}.{lo[1]} - {hi[0]}.{hi[1]}; docs/KERNEL_VERSIONS.md)")
    return version


# ---- Transformer Engine ------------------------------------------------------------------------

# transformer_engine_torch.get_fused_attn_backend is a pybind11 function without argument names:
# positional only. Its parameters by version (csrc/extensions/attention.cu, 2.2-2.4;
# csrc/extensions/attention.cpp, 2.5+), as the caller get_attention_backend passes them.
_BACKEND_BASE = ("q_type", "kv_type", "qkv_layout", "bias_type", "mask_type", "dropout", "num_heads",
                 "num_gqa_groups", "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v",
                 "window_size_left", "window_size_right")
_WITH_SOFTMAX = (("is_training",) + _BACKEND_BASE[:5] + ("softmax_type",) + _BACKEND_BASE[5:])
_TE_BACKEND_ARGS = (  # (first version, arguments)
    ((2, 2), _BACKEND_BASE),
    ((2, 5), ("is_training",) + _BACKEND_BASE),
    ((2, 8), _WITH_SOFTMAX),
    ((2, 9), _WITH_SOFTMAX + ("return_max_logit",)),
    ((2, 10), _WITH_SOFTMAX + ("return_max_logit", "cuda_graph")),
    ((2, 12), _WITH_SOFTMAX + ("return_max_logit", "cuda_graph", "deterministic")),
)
# Keyword names our fused_attn_fwd / fused_attn_bwd calls use (cpp_extensions/fused_attn.py).
_FWD = frozenset({"is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
                  "q", "k", "v", "fake_dtype", "fused_attention_backend", "cu_seqlens_q_padded",
                  "cu_seqlens_kv_padded", "attn_scale", "dropout", "qkv_layout", "attn_bias_type",
                  "attn_mask_type", "window_size"})
_BWD = frozenset({"max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
                  "o", "d_o", "fake_dtype", "aux_ctx_tensors", "fused_attention_backend",
                  "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "attn_scale", "dropout",
                  "qkv_layout", "attn_bias_type", "attn_mask_type", "window_size", "deterministic"})
IO_FORMATS_SINCE = (2, 15)
"""fused_attn_fwd takes o_format and fused_attn_bwd o_format/do_format/dqkv_layout (defaults
"sbhd"/"sbh3d": they must be passed for THD); fused_attn_bwd no longer takes dqkv_dtype."""
EXACT_STATS_SINCE = (2, 11)
"""Before: THD softmax stats have get_max_tokens(total_q) rows (fused_attn_f16_arbitrary_seqlen.cu,
fused_attn_arbitrary_seqlen_fwd); from 2.11 exactly total_q."""


@dataclass(frozen=True)
class TEApi:
    """What our Transformer Engine call sites depend on, for one version."""

    version: tuple[int, ...]
    backend_args: tuple[str, ...]
    """Positional parameters of transformer_engine_torch.get_fused_attn_backend, in order."""
    fwd_kwargs: frozenset
    """Keywords our fused_attn_fwd call passes (all accepted by this version)."""
    bwd_kwargs: frozenset
    """Keywords our fused_attn_bwd call passes."""
    bucketed_stats: bool
    """THD softmax stats come with get_max_tokens(total_q) rows (slice in forward; give backward
    a buffer of that many rows)."""

    @property
    def io_formats(self) -> bool:
        return "o_format" in self.fwd_kwargs


def te_api(version_text: str) -> TEApi:
    """The TEApi of a Transformer Engine version; LibraryUnsupported outside TE_SUPPORTED."""
    version = _check_range("transformer_engine", version_text, TE_SUPPORTED)
    backend_args = [args for first, args in _TE_BACKEND_ARGS if version[:2] >= first][-1]
    if version[:2] >= IO_FORMATS_SINCE:
        fwd, bwd = _FWD | {"o_format"}, _BWD | {"o_format", "do_format", "dqkv_layout"}
    else:
        fwd, bwd = _FWD, _BWD | {"dqkv_dtype"}
    return TEApi(version=version, backend_args=backend_args, fwd_kwargs=fwd, bwd_kwargs=bwd,
                 bucketed_stats=version[:2] < EXACT_STATS_SINCE)


def get_max_tokens(num_tokens: int) -> int:
    """Port of transformer_engine/common/fused_attn/utils.cu get_max_tokens (2.2-2.19): 1024 up
    to 1024 tokens, then the next power of two up to 32k, then the next multiple of 32k."""
    log2_t = math.ceil(math.log2(num_tokens)) if num_tokens > 0 else -math.inf
    if log2_t <= 10:
        return 1024
    if log2_t <= 15:
        return 2 ** log2_t
    return (num_tokens + 32767) // 32768 * 32768


# ---- flash-attn --------------------------------------------------------------------------------

@dataclass(frozen=True)
class FlashApi:
    """What our flash-attn call sites depend on, for one version (flash_attn_interface.py)."""

    version: tuple[int, ...]
    split_window: bool
    """2.7+: window_size_left / window_size_right ints (custom ops); 2.6: a window_size tuple."""
    fwd_outputs: int
    """_flash_attn_varlen_forward returns (out, q, k, v, out_padded, lse, S_dmask, rng_state) in
    2.6 and (out, lse, S_dmask, rng_state) from 2.7."""

    def window(self, causal: bool) -> dict:
        """The window arguments for no sliding window, as TE's context-parallel code passes them
        (the C++ sets window_size_right = 0 for causal anyway: flash_api.cpp mha_varlen_fwd)."""
        right = 0 if causal else -1
        if self.split_window:
            return {"window_size_left": -1, "window_size_right": right}
        return {"window_size": (-1, right)}

    def unpack_forward(self, res):
        """(out, softmax_lse, rng_state) of a _flash_attn_varlen_forward result."""
        if len(res) != self.fwd_outputs:
            raise RuntimeError(f"flash-attn {self.version}: _flash_attn_varlen_forward returned "
                               f"{len(res)} values, expected {self.fwd_outputs}")
        return (res[4], res[5], res[7]) if self.fwd_outputs == 8 else (res[0], res[1], res[3])


def flash_api(version_text: str) -> FlashApi:
    """The FlashApi of a flash-attn version; LibraryUnsupported outside FLASH_SUPPORTED."""
    version = _check_range("flash-attn", version_text, FLASH_SUPPORTED)
    split = version[:2] >= (2, 7)
    return FlashApi(version=version, split_window=split, fwd_outputs=4 if split else 8)


# ---- PyTorch's own flash attention (the "torch_cuda" backend) ---------------------------------

TORCH_SUPPORTED = ((2, 10), (2, 13))
"""Inclusive (major, minor) range of PyTorch whose aten flash-attention ops the torch_cuda
backend calls (docs/KERNEL_VERSIONS.md, "PyTorch")."""
TORCH_FWD_POSITIONAL = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                        "dropout_p", "is_causal", "return_debug_mask")
"""aten::_flash_attention_forward's positional parameters, in order, as the backend passes them
(then `scale=` by keyword); it returns (output, softmax_logsumexp, rng_state, unused,
debug_attn_mask)."""
TORCH_BWD_POSITIONAL = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                        "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal")
"""aten::_flash_attention_backward's leading positional parameters, in order; then the forward's
rng_state and unused tensors (named philox_seed / philox_offset or rng_state / unused by version)
and `scale=` by keyword."""
TORCH_FWD_OUTPUTS = 5


def torch_flash_version(version_text: str) -> tuple[int, ...]:
    """PyTorch's version, or LibraryUnsupported outside TORCH_SUPPORTED."""
    return _check_range("torch", version_text, TORCH_SUPPORTED)


def schema_args(schema_text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(positional names, keyword-only names) of an aten schema string such as
    str(torch.ops.aten._flash_attention_forward.default._schema)."""
    inner = schema_text[schema_text.index("(") + 1:schema_text.index(") ->")]
    positional, keyword, kw_only = [], [], False
    for part in (p.strip() for p in inner.split(",")):
        if part == "*":
            kw_only = True
            continue
        name = part.split("=")[0].split()[-1]
        (keyword if kw_only else positional).append(name)
    return tuple(positional), tuple(keyword)


def check_torch_flash_schemas(fwd_schema: str, bwd_schema: str) -> None:
    """LibraryUnsupported unless the installed aten schemas take the arguments the backend passes
    where it passes them (a PyTorch build whose ops changed is refused, not miscalled)."""
    fwd_pos, fwd_kw = schema_args(fwd_schema)
    bwd_pos, bwd_kw = schema_args(bwd_schema)
    problems = []
    if fwd_pos[:len(TORCH_FWD_POSITIONAL)] != TORCH_FWD_POSITIONAL or "scale" not in fwd_kw:
        problems.append(f"aten::_flash_attention_forward is {fwd_schema}")
    if (bwd_pos[:len(TORCH_BWD_POSITIONAL)] != TORCH_BWD_POSITIONAL
            or len(bwd_pos) != len(TORCH_BWD_POSITIONAL) + 2 or "scale" not in bwd_kw):
        problems.append(f"aten::_flash_attention_backward is {bwd_schema}")
    if problems:
        raise LibraryUnsupported("the installed PyTorch's flash-attention ops differ from the "
                                 "checked schemas (docs/KERNEL_VERSIONS.md): " + "; ".join(problems))
