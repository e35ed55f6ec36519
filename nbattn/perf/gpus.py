"""GPU specifications for the roofline model (docs/concepts/performance.md).

The ``mem_bandwidth_GBps``, ``tensor_tflops``, ``fp32_tflops``, ``num_sms`` and
``smem_per_sm_KiB`` fields below are vendor *datasheet* values (SXM parts,
dense fp16/bf16 tensor-core throughput, i.e. without 2:4 sparsity).  They are
ceilings printed on a spec sheet, not something we measured.

The performance model reports decode against the *measured* copy
bandwidth, so a spec also carries optional measured fields.  For the H200 they
hold the ceilings measured on the H200 (device-to-device copy
about 4.3 TB/s counting bytes read plus written, bf16 matmul about 790
TFLOP/s).  A benchmark run re-measures the copy ceiling and stores it as
``copy_bandwidth_GBps`` in its result file; :func:`with_copy_bandwidth` swaps
that in, so figures always quote the ratio against the same run's ceiling.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .roofline import ridge_point

__all__ = [
    "GPUSpec",
    "H200",
    "H100_SXM",
    "A100_SXM_80GB",
    "GPUS",
    "get_gpu",
    "match_gpu",
    "with_copy_bandwidth",
]


@dataclass(frozen=True)
class GPUSpec:
    """One GPU's ceilings.  Units: GB/s (1e9 bytes/s), TFLOP/s (1e12), KiB."""

    name: str
    mem_bandwidth_GBps: float  # datasheet HBM bandwidth
    tensor_tflops: float  # datasheet dense fp16/bf16 tensor-core peak
    fp32_tflops: float  # datasheet fp32 CUDA-core peak (non-tensor)
    num_sms: int
    smem_per_sm_KiB: int
    measured_copy_GBps: float | None = None  # device copy ceiling, measured
    measured_bf16_matmul_tflops: float | None = None  # bf16 GEMM, measured

    @property
    def copy_bandwidth_GBps(self) -> float:
        """Bandwidth to compare decode against: measured when known, else datasheet.

        The performance model reports decode as achieved / *measured* copy bandwidth;
        the datasheet number is only a fallback for GPUs we never ran on.
        """
        if self.measured_copy_GBps is not None:
            return float(self.measured_copy_GBps)
        return float(self.mem_bandwidth_GBps)

    @property
    def bandwidth_is_measured(self) -> bool:
        return self.measured_copy_GBps is not None

    def ridge_intensity(self, peak_tflops: float | None = None) -> float:
        """FLOP/byte where the roofline's slope meets its flat roof."""
        peak = self.tensor_tflops if peak_tflops is None else peak_tflops
        return float(ridge_point(peak, self.copy_bandwidth_GBps))


# Datasheet values (NVIDIA H200 / H100 / A100 product briefs, SXM form factor), in the
# field order: name, HBM GB/s, dense fp16/bf16 tensor TFLOP/s, fp32 TFLOP/s, SMs, shared
# memory KiB per SM.  The H200 measured fields are our measurements on an H200, not
# datasheet values.
H200 = GPUSpec("H200", 4800.0, 989.5, 67.0, 132, 228,
               measured_copy_GBps=4300.0, measured_bf16_matmul_tflops=790.0)
H100_SXM = GPUSpec("H100 SXM", 3350.0, 989.5, 67.0, 132, 228)
A100_SXM_80GB = GPUSpec("A100 SXM 80GB", 2039.0, 312.0, 19.5, 108, 164)

GPUS: dict[str, GPUSpec] = {g.name: g for g in (H200, H100_SXM, A100_SXM_80GB)}

# Result files name the GPU the way the driver spells it ("NVIDIA H200",
# "NVIDIA H100 80GB HBM3", "A100-SXM4-80GB"); the family token is enough.
_FAMILY = {"h200": H200, "h100": H100_SXM, "a100": A100_SXM_80GB}


def match_gpu(name: str) -> GPUSpec | None:
    """The spec whose family token (h200/h100/a100) appears in ``name``, or None."""
    key = "".join(ch for ch in str(name).lower() if ch.isalnum())
    for token, spec in _FAMILY.items():
        if token in key:
            return spec
    return None


def get_gpu(name: str) -> GPUSpec:
    """Like :func:`match_gpu` but raises ``KeyError`` listing the known GPUs."""
    spec = GPUS.get(name) or match_gpu(name)
    if spec is None:
        raise KeyError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")
    return spec


def _copy_bandwidth_of(source: Any) -> float | None:
    if source is None:
        return None
    if isinstance(source, (int, float)) and not isinstance(source, bool):
        value = float(source)
    else:
        if isinstance(source, Mapping):
            raw = source.get("copy_bandwidth_GBps")
        else:  # a results.Suite or anything shaped like one
            raw = getattr(source, "copy_bandwidth_GBps", None)
        if raw is None or isinstance(raw, bool):
            return None
        value = float(raw)
    if not math.isfinite(value) or value <= 0:
        return None
    return value


def with_copy_bandwidth(spec: GPUSpec, source: Any) -> GPUSpec:
    """``spec`` with its measured copy bandwidth taken from ``source`` when present.

    ``source`` may be a loaded result suite (:class:`nbattn.perf.results.Suite`),
    the raw result-file dict, a number in GB/s, or None.  When it carries no
    usable ``copy_bandwidth_GBps`` the spec comes back unchanged, so callers can
    pass whatever :func:`nbattn.perf.results.load_suite` returned.
    """
    value = _copy_bandwidth_of(source)
    if value is None:
        return spec
    return dataclasses.replace(spec, measured_copy_GBps=value)
