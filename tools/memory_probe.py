"""Activation memory of one training step, observed the same way on CPU and GPU.

What is measured -- and what is not. CPU torch has no allocator peak counter, so instead of the
allocator's view this counts the bytes that autograd *holds for backward*: every tensor saved
for backward passes `torch.autograd.graph.saved_tensors_hooks`; its storage (not the view) is
counted once however many saved tensors share it, from the moment it is first saved until the
last saved reference to it is released (when the graph node that saved it is freed, i.e. after
its backward). Storages of the model's parameters are excluded (a matmul saves its weight), and
so are weights, gradients and optimizer state in general, the step's transient temporaries
(freed before backward without being saved), the logits/loss not saved, and tensors that a
custom autograd Function keeps as `ctx` attributes rather than through `save_for_backward`.

For prefix reuse the prefix cache's own tensors (detached K/V copies, fp32 gK/gV buffers) are
held too: "held bytes" is the union of the storages of live saved tensors and of the cache's
tensors, each storage counted once (a cached K/V copy is a view of a tensor the prefix graph
also saves). `cache_peak_bytes` is separately the largest `PrefixKVCache.nbytes()` seen.

The suffix phase of a reuse step runs from the first suffix forward being prepared to the
release of the last suffix microbatch (after its backward); it is observed by wrapping the
step's `prepare` / `release_microbatch` on the instance, so the executor is untouched.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

__all__ = ["MemoryReport", "SavedBytesMeter", "watch_suffix_phase", "measure_dense",
           "measure_reuse"]

_Key = Tuple[str, int]  # (device, storage data_ptr)


def _storage_key(t: torch.Tensor) -> Tuple[_Key, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr()), storage.nbytes()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Byte counts of one measured step (see the module docstring for what "held" means)."""

    peak_saved_bytes: int
    """Max over the step of the held bytes (saved activations, plus the prefix cache for reuse)."""
    suffix_phase_peak_bytes: Optional[int] = None
    """Max of the held bytes while suffix microbatches run (reuse only; None for dense)."""
    cache_peak_bytes: Optional[int] = None
    """Max of PrefixKVCache.nbytes() over the step (reuse only; None for dense)."""

    def __post_init__(self) -> None:
        for name in ("peak_saved_bytes", "suffix_phase_peak_bytes", "cache_peak_bytes"):
            value = getattr(self, name)
            assert value is None or value >= 0, (name, value)


class _Saved:
    """What pack returns: the tensor, in an object whose death says autograd let go of it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytesMeter:
    """Context manager counting live saved-for-backward bytes (and optional extra held tensors).

    `extra` returns tensors held outside autograd (the prefix cache's); their storages join the
    union at every sample. `phase(True/False)` opens and closes a window with its own peak.
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = (),
                 extra: Optional[Callable[[], Iterable[torch.Tensor]]] = None) -> None:
        self._excluded = {_storage_key(t)[0] for t in exclude}
        self._extra = extra
        self._live: Dict[_Key, list] = {}  # key -> [nbytes, saved references alive]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase_peak_bytes: Optional[int] = None
        self._in_phase = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedBytesMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        key, nbytes = _storage_key(tensor)
        if key in self._excluded or nbytes == 0:
            return tensor
        slot = self._live.setdefault(key, [nbytes, 0])
        if slot[1] == 0:
            self.live_bytes += nbytes
        slot[1] += 1
        saved = _Saved(tensor)
        # Runs when the graph frees this saved reference (after its backward, or with the graph).
        weakref.finalize(saved, self._release, key)
        self.sample()
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: _Key) -> None:
        slot = self._live[key]
        slot[1] -= 1
        if slot[1] == 0:
            self.live_bytes -= slot[0]
            del self._live[key]
        self.sample()  # the cache's gK/gV grow during backward, while saved bytes shrink

    def held_bytes(self) -> int:
        """Live saved bytes plus the extra tensors' storages not already among them."""
        total, seen = self.live_bytes, set()
        for t in (self._extra() if self._extra is not None else ()):
            key, nbytes = _storage_key(t)
            if key not in self._live and key not in seen and key not in self._excluded:
                seen.add(key)
                total += nbytes
        return total

    def sample(self) -> None:
        held = self.held_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
        if self._in_phase:
            self.phase_peak_bytes = max(self.phase_peak_bytes or 0, held)

    def phase(self, active: bool) -> None:
        """Open (True) or close (False) the phase window; both ends are sampled."""
        if active:
            self._in_phase = True
            self.sample()
        else:
            self.sample()
            self._in_phase = False


def watch_suffix_phase(step, meter: SavedBytesMeter) -> None:
    """Open `meter`'s phase at the first suffix forward of `step` (a ReuseStep) and close it at the
    release of its last suffix microbatch, by wrapping the instance's methods."""
    from prefix_schedule.pipeline import ActionKind

    prepare, release = step.prepare, step.release_microbatch
    released = set()

    def watched_prepare(action) -> None:
        if action.kind is ActionKind.SUFFIX_FORWARD and meter.phase_peak_bytes is None:
            meter.phase(True)
        prepare(action)

    def watched_release(microbatch: int) -> None:
        release(microbatch)
        released.add(microbatch)
        if len(released) == step.num_microbatches:
            meter.phase(False)

    step.prepare, step.release_microbatch = watched_prepare, watched_release


def measure_dense(model, run: Callable[[], object]) -> MemoryReport:
    """Held bytes of one dense step `run()` on `model` (parameters excluded)."""
    with SavedBytesMeter(exclude=list(model.parameters())) as meter:
        run()
    return MemoryReport(peak_saved_bytes=meter.peak_bytes)


def measure_reuse(model, step, run: Callable[[object], object]) -> MemoryReport:
    """Held bytes of one reuse step `run(step)` for a fresh ReuseStep `step` on `model`."""
    cache_peak = [0]

    def extra() -> Iterable[torch.Tensor]:
        cache_peak[0] = max(cache_peak[0], step.cache.nbytes())
        return step.cache.tensors()

    meter = SavedBytesMeter(exclude=list(model.parameters()), extra=extra)
    watch_suffix_phase(step, meter)
    with meter:
        run(step)
    assert meter.phase_peak_bytes is not None, "the step ran no suffix microbatch"
    return MemoryReport(peak_saved_bytes=meter.peak_bytes,
                        suffix_phase_peak_bytes=meter.phase_peak_bytes,
                        cache_peak_bytes=cache_peak[0])
