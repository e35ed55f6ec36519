"""What ``nbattn doctor`` reports: versions, the CUDA driver, NVVM, the device, the kernel cache.

Every probe here is defensive: a missing driver, library or package becomes a
line of the report (with what to do about it), never an exception.  The
driver is asked through its C API with :mod:`ctypes`, so the report does not
depend on :mod:`numba.cuda` being importable; ``numba.cuda`` is imported only
when a driver with a device was found.
"""
from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Line", "collect", "report", "driver_info"]

PACKAGES = ("numpy", "numba", "numba-cuda", "llvmlite", "cuda-bindings", "cuda-core",
            "cuda-pathfinder", "torch", "matplotlib")

# CUdevice_attribute values of the CUDA driver API.
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
_ATTR_SM_COUNT = 16

_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib")


@dataclass(frozen=True)
class Line:
    """One report entry: ``key``, its ``value``, and a ``hint`` when something needs fixing."""

    key: str
    value: str
    hint: str = ""


def _safe(fn: Callable[[], list[Line]], key: str) -> list[Line]:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (the doctor reports, it does not raise)
        return [Line(key, f"could not be determined ({type(exc).__name__}: {exc})")]


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------

def _versions() -> list[Line]:
    from importlib.metadata import PackageNotFoundError, version

    import nbattn

    lines = [Line("nbattn", nbattn.__version__), Line("python", platform.python_version())]
    for pkg in PACKAGES:
        try:
            v = version(pkg)
        except PackageNotFoundError:
            v = "not installed"
        lines.append(Line(pkg, v))
    try:
        import torch

        cuda_build = torch.version.cuda
        lines.append(Line("torch build", f"CUDA {cuda_build}" if cuda_build else "CPU only"))
    except Exception as exc:  # noqa: BLE001
        lines.append(Line("torch build", f"unknown ({type(exc).__name__})"))
    return lines


def _fmt_cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def driver_info() -> dict:
    """What the CUDA driver says, without numba: ``{'library', 'cuda_version',
    'error', 'devices': [{'name', 'cc', 'sms', 'memory_GiB'}]}``.  ``library``
    is None when no driver library loads."""
    info: dict = {"library": None, "cuda_version": None, "error": None, "devices": []}
    lib = None
    for name in _DRIVER_NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        info["library"] = name
        break
    if lib is None:
        return info
    ver = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(ver)) == 0:
        info["cuda_version"] = _fmt_cuda_version(ver.value)
    rc = lib.cuInit(0)
    if rc != 0:
        info["error"] = f"cuInit failed with CUDA error {rc}"
        return info
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        info["error"] = "cuDeviceGetCount failed"
        return info
    for i in range(count.value):
        dev = ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, dev)

        def attr(a: int) -> int:
            out = ctypes.c_int(0)
            lib.cuDeviceGetAttribute(ctypes.byref(out), a, dev)
            return out.value

        mem = ctypes.c_size_t(0)
        get_mem = getattr(lib, "cuDeviceTotalMem_v2", None) or lib.cuDeviceTotalMem
        get_mem(ctypes.byref(mem), dev)
        info["devices"].append({"name": name.value.decode(errors="replace"),
                                "cc": (attr(_ATTR_CC_MAJOR), attr(_ATTR_CC_MINOR)),
                                "sms": attr(_ATTR_SM_COUNT),
                                "memory_GiB": mem.value / 2**30})
    return info


def _driver_and_device(backend: str) -> list[Line]:
    info = driver_info()
    lines = []
    if info["library"] is None:
        lines.append(Line("CUDA driver", "not found (no libcuda)",
                          "" if backend == "simulator" else
                          "install the NVIDIA driver, or run without NUMBA_ENABLE_CUDASIM=0 "
                          "to use the CUDA simulator"))
    else:
        lines.append(Line("CUDA driver", f"{info['library']}, supports CUDA {info['cuda_version']}"
                          if info["cuda_version"] else info["library"]))
    if info["error"]:
        lines.append(Line("driver error", info["error"]))
    for i, d in enumerate(info["devices"]):
        lines.append(Line(f"GPU {i}", f"{d['name']}, compute capability {d['cc'][0]}.{d['cc'][1]} "
                          f"(sm_{d['cc'][0]}{d['cc'][1]}), {d['sms']} SMs, "
                          f"{d['memory_GiB']:.0f} GiB"))
    if info["library"] is not None and not info["devices"]:
        lines.append(Line("GPU", "none visible to the driver",
                          "check nvidia-smi and CUDA_VISIBLE_DEVICES"))
    if backend == "simulator":
        lines.append(Line("kernels run in", "the CUDA simulator (correctness at tiny shapes; not timed)"))
    elif info["devices"]:
        lines.append(Line("kernels run in", f"GPU 0 ({info['devices'][0]['name']})"))
    else:
        lines.append(Line("kernels run in", "nowhere: NUMBA_ENABLE_CUDASIM=0 asks for a GPU and none "
                          "is usable", "unset NUMBA_ENABLE_CUDASIM (nbattn then picks the "
                          "simulator) or fix the driver"))
    return lines


def _cuda_major_hint() -> str:
    info = driver_info()
    major = info["cuda_version"].split(".")[0] if info["cuda_version"] else None
    if major in ("12", "13"):
        extra = f"pip install 'nbattn[gpu-cu{major}]'"
    else:
        extra = "pip install 'nbattn[gpu-cu12]' or 'nbattn[gpu-cu13]' (the driver's CUDA major)"
    return f"{extra} for NVVM and the CUDA runtime as wheels, or install a CUDA toolkit and set CUDA_HOME"


def _toolkit(backend: str) -> list[Line]:
    try:
        import cuda.pathfinder as pf
    except Exception as exc:  # noqa: BLE001
        return [Line("NVVM", f"cannot look (cuda-pathfinder missing: {type(exc).__name__})",
                     _cuda_major_hint() if backend == "gpu" else "")]
    lines = []
    try:
        home = pf.get_cuda_path_or_home()
    except Exception:  # noqa: BLE001
        home = None
    lines.append(Line("CUDA_HOME / CUDA_PATH", home or "not set"))
    for lib in ("nvvm", "nvrtc"):
        try:
            loaded = pf.load_nvidia_dynamic_lib(lib)
            lines.append(Line(lib.upper(), f"found: {loaded.abs_path}"))
        except Exception:  # noqa: BLE001
            if backend == "gpu":
                hint = _cuda_major_hint()
            elif lib == "nvvm":
                hint = _cuda_major_hint() + " (only a GPU run needs it)"
            else:
                hint = ""
            lines.append(Line(lib.upper(), "not found", hint))
    return lines


def kernel_cache_dir() -> str:
    """Where numba keeps compiled kernels of :mod:`nbattn.cuda` between processes."""
    from numba.core import caching

    src = str(Path(__file__).resolve().parent / "cuda" / "decode.py")

    def probe():  # any function: the locators only use its source file and name
        return None

    for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"):
        cls = getattr(caching, name, None) or getattr(caching, "_" + name)
        loc = cls.from_function(probe, src)
        if loc is not None:
            return loc.get_cache_path()
    return "none usable (kernels compile in every process)"


def _cache(backend: str) -> list[Line]:
    if backend == "simulator":
        return [Line("kernel cache", "not used by the simulator")]
    return [Line("kernel cache", kernel_cache_dir(),
                 "set NUMBA_CACHE_DIR to move it")]


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def collect() -> list[Line]:
    """Every line of the report; never raises."""
    try:
        from . import _compat

        backend = _compat.BACKEND
    except Exception:  # noqa: BLE001
        backend = "unknown"
    lines: list[Line] = []
    lines += _safe(_versions, "versions")
    lines += _safe(lambda: _driver_and_device(backend), "CUDA driver")
    lines += _safe(lambda: _toolkit(backend), "NVVM")
    lines += _safe(lambda: _cache(backend), "kernel cache")
    return lines


def report() -> str:
    """The report as text: ``key  value`` lines, each hint on the line after as ``-> fix``."""
    lines = collect()
    width = max(len(l.key) for l in lines) + 2
    out = []
    for l in lines:
        out.append(f"{l.key:<{width}}{l.value}")
        if l.hint:
            out.append(f"{'':<{width}}-> {l.hint}")
    return "\n".join(out)
