"""Host conversion and the primitive checks every layout is built from.

:class:`LayoutError` and the rules of single arguments: index metadata is
int32 (:func:`as_int32`), a CSR row pointer starts at 0 and never decreases
(:func:`check_indptr`), a paged KV cache tensor has one of two layouts
(:func:`cache_dims`), a query tensor matches the KV's head_dim
(:func:`check_q`), tensors share one device and dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["KV_LAYOUTS", "LayoutError", "is_torch", "to_numpy", "dtype_of", "as_int32", "check_indptr",
           "check_kv_layout", "CacheDims", "cache_dims", "check_heads", "check_q", "check_same_device",
           "check_same_dtype", "INT32_MAX"]

KV_LAYOUTS = ("NHD", "HND")


class LayoutError(ValueError):
    """Invalid layout metadata or tensor shapes; the message names the argument."""


# ---------------------------------------------------------------------------
# Host conversion and primitive checks
# ---------------------------------------------------------------------------

def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch object (tensor, dtype, ...), without importing torch."""
    return type(x).__module__.startswith("torch")


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy view/copy of a NumPy array, torch tensor, numba device
    array or anything with ``__array__``; lists become arrays."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":    # NumPy has no bf16: widen exactly to float32
            x = x.float()
        return x.numpy()
    if hasattr(x, "copy_to_host"):  # numba device array
        return x.copy_to_host()
    return np.asarray(x)


def dtype_of(x: Any) -> str:
    """The element type's name, without converting (``'int32'``, ``'float16'``...)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return "python-list"
    return str(dt).replace("torch.", "")


_I32 = np.iinfo(np.int32)

INT32_MAX = int(_I32.max)
"""The largest value an int32 metadata array holds: a page id, an indptr entry, a KV length."""


def _on_device(x: Any) -> bool:
    """Whether ``x`` lives in GPU memory (a CUDA torch tensor, a numba device
    array, or anything exposing ``__cuda_array_interface__``)."""
    if is_torch(x):
        return getattr(getattr(x, "device", None), "type", "cpu") != "cpu"
    return hasattr(x, "copy_to_host") or hasattr(x, "__cuda_array_interface__")


def _fit_int32(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.size and (int(arr.min()) < _I32.min or int(arr.max()) > _I32.max):
        raise LayoutError(f"{name}: values do not fit in int32 "
                          f"(range {int(arr.min())}..{int(arr.max())})")
    return arr.astype(np.int32)


def as_int32(name: str, x: Any) -> np.ndarray:
    """Host int32 1-D array of index metadata.

    Index metadata is int32.  A Python list or tuple of ints, and a host
    (NumPy or CPU torch) array of another integer type such as int64, is
    checked to fit in int32 and converted.  A device array must already be
    int32: kernels read it in place, so converting it would be a hidden copy.
    Floating-point and boolean arrays are refused.
    """
    if type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 1:
        return x                                   # the common case, with nothing to convert
    if isinstance(x, (list, tuple)):
        try:
            arr = np.asarray(x, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise LayoutError(f"{name}: must be a list of integers") from None
        arr = _fit_int32(name, arr)
    else:
        dt = dtype_of(x)
        if dt != "int32":
            integer = dt in ("int64", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
            if not integer:
                raise LayoutError(f"{name}: must be int32 (host int64 arrays and lists are "
                                  f"converted), got {dt}")
            if _on_device(x):
                raise LayoutError(f"{name}: must be int32 on the device, got {dt}; convert it "
                                  f"once with .to(torch.int32) (or .astype(np.int32))")
            arr = _fit_int32(name, to_numpy(x))
        else:
            arr = to_numpy(x)
    if arr.ndim != 1:
        raise LayoutError(f"{name}: must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def check_indptr(name: str, indptr: Any, *, total: int | None = None,
                 total_name: str = "") -> np.ndarray:
    """A CSR row pointer: int32, length >= 1, starts at 0, non-decreasing,
    and (when ``total`` is given) ends at ``total``."""
    arr = as_int32(name, indptr)
    if arr.size == 0:
        raise LayoutError(f"{name}: must have length batch_size+1 >= 1, got empty")
    if arr[0] != 0:
        raise LayoutError(f"{name}: must start at 0, got {int(arr[0])}")
    d = np.diff(arr.astype(np.int64))
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise LayoutError(f"{name}: must be non-decreasing, but {name}[{i + 1}]={int(arr[i + 1])} "
                          f"< {name}[{i}]={int(arr[i])}")
    if total is not None and int(arr[-1]) != int(total):
        what = total_name or "the number of entries"
        raise LayoutError(f"{name}: must end at {what} ({int(total)}), got {int(arr[-1])}")
    return arr


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"kv_layout: must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


# ---------------------------------------------------------------------------
# Paged KV cache tensor
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheDims:
    """Sizes read off a paged KV cache tensor."""
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str


def cache_dims(paged_kv_cache: Any, kv_layout: str = "NHD") -> CacheDims:
    """Read (num_pages, page_size, num_kv_heads, head_dim) from the cache shape.

    NHD: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``;
    HND: ``[num_pages, 2, num_kv_heads, page_size, head_dim]``.
    """
    check_kv_layout(kv_layout)
    shape = tuple(int(s) for s in paged_kv_cache.shape)
    if len(shape) != 5 or shape[1] != 2:
        raise LayoutError(f"paged_kv_cache: must have shape [num_pages, 2, ...] with 5 dims "
                          f"({kv_layout}), got {shape}")
    if kv_layout == "NHD":
        n, _, ps, h, d = shape
    else:
        n, _, h, ps, d = shape
    if ps < 1 or h < 1 or d < 1:
        raise LayoutError(f"paged_kv_cache: page_size, num_kv_heads and head_dim must be >= 1, got {shape}")
    return CacheDims(n, ps, h, d, kv_layout)


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    """GQA group size; num_kv_heads must divide num_qo_heads."""
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise LayoutError(f"num_qo_heads: must be a positive multiple of num_kv_heads "
                          f"({num_kv_heads}), got {num_qo_heads}")
    return num_qo_heads // num_kv_heads


def check_q(q: Any, head_dim: int, *, name: str = "q", rows: int | None = None,
            ndim: int = 3) -> tuple[int, ...]:
    """Shape checks of a query tensor against the KV's head_dim and row count."""
    shape = tuple(int(s) for s in q.shape)
    if len(shape) != ndim:
        want = "[rows, num_qo_heads, head_dim]" if ndim == 3 else "[num_qo_heads, head_dim]"
        raise LayoutError(f"{name}: must have shape {want}, got {shape}")
    if shape[-1] != head_dim:
        raise LayoutError(f"{name}: head_dim {shape[-1]} does not match the KV's head_dim {head_dim}")
    if rows is not None and shape[0] != rows:
        raise LayoutError(f"{name}: has {shape[0]} rows but qo_indptr[-1] is {rows}")
    return shape


def check_same_device(**tensors: Any) -> None:
    """All array arguments on one device (host NumPy counts as 'cpu')."""
    devs = {}
    for name, t in tensors.items():
        if t is None:
            continue
        dev = getattr(t, "device", None)
        if dev is None:
            dev = "cuda" if hasattr(t, "__cuda_array_interface__") else "cpu"
        devs[name] = str(getattr(dev, "type", dev)).split(":")[0]
    if len(set(devs.values())) > 1:
        listing = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise LayoutError(f"{next(iter(devs))}: all tensors must be on one device, got {listing}")


def check_same_dtype(**tensors: Any) -> None:
    dts = {k: dtype_of(v) for k, v in tensors.items() if v is not None}
    if len(set(dts.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in dts.items())
        name = list(dts)[-1]
        raise LayoutError(f"{name}: dtype must match the other inputs, got {listing}")
