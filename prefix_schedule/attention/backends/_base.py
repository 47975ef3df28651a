"""The backend interface: host-built varlen call descriptions and the Backend base class.

[Note: varlen kernel contract]
A backend attends a packed (THD) query buffer to a packed K/V buffer, batch entry b being query
rows cu_q[b]:cu_q[b+1] against key rows cu_k[b]:cu_k[b+1]. `causal` is only ever requested for
square entries (part S), where top-left and bottom-right alignment agree. The forward returns
out [Tq, Hq, D] in q's dtype, the natural-log LSE [Hq, Tq] (float32, float64 for float64 inputs;
the flash-attn >= 2.6 layout), and an opaque state handed back to the backward (e.g. an RNG state).
An entry without keys gives out 0 and LSE -inf or +inf. The backward takes the MERGED out and LSE
(see [Note: two-part attention merged by log-sum-exp] in prefix_schedule/attention/core.py) and
returns freshly written dq, dk, dv. All metadata is built on the host from python ints.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["Availability", "Backend", "LibraryUnsupported", "VarlenCall", "copy_call", "to_device"]


class Availability(NamedTuple):
    """Whether a backend can run a given device/dtype/head_dim, and if not, why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class LibraryUnsupported(Exception):
    """Raised by Backend._load when the library is importable but unusable (version, cuDNN)."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """LSE / merge precision: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, kw_only=True)
class VarlenCall:
    """One varlen attention call, described on the host (see [Note: varlen kernel contract])."""

    cu_q: tuple[int, ...]
    """Query boundaries per batch entry: 0, ..., total_q (python ints)."""
    cu_k: tuple[int, ...]
    """Key boundaries per batch entry: 0, ..., total_k; entries may be empty."""
    causal: bool
    """Causal within each entry; only for square entries."""
    window: Optional[int] = None
    """Sliding window (Megatron's window_size[0], left W): query i of an entry sees key j only if
    j >= pos(i) - W, where pos(i) = i in a causal (square) entry and pos(i) = n_k + i in a
    non-causal one (its queries follow its keys: part P, the prefix before the suffix). None: no
    window. Only backends with `supports_window` take it ([Note: sliding windows] in two_part.py)."""
    max_q: int = field(init=False)
    """Longest query entry (derived; passed to kernels as a python int, never read from device)."""
    max_k: int = field(init=False)
    """Longest key entry (derived)."""
    batch: int = field(init=False)
    """Number of entries (derived)."""
    runs: tuple[tuple[int, int, int, int, int], ...] = field(init=False)
    """(q_start, k_start, n_q, n_k, count) of adjacent entries of equal shape (derived), for
    backends that batch a run into one dense call."""
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        nq = [b - a for a, b in zip(self.cu_q, self.cu_q[1:])]
        nk = [b - a for a, b in zip(self.cu_k, self.cu_k[1:])]
        assert nq and len(nq) == len(nk) and self.cu_q[0] == 0 == self.cu_k[0], (self.cu_q, self.cu_k)
        assert min(nq) >= 0 and min(nk) >= 0 and not (self.causal and nq != nk)
        assert self.window is None or (isinstance(self.window, int) and self.window >= 0)
        runs: list[list[int]] = []
        for qs, ks, a, b in zip(self.cu_q, self.cu_k, nq, nk):
            if runs and runs[-1][2:4] == [a, b]:
                runs[-1][4] += 1
            else:
                runs.append([qs, ks, a, b, 1])
        object.__setattr__(self, "max_q", max(nq))
        object.__setattr__(self, "max_k", max(nk))
        object.__setattr__(self, "batch", len(nq))
        object.__setattr__(self, "runs", tuple(tuple(r) for r in runs))

    def cu_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 (cu_q, cu_k) on `device`, built once per device (see to_device)."""
        key = str(device)
        if key not in self._on_device:
            both = to_device([self.cu_q, self.cu_k], torch.int32, device)
            self._on_device[key] = (both[0], both[1])
        return self._on_device[key]


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of host python values on `device` without a stream sync: on CUDA the copy is
    from pinned memory and non-blocking (a pageable copy would synchronize). The caching
    allocator keeps the pinned source alive until the copy has run."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@functools.lru_cache(maxsize=1024)
def copy_call(cu_seqlens: tuple[int, ...], seq_slot: tuple[int, ...],
              prefix_lens: tuple[int, ...]) -> VarlenCall:
    """Copy mode's layout: each suffix against its own [prefix ; suffix] key rows. Its mask is
    bottom-right causal and not square, so `causal` (square entries only) stays False and the
    copy-mode caller asks its library for the bottom-right mask."""
    cu_k = [0]
    for a, b, slot in zip(cu_seqlens, cu_seqlens[1:], seq_slot):
        cu_k.append(cu_k[-1] + prefix_lens[slot] + b - a)
    return VarlenCall(cu_q=cu_seqlens, cu_k=tuple(cu_k), causal=False)


def gather_copy_kv(k, v, prefix_k, prefix_v, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """[prefix ; suffix] K/V per suffix, concatenated (differentiable: torch.cat)."""
    ks, vs = [], []
    for a, b, slot in zip(meta.cu_seqlens, meta.cu_seqlens[1:], meta.seq_slot):
        ks += [prefix_k[slot], k[a:b]]
        vs += [prefix_v[slot], v[a:b]]
    return torch.cat(ks), torch.cat(vs)


def _bhld(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def sdpa_copy_attention(q, k, v, prefix_k, prefix_v, meta, scale) -> torch.Tensor:
    """Public-API copy mode: per suffix, [prefix ; suffix] K/V and one bottom-right causal SDPA.
    Saves num_suffixes x prefix_len extra K/V rows for backward."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for a, b, slot in zip(meta.cu_seqlens, meta.cu_seqlens[1:], meta.seq_slot):
        kk = torch.cat([prefix_k[slot], k[a:b]])
        vv = torch.cat([prefix_v[slot], v[a:b]])
        o = F.scaled_dot_product_attention(_bhld(q[a:b]), _bhld(kk), _bhld(vv), scale=scale,
                                           attn_mask=causal_lower_right(b - a, kk.shape[0]),
                                           enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def sdpa_causal_attention(q, k, v, scale) -> torch.Tensor:
    out = F.scaled_dot_product_attention(_bhld(q), _bhld(k), _bhld(v), is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


class Backend:
    """A shared-prefix attention backend. Subclasses set the class attributes, implement
    `_load` (import the library; raise ImportError / LibraryUnsupported), `device_reason`,
    `varlen_fwd`, `varlen_bwd` and `copy_attention`."""

    name: str = ""
    install_hint: str = ""
    """What to install when the library is missing."""
    supports_window: bool = False
    """Its varlen kernels honour VarlenCall.window (else a windowed layer is refused before compute)."""
    empty_kv_ok: bool = True
    """The kernel gives out 0 and LSE +-inf for an entry without keys. When False, slots with an
    empty prefix are left out of part P instead (their query rows are gathered out)."""

    def __init__(self) -> None:
        self._lib_cache: Optional[tuple[object, str]] = None

    def _load(self) -> object:
        return None

    def lib(self):
        """The loaded library handles (cached); only valid when library_reason() is empty."""
        if self._lib_cache is None:
            try:
                self._lib_cache = (self._load(), "")
            except ImportError as e:
                self._lib_cache = (None, f"not installed ({e}); install with: {self.install_hint}")
            except LibraryUnsupported as e:
                self._lib_cache = (None, f"{e}; install with: {self.install_hint}")
            except Exception as e:  # noqa: BLE001 -- a broken install must not break selection
                self._lib_cache = (None, f"failed to load ({type(e).__name__}: {e})")
        return self._lib_cache[0]

    def library_reason(self) -> str:
        self.lib()
        return self._lib_cache[1]

    def device_reason(self, device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> str:
        """Why this device/dtype/head_dim cannot run here ("" if it can)."""
        return ""

    def available(self, device, dtype: torch.dtype, head_dim: Optional[int] = None) -> Availability:
        reason = self.library_reason() or self.device_reason(torch.device(device), dtype, head_dim)
        return Availability(not reason, reason)

    def reset(self) -> None:
        """Forget the cached import result (tests inject fake libraries)."""
        self._lib_cache = None

    # Kernels: see [Note: varlen kernel contract].
    def varlen_fwd(self, q, k, v, call: VarlenCall, scale: float):
        raise NotImplementedError

    def varlen_bwd(self, grad_out, q, k, v, out, lse, call: VarlenCall, scale: float, state):
        raise NotImplementedError

    def copy_attention(self, q, k, v, prefix_k: Sequence, prefix_v: Sequence, meta, scale):
        raise NotImplementedError


def check_head_dim(head_dim: Optional[int], multiple: int, maximum: int, what: str) -> str:
    if head_dim is not None and (head_dim % multiple or head_dim > maximum):
        return f"{what} needs head_dim a multiple of {multiple} and <= {maximum}, got {head_dim}"
    return ""


def check_cuda(device: torch.device, dtype: torch.dtype, dtypes, min_capability, what: str) -> str:
    if device.type != "cuda":
        return f"{what} needs a CUDA device, got {device.type}"
    if dtype not in dtypes:
        return f"{what} supports {', '.join(str(d) for d in dtypes)}, got {dtype}"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        return f"{what} needs compute capability >= {min_capability}, got {capability}"
    return ""

