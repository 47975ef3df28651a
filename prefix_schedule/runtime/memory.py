"""Device-memory accounting of one training step, modelled the same way on CPU and GPU.

[Note: device-memory accounting] What would live on the accelerator during a step, counted from
the tensors themselves (CPU torch has no allocator to ask):
- every tensor autograd saves for backward (`saved_tensors_hooks`), each storage once, from the
  first save until the last saved reference to it is released -- this includes the inputs that
  activation recompute (Megatron's CheckpointFunction) keeps;
- tensors held outside autograd, given as sources: the prefix cache's K/V copies and fp32 gK/gV,
  the pipeline buffers in flight (received inputs, gradients waiting to be sent), the prefix
  activations that an offloader brought back for Phase C;
- NOT parameters, gradients, optimizer state, or transient temporaries freed without being saved
  (they are the same for dense and reuse, or short-lived).
Offloaded bytes are host bytes: an offloader (runtime/offload.py) that parks a saved tensor in
host memory reports it to the active meter as host, not device. The union of storages is taken
at every sample, so a K/V copy that is a view of a saved tensor counts once.

Phases: the meter keeps one peak per phase name (`phase(name)`); `watch_step` names each compute
action's kind ("PF", "SF", "SB", "PB", "RG") and "suffix": every suffix forward and backward
(the paper's suffix-phase comparison). A group's Phase C may run between other groups' suffix
microbatches; it is its own phase ("PB"), not part of "suffix".
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["DeviceMemoryMeter", "active_meter", "storage_key", "watch_step"]

_Key = Tuple[str, int]  # (device, storage data_ptr)
_LOCAL = threading.local()


def storage_key(t: torch.Tensor) -> Tuple[_Key, int]:
    """(identity of `t`'s storage, its bytes)."""
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def active_meter() -> Optional["DeviceMemoryMeter"]:
    """The meter whose `with` block is running on this thread, or None."""
    return getattr(_LOCAL, "meter", None)


class _Saved:
    """What pack returns: the tensor, in an object whose death says autograd let go of it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class DeviceMemoryMeter:
    """Context manager: live device bytes (saved tensors + sources), host bytes, peaks.

    `exclude`: tensors never counted (the model's parameters). `sources`: callables returning
    tensors held outside autograd, read at every sample.
    """

    def __init__(self, *, exclude: Iterable[torch.Tensor] = (),
                 sources: Iterable[Callable[[], Iterable[torch.Tensor]]] = ()) -> None:
        self._excluded = {storage_key(t)[0] for t in exclude}
        self.sources: List[Callable[[], Iterable[torch.Tensor]]] = list(sources)
        self._live: Dict[_Key, list] = {}  # key -> [nbytes, saved references alive]
        self.saved_bytes = 0
        self.host_bytes = 0
        self.peak_bytes = 0
        self.peak_host_bytes = 0
        self.phase_peaks: Dict[str, int] = {}
        self._phases: set = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> "DeviceMemoryMeter":
        assert active_meter() is None, "memory meters do not nest"
        _LOCAL.meter = self
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        _LOCAL.meter = None

    # ---- saved tensors (also called by an offloader for the tensors it leaves on the device)
    def pack(self, tensor: torch.Tensor):
        key, nbytes = storage_key(tensor)
        if key in self._excluded or nbytes == 0:
            return tensor
        slot = self._live.setdefault(key, [nbytes, 0])
        if slot[1] == 0:
            self.saved_bytes += nbytes
        slot[1] += 1
        saved = _Saved(tensor)
        # runs when the graph frees this saved reference (after its backward, or with the graph)
        weakref.finalize(saved, self._release, key)
        self.sample()
        return saved

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: _Key) -> None:
        slot = self._live[key]
        slot[1] -= 1
        if slot[1] == 0:
            self.saved_bytes -= slot[0]
            del self._live[key]
        self.sample()  # the cache's gK/gV grow during backward while saved bytes shrink

    def is_excluded(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor)[0] in self._excluded

    # ---- host
    def add_host_bytes(self, nbytes: int) -> None:
        """An offloader parked (positive) or returned (negative) `nbytes` in host memory."""
        self.host_bytes += nbytes
        assert self.host_bytes >= 0, self.host_bytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.sample()

    # ---- samples and phases
    def device_bytes(self) -> int:
        """Live saved bytes plus the sources' storages not already among them."""
        total, seen = self.saved_bytes, set()
        for source in self.sources:
            for t in source():
                key, nbytes = storage_key(t)
                if key not in self._live and key not in seen and key not in self._excluded:
                    seen.add(key)
                    total += nbytes
        return total

    def sample(self) -> None:
        held = self.device_bytes()
        self.peak_bytes = max(self.peak_bytes, held)
        for name in self._phases:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), held)

    def phase(self, name: str, active: bool) -> None:
        """Open (True) or close (False) phase `name`; both ends are sampled."""
        if active:
            self._phases.add(name)
            self.sample()
        else:
            self.sample()
            self._phases.discard(name)


def watch_step(step, meter: DeviceMemoryMeter) -> None:
    """Let `meter` see `step` (a ReuseStep): its caches, in-flight pipeline tensors and offloaded
    activations as sources, and its compute actions as phases ([Note: device-memory accounting])."""
    from prefix_schedule.pipeline import ActionKind

    meter.sources.append(lambda: (t for cache in step.caches for t in cache.tensors()))
    meter.sources.append(step.resident_tensors)
    suffix_kinds = (ActionKind.SUFFIX_FORWARD, ActionKind.SUFFIX_BACKWARD)
    current = []  # the phases of the running action

    def on_action(action) -> None:
        for name in current:
            meter.phase(name, False)
        current.clear()
        if action is not None:
            current.append(action.kind.value)
            if action.kind in suffix_kinds:
                current.append("suffix")
            for name in current:
                meter.phase(name, True)

    step.observers.append((on_action, lambda microbatch: None))
