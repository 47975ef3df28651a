"""Devices as data: peak throughputs, bandwidths and the efficiency curves the roofline uses.

A `DeviceSpec` is everything roofline.py needs to cost an op: the achievable GEMM throughput by
shape, a flash-attention efficiency curve, memory bandwidth for memory-bound ops, a fixed cost
per launched op, and the links collectives and p2p use. `GPUS` holds five GPUs from their public
spec pages (each entry's `sources`); their efficiency fields are assumptions, named as such in
`assumptions`, until tools/gpu_check.py measures the same microbenchmark on the GPU
(tools/predict_bench.py), whose JSON `load_device` turns into a DeviceSpec that replaces them.

Throughput curves (m: tokens of a GEMM, or queries of an attention call; d: the smaller of a
GEMM's other two dimensions):
    GEMM FLOP/s      = gemm_peak * m / (m + gemm_m_half) * d / (d + gemm_d_half)
    attention FLOP/s = gemm_peak * attention_efficiency * m / (m + attention_m_half)
(attention backward: `attention_backward_efficiency` instead; it also does
`attention_backward_flops` x the forward FLOPs: flash attention recomputes QK^T.)
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Mapping

__all__ = ["DeviceSpec", "GPUS", "GPU_ASSUMPTIONS", "get_device", "load_device"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or the CPU this machine measured) as the roofline sees it."""

    name: str
    """Short name (`h20`, `cpu-measured`)."""
    gemm_peak: float
    """Dense matmul FLOP/s the curve saturates at (GPUs: spec peak x achievable fraction)."""
    gemm_m_half: float
    """Tokens at which a GEMM reaches half of `gemm_peak` (small GEMMs are inefficient)."""
    gemm_d_half: float
    """Inner/outer width at which a GEMM reaches half of `gemm_peak` (0: no width effect)."""
    attention_efficiency: float
    """Flash-attention forward FLOP/s at long rows, as a fraction of `gemm_peak`."""
    attention_backward_efficiency: float
    """The same for the attention backward."""
    attention_m_half: float
    """Queries per call at which attention reaches half of its long-row throughput."""
    attention_backward_flops: float = 2.5
    """Attention backward FLOPs / forward FLOPs (flash attention: 2.5, it recomputes QK^T)."""
    memory_bandwidth: float
    """Bytes/s a memory-bound op (norm, RoPE, SwiGLU, residual add, copies) streams."""
    op_overhead_s: float
    """Fixed seconds per launched op (kernel launch, framework dispatch)."""
    dtype_bytes: int = 2
    """Bytes per activation element (bf16 on GPUs; fp32 on the CPU runs)."""
    memory_gib: float = 0.0
    """Device memory (0: not a memory-bound device, e.g. the CPU)."""
    intra_node_bandwidth: float
    """Bytes/s one direction, GPU to GPU inside a node (NVLink), per GPU."""
    inter_node_bandwidth: float
    """Bytes/s one direction per GPU across nodes (InfiniBand NIC per GPU)."""
    link_latency_s: float
    """Seconds per collective step or p2p message."""
    gpus_per_node: int = 8
    """Ranks sharing the intra-node link; a group spanning more uses inter_node_bandwidth."""
    sources: tuple = ()
    """Public pages the spec numbers come from (or how they were measured)."""

    def __post_init__(self) -> None:
        for name in ("gemm_peak", "memory_bandwidth", "intra_node_bandwidth",
                     "inter_node_bandwidth", "attention_efficiency",
                     "attention_backward_efficiency", "attention_backward_flops"):
            _positive(self, name)
        for name in ("gemm_m_half", "gemm_d_half", "attention_m_half", "op_overhead_s",
                     "link_latency_s", "memory_gib"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"DeviceSpec.{name}={value!r}; give a finite number >= 0")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"DeviceSpec.dtype_bytes={self.dtype_bytes!r}; give 2 (bf16) or 4 (fp32)")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise ValueError(f"DeviceSpec.gpus_per_node={self.gpus_per_node!r}; give an int >= 1")

    def gemm_flops(self, m: float, d: float) -> float:
        """Achieved FLOP/s of a GEMM with m tokens whose smaller other dimension is d."""
        width = d / (d + self.gemm_d_half) if self.gemm_d_half else 1.0
        return self.gemm_peak * m / (m + self.gemm_m_half) * width

    def attention_flops(self, queries: float, backward: bool) -> float:
        """Achieved FLOP/s of a flash-attention call over `queries` query rows."""
        eff = self.attention_backward_efficiency if backward else self.attention_efficiency
        return self.gemm_peak * eff * queries / (queries + self.attention_m_half)

    def link_bandwidth(self, group_size: int) -> float:
        """Per-rank bandwidth of a collective over `group_size` consecutive ranks."""
        return self.intra_node_bandwidth if group_size <= self.gpus_per_node \
            else self.inter_node_bandwidth

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _positive(spec: DeviceSpec, name: str) -> None:
    value = getattr(spec, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"DeviceSpec.{name}={value!r}; give a finite number > 0")


# Efficiency fields of the GPUs below (not on any spec sheet; what tools/gpu_check.py measures):
GPU_ASSUMPTIONS = {
    "gemm_fraction": 0.75,  # large bf16 cuBLAS GEMMs reach ~70-80% of the dense peak
    "gemm_m_half": 128.0, "gemm_d_half": 0.0,
    "attention_efficiency": 0.55, "attention_backward_efficiency": 0.40,  # FlashAttention-2/3
    "attention_m_half": 512.0,
    "hbm_fraction": 0.80,  # achievable share of the spec HBM bandwidth
    "op_overhead_s": 8e-6,  # eager PyTorch launch + dispatch per op
    "link_fraction": 0.80,  # NCCL bus bandwidth / link spec
    "link_latency_s": 10e-6,
}

_KLOCKWOOD = "https://glennklockwood.com/garden/processors/"
_GPU_TABLE = {
    # name: (bf16 dense TFLOP/s, HBM TB/s, memory GB, NVLink GB/s one direction, IB GB/s per GPU)
    "h20": (148, 4.0, 96, 450, 50, ("https://willitrunai.com/es/gpus/h20-96gb",
                                    "https://zangshuxian.com/new/674733024499207168")),
    "h100": (989.4, 3.35, 80, 450, 50, (_KLOCKWOOD + "h100",
                                        "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html")),
    "h200": (989.4, 4.8, 141, 450, 50, (_KLOCKWOOD + "h100",
                                        "https://www.saulelectric.com/nvidia-h200.html")),
    "a100": (312, 2.039, 80, 300, 25, (_KLOCKWOOD + "A100",)),
    "b200": (2250, 8.0, 180, 900, 50, (_KLOCKWOOD + "B200",
                                       "https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview")),
}


def _gpu(name: str, tflops, tbs, gb, nvlink_gbs, ib_gbs, sources) -> DeviceSpec:
    a = GPU_ASSUMPTIONS
    return DeviceSpec(
        name=name, gemm_peak=tflops * 1e12 * a["gemm_fraction"], gemm_m_half=a["gemm_m_half"],
        gemm_d_half=a["gemm_d_half"], attention_efficiency=a["attention_efficiency"] / a["gemm_fraction"],
        attention_backward_efficiency=a["attention_backward_efficiency"] / a["gemm_fraction"],
        attention_m_half=a["attention_m_half"], memory_bandwidth=tbs * 1e12 * a["hbm_fraction"],
        op_overhead_s=a["op_overhead_s"], dtype_bytes=2, memory_gib=gb * 1e9 / 2 ** 30,
        intra_node_bandwidth=nvlink_gbs * 1e9 * a["link_fraction"],
        inter_node_bandwidth=ib_gbs * 1e9 * a["link_fraction"], link_latency_s=a["link_latency_s"],
        sources=tuple(sources) + ("IB: one 400 Gb/s (A100: 200 Gb/s) NIC per GPU, assumed",
                                  "efficiencies: GPU_ASSUMPTIONS in prefix_schedule/predict/devices.py"))


GPUS: Mapping[str, DeviceSpec] = {name: _gpu(name, *row) for name, row in _GPU_TABLE.items()}


def get_device(name: str) -> DeviceSpec:
    """A GPU of `GPUS` by name; ValueError naming the choices otherwise."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {sorted(GPUS)} or pass a measured "
                         "device file (tools/predict_bench.py --out FILE)")
    return GPUS[name]


def load_device(path) -> DeviceSpec:
    """A DeviceSpec from a JSON file: tools/predict_bench.py's output (its `device` object) or
    a tools/gpu_check.py report (its `predict_device`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"device file {str(path)!r} does not exist; make it with "
                         "`python tools/predict_bench.py --out FILE`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"device file {str(path)!r} is not JSON ({exc}); regenerate it") from None
    if isinstance(data, dict) and isinstance(data.get("predict_device"), dict):
        data = data["predict_device"]  # a tools/gpu_check.py report
        if "device" not in data:
            raise ValueError(f"{str(path)!r}: gpu_check.py's predictor phase did not run or failed "
                             f"({data.get('skipped') or data.get('error', '')[-200:]}); rerun it")
    fields = data.get("device", data) if isinstance(data, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(f"device file {str(path)!r} holds no `device` object; regenerate it")
    known = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"device file {str(path)!r} has unknown fields {unknown}; regenerate it")
    fields = dict(fields, sources=tuple(fields.get("sources", ())))
    try:
        return DeviceSpec(**fields)
    except TypeError as exc:
        raise ValueError(f"device file {str(path)!r} lacks fields ({exc}); regenerate it") from None
