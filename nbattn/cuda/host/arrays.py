"""Inputs and outputs of the nbattn.cuda kernels: what kind of array came in,
how it reaches the device, which stream to launch on, and what goes back.

Rules (docs/concepts/layouts.md):
- NumPy arrays (and CPU torch tensors) are copied to the device; results come
  back as the same kind (NumPy / CPU torch).
- numba device arrays, torch CUDA tensors and anything with
  ``__cuda_array_interface__`` are used in place (zero-copy); results are the
  same kind (torch in -> torch out, numba/other -> numba device array).
- With torch tensors the kernels launch on torch's current stream.
- Element types: fp16, bf16 (torch bfloat16, ml_dtypes bfloat16 or a raw
  2-byte void dtype ``|V2``, which is how torch bf16 looks through
  ``__cuda_array_interface__``) and fp32.  Kernels see 16-bit data as raw
  integer words and convert in registers (:mod:`nbattn.cuda.blocks.primitives`).

Interface (stable; prefill/sparse/cascade wrappers use it too):

    dtype_code(x, name)        -> "f16" | "bf16" | "f32"   (LayoutError otherwise)
    kind_of(x)                 -> "numpy" | "torch_cpu" | "torch" | "numba" | "cai"
    is_device_kind(kind)       -> bool
    launch_stream(*arrays)     -> a numba stream (torch's current one when any
                                  argument is a torch CUDA tensor, else 0)
    to_device(x, name, stream, code=None, *, strided=False)
                               -> numba device array holding x's data (raw integer
                                  dtype for 16-bit floats; zero-copy for device kinds,
                                  which must be C-contiguous unless strided=True)
    flat(dev)                  -> 1-D view of a contiguous device array
    words(dev)                 -> 1-D uint32 view of it
    new_output(kind, shape, code, stream, like=None) -> (user_object, device_array)
                                  a fresh result of ``kind`` (device array raw-typed)
    finish(kind, user_obj, dev, code, stream) -> what the caller gets back
    host_meta(name, x)         -> host int32 NumPy copy of metadata (for validation)
    device_meta(x, host, stream) -> device int32 array (x itself when on device)
    output_for(name, given, kind, shape, code, stream, like=None, *, strided=False)
                               -> (user_object, device_array)
                                  the caller's ``out=``/``lse=`` buffer (used in place on the
                                  device, a device scratch for host kinds) or a new_output()
    finish_into(kind, given, user_obj, dev, code, stream) -> finish(), except that a
                                  caller's host buffer ``given`` gets the result copied in
    finish_results(kind, code, stream, out, out_user, out_dev, lse, lse_user, lse_dev,
                   return_lse)  -> o, or (o, lse): finish_into() of both results
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from ...layout import LayoutError, as_int32, is_torch
from ..blocks.primitives import SIMULATOR

__all__ = ["FP8", "dtype_code", "kind_of", "is_torch", "is_device_kind", "launch_stream", "to_device", "flat", "words",
           "new_output", "finish", "host_meta", "device_meta", "RAW", "NP_DTYPE",
           "check_contiguous", "copy_into_host", "output_for", "finish_into", "finish_results"]

# Raw element type the kernels see, the NumPy dtype a host result has.
RAW = {"f16": np.uint16, "bf16": np.uint16, "f32": np.float32, "e4m3": np.uint8, "e5m2": np.uint8}
FP8 = ("e4m3", "e5m2")     # fp8 K/V codes (torch float8_e4m3fn / float8_e5m2), read as raw bytes
NP_DTYPE = {"f16": np.dtype(np.float16), "bf16": np.dtype("V2"), "f32": np.dtype(np.float32)}


def kind_of(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        return "torch" if x.is_cuda else "torch_cpu"
    if cuda.is_cuda_array(x) if hasattr(cuda, "is_cuda_array") else False:
        return "numba" if type(x).__module__.startswith("numba") else "cai"
    if type(x).__module__.startswith("numba"):  # simulator device arrays
        return "numba"
    return "numpy"


def is_device_kind(kind: str) -> bool:
    return kind in ("torch", "numba", "cai")


_CODES: dict = {}


def dtype_code(x: Any, name: str) -> str:
    """Which supported float type ``x`` holds; LayoutError naming ``name`` if none."""
    dt = getattr(x, "dtype", None)
    try:
        return _CODES[dt]                            # a dtype seen before (every call's hot path)
    except (KeyError, TypeError):
        pass
    code = _dtype_code(dt, name)
    try:
        _CODES[dt] = code
    except TypeError:
        pass
    return code


def _dtype_code(dt: Any, name: str) -> str:
    text = str(dt).replace("torch.", "")
    if text in ("float16", "half"):
        return "f16"
    if text in ("float32", "float"):
        return "f32"
    if text == "bfloat16" or text in ("|V2", "V2") or (isinstance(dt, np.dtype) and dt.kind == "V"
                                                    and dt.itemsize == 2):
        return "bf16"
    if text.startswith("float8"):
        raise LayoutError(f"{name}: dtype must be float16, bfloat16 or float32, got {text}: of nbattn.cuda, "
                          "only batch_decode_paged, BatchDecodeWithPagedKVCacheWrapper and append_paged_kv_cache "
                          "read fp8 K/V caches (docs/concepts/layouts.md, 'fp8 KV caches')")
    raise LayoutError(f"{name}: dtype must be float16, bfloat16 or float32, got {text}")


def launch_stream(*arrays: Any):
    for a in arrays:
        if a is not None and is_torch(a) and a.is_cuda:
            import torch
            return cuda.external_stream(torch.cuda.current_stream(a.device).cuda_stream)
    return 0 if SIMULATOR else cuda.default_stream()


def check_contiguous(x: Any, name: str) -> None:
    """Device arrays are used in place, so they must be C-contiguous."""
    if is_torch(x):
        ok = x.is_contiguous()
    elif hasattr(x, "is_c_contiguous"):
        ok = x.is_c_contiguous()
    elif hasattr(x, "__cuda_array_interface__"):
        strides = x.__cuda_array_interface__.get("strides")
        ok = strides is None
    else:
        ok = True
    if not ok:
        raise LayoutError(f"{name}: device arrays must be C-contiguous (they are used in place)")


def _host_raw(x: Any, code: str) -> np.ndarray:
    """Host NumPy array of x's data in the raw element type the kernels read."""
    if is_torch(x):
        import torch
        t = x.detach()
        if code in FP8:
            arr = t.view(torch.uint8).numpy()
        else:
            arr = t.view(torch.int16).numpy().view(np.uint16) if code == "bf16" else t.numpy()
    else:
        arr = np.asarray(x)
    return c_strided(np.ascontiguousarray(arr)).view(RAW[code])


def c_strided(arr: np.ndarray) -> np.ndarray:
    """``arr`` (C-contiguous) with the strides of a fresh C array: NumPy calls an
    array with any stride on a length-1 axis contiguous (``a[None]`` has stride 0
    there), numba's device arrays do not, and would refuse to flatten a copy of it."""
    want = np.empty((0,), arr.dtype).itemsize
    strides = []
    for n in reversed(arr.shape):
        strides.append(want)
        want *= n
    strides = tuple(reversed(strides))
    if arr.strides == strides:
        return arr
    return np.lib.stride_tricks.as_strided(arr, arr.shape, strides)


def to_device(x: Any, name: str, stream=0, code: str | None = None, *, strided: bool = False):
    """A numba device array over x's data, raw-typed for 16-bit floats.  Device
    arrays must be C-contiguous unless ``strided`` (for kernels that index
    with the array's strides: the prefill kernels)."""
    kind = kind_of(x)
    if code is None:
        code = dtype_code(x, name)
    if not is_device_kind(kind):
        return cuda.to_device(_host_raw(x, code), stream=stream)
    if not strided:
        check_contiguous(x, name)
    if kind == "torch":
        import torch
        t = x.detach()
        if code in FP8:
            t = t.view(torch.uint8)
        elif code != "f32":
            t = t.view(torch.int16)
        dev = cuda.as_cuda_array(t)
    elif kind == "cai":
        dev = cuda.as_cuda_array(x)
    else:
        dev = x
    raw = RAW[code]
    if np.dtype(dev.dtype) != np.dtype(raw):
        dev = dev.view(raw)
    return dev


def flat(dev):
    """1-D view of a contiguous device array (any stride on a length-1 axis)."""
    n = int(np.prod(dev.shape))
    if SIMULATOR or dev.is_c_contiguous():
        return dev.reshape(n)
    dense = [(size, st) for size, st in zip(dev.shape, dev.strides) if size != 1]
    step = np.dtype(dev.dtype).itemsize
    for size, st in reversed(dense):
        if st != step:
            raise LayoutError(f"device array of shape {tuple(dev.shape)} and strides {tuple(dev.strides)}: "
                              "must be C-contiguous")
        step *= size
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray((n,), (np.dtype(dev.dtype).itemsize,), dev.dtype, stream=dev.stream,
                         gpu_data=dev.gpu_data)


def words(dev):
    """1-D uint32 view of a contiguous device array whose byte size is a multiple of 4."""
    return flat(dev).view(np.uint32)


def new_output(kind: str, shape: tuple, code: str, stream=0, like: Any = None):
    """A fresh result array: (what the caller will get, raw device array to write)."""
    if kind == "torch":
        import torch
        tdt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[code]
        t = torch.empty(shape, dtype=tdt, device=like.device if like is not None else "cuda")
        return t, to_device(t, "out", stream, code)
    dev = cuda.device_array(shape, dtype=RAW[code], stream=stream)
    return dev, dev


def finish(kind: str, user_obj: Any, dev, code: str, stream=0):
    """Host kinds get a copy back in their own type; device kinds their object."""
    if kind == "numpy":
        return dev.copy_to_host(stream=stream).view(NP_DTYPE[code])
    if kind == "torch_cpu":
        import torch
        host = dev.copy_to_host(stream=stream)
        t = torch.from_numpy(np.ascontiguousarray(host).view(np.int16 if code != "f32" else np.float32))
        return t.view(torch.bfloat16) if code == "bf16" else (t.view(torch.float16) if code == "f16" else t)
    if kind == "numba" and code == "bf16" and user_obj is dev:
        return dev  # raw uint16 bits; view(NP_DTYPE) if V2 is wanted
    if kind == "numba" and code == "f16" and user_obj is dev:
        return dev.view(np.float16)
    return user_obj


def host_meta(name: str, x: Any) -> np.ndarray:
    """Host int32 copy of index metadata (validated by nbattn.layout)."""
    return as_int32(name, x)


def device_meta(x: Any, host: np.ndarray, stream=0):
    """Device int32 array: x in place when it already lives on the device."""
    kind = kind_of(x) if not isinstance(x, (list, tuple)) else "numpy"
    if kind == "torch":
        return cuda.as_cuda_array(x.detach())
    if kind in ("numba", "cai"):
        return x if kind == "numba" else cuda.as_cuda_array(x)
    return cuda.to_device(np.ascontiguousarray(host, dtype=np.int32), stream=stream)


def copy_into_host(dst: Any, src: np.ndarray) -> None:
    """Write a host result into a caller's host ``out=``/``lse=`` buffer."""
    if is_torch(dst):
        import torch
        if str(dst.dtype) == "torch.bfloat16":
            dst.view(torch.int16).copy_(torch.from_numpy(np.ascontiguousarray(src).view(np.int16)))
        else:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        dst[...] = src.view(dst.dtype) if src.dtype.itemsize == dst.dtype.itemsize else src


def output_for(name: str, given: Any, kind: str, shape: tuple, code: str, stream=0, like: Any = None,
               *, strided: bool = False):
    """(what the caller will get, raw device array to write) for a result that the
    caller may have preallocated (``given``: an ``out=``/``lse=`` argument or None).

    Device kinds write ``given`` in place; host kinds get a device scratch whose
    contents :func:`finish_into` copies back into ``given``."""
    if given is None:
        return new_output(kind, shape, code, stream, like=like)
    check_writeable(name, given)
    if is_device_kind(kind):
        return given, to_device(given, name, stream, code, strided=strided)
    return given, cuda.device_array(shape, RAW[code], stream=stream)


def check_writeable(name: str, x: Any) -> None:
    """Raise (naming ``name``) when ``x`` is a read-only NumPy array: a result is written into it."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise LayoutError(f"{name}: is read-only; the result is written into it")


def finish_into(kind: str, given: Any, user_obj: Any, dev, code: str, stream=0):
    """:func:`finish`, except that a caller's host buffer ``given`` receives the
    result (in its own type) and is returned."""
    if given is not None and not is_device_kind(kind):
        copy_into_host(given, dev.copy_to_host(stream=stream).view(NP_DTYPE[code]))
        return given
    return finish(kind, user_obj, dev, code, stream)


def finish_results(kind: str, code: str, stream, out: Any, out_user: Any, out_dev, lse: Any,
                   lse_user: Any, lse_dev, return_lse: bool):
    """``o`` (and ``lse`` with ``return_lse``) of a call that made its results with
    :func:`output_for`; a host ``lse=`` buffer is filled even when not returned."""
    o_res = finish_into(kind, out, out_user, out_dev, code, stream)
    if not (return_lse or lse is not None):
        return o_res
    l_res = finish_into(kind, lse, lse_user, lse_dev, "f32", stream)
    return (o_res, l_res) if return_lse else o_res
