"""The one place where nbattn touches numba-cuda beyond its documented API.

numba-cuda is in maintenance mode upstream; keeping private-API use here means
one file to fix when it moves.

    jit_kernel(fn, **kw)  cuda.jit(fn, **kw) with an on-disk cache on the GPU whose
                          key survives a new process (see below)
    stable_key(fn)        that key: a digest of all the compiled kernel depends on,
                          or None when some of it has no process-independent description
    sm_count(), compute_capability()   of the current device (4 / None in the simulator)

Why a key of our own
--------------------
numba's cache indexes a kernel by its bytecode and the *pickled* cells of its
closure.  nbattn's kernels come from factories whose closures hold other
device functions (numba dispatchers), and a dispatcher pickles with an id drawn
per process, so the index never matched in a new process: every process
recompiled, and a second process's first call cost as much as the first's.
:func:`stable_key` describes a closure by value instead -- numbers, strings,
tuples, dataclasses field by field, functions (and the Python functions behind
dispatchers and intrinsics) by module, name, bytecode, constants, their own
closures and the globals they load (numba compiles a global's value into the
kernel; the source-built micro-kernels reach every helper, the variant's
``score_mod`` included, only this way), recursively -- and adds a digest of nbattn's own source files, so any
edit to the package invalidates every entry (numba itself only watches the file
that defines the kernel).  Anything else (an arbitrary object a user function
closes over) makes the key None and the kernel compiles in memory as before.
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import hashlib
import logging
import struct
import types

import numpy as np
from numba import cuda

from ...variants import code_names
from ..._jit import import_without_scipy, package_digest
from ..blocks.primitives import SIMULATOR

log = logging.getLogger("nbattn")

__all__ = ["jit_kernel", "stable_key", "sm_count", "compute_capability", "BoundLaunch", "launch", "launch_programmatic",
           "data_ptr", "stream_handle", "torch_stream", "handle_of", "libcuda"]


class _Unstable(Exception):
    pass


def _describe_code(code, seen: set, live: bool) -> str:
    consts = ",".join(_describe_code(c, seen, live) if isinstance(c, types.CodeType) else _describe(c, seen, live)
                      for c in code.co_consts)
    return f"{hashlib.sha256(code.co_code).hexdigest()}:{','.join(code.co_names)}:[{consts}]"


def _describe(obj, seen: set, live: bool = False) -> str:
    """A text that changes when ``obj`` would compile differently.  ``live``: a device
    array (``__cuda_array_interface__``) is described by its address, shape and type,
    since compiled code reads it in place; otherwise it has no stable description."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, complex, np.generic, np.dtype)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, enum.Enum):
        return f"enum:{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, (tuple, list, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, frozenset) else obj
        return f"{type(obj).__name__}(" + ",".join(_describe(x, seen, live) for x in items) + ")"
    if isinstance(obj, np.ndarray):
        return f"ndarray:{obj.dtype}:{obj.shape}:{hashlib.sha256(obj.tobytes()).hexdigest()}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={_describe(getattr(obj, f.name), seen, live)}"
                          for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({fields})"
    inner = getattr(obj, "py_func", None) or getattr(obj, "_defn", None)   # dispatcher / intrinsic
    if inner is not None and inner is not obj:
        return f"{type(obj).__name__}[{_describe(inner, seen, live)}]"
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, struct.Struct):
        return f"struct:{obj.format}"
    code = getattr(obj, "__code__", None)
    if code is not None:
        if id(obj) in seen:           # recursion through closures
            return f"fn-cycle:{obj.__qualname__}"
        seen.add(id(obj))
        cells = ",".join(_describe(c.cell_contents, seen, live) for c in (obj.__closure__ or ()))
        # numba freezes a function's globals into the code it compiles, so they are part of
        # what the kernel computes: a function built by exec() reaches its helpers this way
        glob = getattr(obj, "__globals__", {})
        used = sorted(n for n in code_names(code) if n in glob)
        globs = ",".join(f"{n}={_describe(glob[n], seen, live)}" for n in used)
        return (f"fn:{obj.__module__}.{obj.__qualname__}:{_describe_code(code, seen, live)}"
                f":[{cells}]:[{globs}]")
    cai = None if isinstance(obj, type) else getattr(obj, "__cuda_array_interface__", None)
    if cai is not None or (SIMULATOR and hasattr(obj, "copy_to_host") and not isinstance(obj, type)):
        if not live:
            raise _Unstable(f"device array {type(obj).__qualname__}")
        if cai is None:                # a simulator device array: its identity is its address
            return f"device:sim:{id(obj)}:{tuple(obj.shape)}:{obj.dtype}"
        return (f"device:{cai['data'][0]}:{tuple(cai['shape'])}:{cai['typestr']}:"
                f"{tuple(cai.get('strides') or ())}")
    if type(obj).__module__.startswith("llvmlite"):
        # inline PTX (llvmlite.ir.InlineAsm) and IR types: their text is their meaning
        text = f"{obj}|{getattr(obj, 'type', '')}|{getattr(obj, 'asm', '')}|{getattr(obj, 'constraint', '')}"
        if " at 0x" in text:
            raise _Unstable(text)
        return f"{type(obj).__qualname__}:{text}"
    if isinstance(obj, type) or type(obj).__module__.startswith("numba"):
        # numba types (float32, int64, ...) and classes: their repr is their identity
        text = repr(obj)
        if " at 0x" in text:
            raise _Unstable(text)
        return f"{type(obj).__qualname__}:{text}"
    raise _Unstable(f"{type(obj).__qualname__}")


def stable_key(fn) -> str | None:
    """Process-independent digest of a kernel function and its closure, or None."""
    try:
        text = _describe(fn, set())
    except _Unstable as exc:
        log.info("nbattn: %s compiles without the on-disk cache (closure holds %s)", fn.__name__, exc)
        return None
    return hashlib.sha256((package_digest() + text).encode()).hexdigest()


def frozen_state(fn) -> str | None:
    """A digest of what numba freezes into code compiled from ``fn``: its code, its
    closure cells and the globals it names (NumPy arrays by content, device arrays by
    address: compiled code reads those in place); None when one of them has no
    stable description."""
    try:
        return hashlib.sha256(_describe(fn, set(), live=True).encode()).hexdigest()
    except _Unstable:
        return None


def _keyed_cache(py_func, key: str):
    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class KeyedCache(CUDACache):
        """numba's CUDA cache keyed by :func:`stable_key`, not the pickled closure (never equal across processes)."""

        def load_overload(self, sig, target_context):       # the target's first load skips SciPy (returns None)
            return import_without_scipy("numba.cuda.np.arraymath") or super().load_overload(sig, target_context)

        def _index_key(self, sig, codegen):
            k = (sig, codegen.magic_tuple(), numba_cuda.__version__, ("nbattn", key))
            if self._launch_config_key is not None:
                k += (("launch_config", self._launch_config_key),)
            return k

    return KeyedCache(py_func)


def cache_key(fn, **kw) -> str | None:
    """:func:`stable_key` of ``fn`` with the ``cuda.jit`` options folded in: launch
    bounds change the machine code but are not in the function's closure."""
    key = stable_key(fn)
    if key is None or not kw:
        return key
    return hashlib.sha256((key + repr(sorted(kw.items()))).encode()).hexdigest()


def jit_kernel(fn, **kw):
    """``cuda.jit(fn, **kw)``; on the GPU with the on-disk cache keyed by :func:`stable_key`."""
    if SIMULATOR:
        return cuda.jit(fn)
    dispatcher = cuda.jit(fn, **kw)
    key = cache_key(fn, **kw)
    if key is not None:
        try:
            dispatcher._cache = _keyed_cache(dispatcher.py_func, key)
        except Exception as exc:  # pragma: no cover - numba-cuda internals moved
            log.info("nbattn: on-disk cache unavailable (%s)", exc)
    return dispatcher


# ---------------------------------------------------------------------------
# The launch layer: a kernel bound once, launched many times
# ---------------------------------------------------------------------------

def _dim3(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(int(x) for x in d)
    return (d + (1, 1, 1))[:3]


def data_ptr(x) -> int:
    """Device address of a torch CUDA tensor or a CUDA-array-interface object."""
    f = getattr(x, "data_ptr", None)
    if f is not None:
        return f()
    return x.__cuda_array_interface__["data"][0]


def stream_handle(*arrays) -> int:
    """The stream a call runs on, as a driver handle: torch's current stream of the
    first torch CUDA tensor among ``arrays``, else 0 (the default stream)."""
    for a in arrays:
        if a is not None and getattr(a, "is_cuda", False):
            return torch_stream(a.device.index)
    return 0


def torch_stream(index: int) -> int:
    """torch's current stream on device ``index``, as a driver handle."""
    if _RAW_STREAM:
        return _RAW_STREAM[0](index)
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(index).cuda_stream
    _RAW_STREAM.append(raw)
    return raw(index)


_RAW_STREAM: list = []


class _Libcuda:
    """``cuLaunchKernelEx`` (and the copies and events the staging uses) of the driver
    library through ctypes: a launch is one foreign call with a prebuilt config and
    argument buffer."""

    class Attr(ctypes.Structure):              # CUlaunchAttribute: id, padding, a 64-byte union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

    class Config(ctypes.Structure):            # CUlaunchConfig
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]

    PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u = ctypes.c_void_p, ctypes.c_uint
        self.launch_ex = lib.cuLaunchKernelEx
        self.launch_ex.argtypes = [vp, vp, vp, vp]
        self.launch_ex.restype = ctypes.c_int
        self.memcpy_htod_async = lib.cuMemcpyHtoDAsync_v2
        self.memcpy_htod_async.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t, vp]
        self.memcpy_htod_async.restype = ctypes.c_int
        self.event_create = lib.cuEventCreate
        self.event_create.argtypes = [vp, u]
        self.event_record = lib.cuEventRecord
        self.event_record.argtypes = [vp, vp]
        self.event_sync = lib.cuEventSynchronize
        self.event_sync.argtypes = [vp]
        self.event_query = lib.cuEventQuery
        self.event_query.argtypes = [vp]
        self.event_query.restype = ctypes.c_int
        self.occupancy = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
        self.occupancy.argtypes = [ctypes.POINTER(ctypes.c_int), vp, ctypes.c_int, ctypes.c_size_t]
        self.occupancy.restype = ctypes.c_int


_LIBCUDA: _Libcuda | None = None


def libcuda() -> _Libcuda:
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = _Libcuda()
    return _LIBCUDA


def _opt_in_shared(compiled, smem: int) -> None:
    """Past 48 KB of dynamic shared memory a launch fails unless the function's
    ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` attribute was raised first (numba does not)."""
    if smem <= 48 * 1024 or getattr(compiled, "_nbattn_smem", 0) >= smem:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    cufunc = compiled._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)
    compiled._nbattn_smem = smem


class BoundLaunch:
    """One kernel compiled and bound once to its grid, block, dynamic shared memory
    and argument list; a call patches what changes and launches.

    ``BoundLaunch(kernel, grid, threads, args)`` compiles ``kernel`` for ``args``
    (numba's own typing, once) and packs them as the driver reads them: every
    argument flattened (an array is its meminfo, parent, size, itemsize, data
    pointer, shape and strides) into values behind one ``void*[]``.  Per call,
    ``set(i, x)`` replaces array argument ``i``'s data pointer with ``x``'s (a
    torch CUDA tensor or any ``__cuda_array_interface__`` object of the same
    shape), ``set_scalar(i, v)`` a scalar, and ``bl(stream)`` launches on a
    driver stream handle (:func:`stream_handle`) -- programmatically when the
    kernel is marked ``programmatic`` (it waits for its predecessor with
    ``griddepcontrol.wait``) or ``programmatic=True`` is passed.

    In the simulator the same interface keeps numba's ordinary launch: ``set``
    converts its argument with the ``convert[i]`` function given at binding
    (the raw-typed device view the kernel reads) and the call launches
    ``kernel[grid, threads](*args)``."""

    def __init__(self, kernel, grid, threads, args, *, programmatic: bool | None = None,
                 convert: dict | None = None):
        self.kernel = kernel
        self.grid, self.threads = grid, threads
        self.smem = int(getattr(kernel, "dynamic_smem", 0))
        self.programmatic = bool(getattr(kernel, "programmatic", False) if programmatic is None
                                 else programmatic)
        self._convert = convert or {}
        self._args = list(args)
        if SIMULATOR:
            return
        from numba.core import types

        compiled = kernel._compile_for_args(*args)
        _opt_in_shared(compiled, self.smem)
        self._fn = int(compiled._codelibrary.get_cufunc().handle)
        cells, self._data, self._sizes, self._scalar = [], {}, {}, {}
        for i, (ty, val) in enumerate(zip(compiled.argument_types, args)):
            flat: list = []
            compiled._prepare_args(ty, val, 0, [], flat)
            first = len(cells)
            cells += [x if isinstance(x, ctypes._SimpleCData) else ctypes.c_int64(int(x)) for x in flat]
            if isinstance(ty, types.Array):
                self._data[i] = cells[first + 4]
                self._sizes[i] = (cells[first + 2], cells[first + 5])     # nitems, shape[0]
            else:
                self._scalar[i] = cells[first]
        self._cells = cells                      # keeps the values alive behind the pointers
        self._params = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
        self._params_addr = ctypes.addressof(self._params)
        g, b = _dim3(grid), _dim3(threads)
        self._lib = libcuda()
        # Every launch is cuLaunchKernelEx over this one config (grid, block, shared memory,
        # stream, attributes): a call patches the stream and passes four pointers.
        self._attr = _Libcuda.Attr(id=_Libcuda.PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value[0] = 1
        self._cfg = _Libcuda.Config(*g, *b, self.smem, None, ctypes.addressof(self._attr) if self.programmatic
                                    else None, 1 if self.programmatic else 0)
        self._cfg_addr = ctypes.addressof(self._cfg)

    def set(self, i: int, x, size: int | None = None, rows: int | None = None) -> None:
        """Array argument ``i`` now reads ``x``'s memory (``x`` an array or, on a GPU,
        a device address as an int; same element type and layout; it may take another ``size`` in elements, and an argument of more
        than one dimension another number of ``rows``, its first extent)."""
        if SIMULATOR:
            conv = self._convert.get(i)
            self._args[i] = conv(x) if conv is not None else x
            return
        self._data[i].value = x if type(x) is int else data_ptr(x)      # an int is an address
        if size is not None:
            nitems, dim0 = self._sizes[i]
            nitems.value = size
            dim0.value = size if rows is None else rows

    def set_grid(self, grid) -> None:
        """Launch over another grid from now on."""
        self.grid = grid
        if not SIMULATOR:
            self._cfg.gridDimX, self._cfg.gridDimY, self._cfg.gridDimZ = _dim3(grid)

    def set_scalar(self, i: int, value) -> None:
        if SIMULATOR:
            self._args[i] = value
        else:
            self._scalar[i].value = value

    def resident_per_sm(self) -> int | None:
        """CTAs of this launch one SM holds at once (the driver's occupancy answer for
        its block and dynamic shared memory); None in the simulator."""
        if SIMULATOR:
            return None
        n = ctypes.c_int(0)
        err = self._lib.occupancy(ctypes.byref(n), self._fn, int(np.prod(_dim3(self.threads))), self.smem)
        if err:
            raise RuntimeError(f"nbattn: cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {err}")
        return int(n.value)

    def __call__(self, stream: int = 0) -> None:
        if SIMULATOR:
            self.kernel[self.grid, self.threads, 0, self.smem](*self._args)
            return
        self._cfg.hStream = stream
        err = self._lib.launch_ex(self._cfg_addr, self._fn, self._params_addr, None)
        if err:
            raise RuntimeError(f"nbattn: cuLaunchKernelEx of {getattr(self.kernel, '__name__', self.kernel)} "
                               f"failed with CUDA error {err}")


def launch_programmatic(dispatcher, griddim, blockdim, stream, args) -> bool:
    """Launch ``dispatcher[griddim, blockdim, stream](*args)`` with programmatic stream
    serialization (sm_90 programmatic dependent launch): the kernel may start while the
    stream's previous kernel runs, and must call :func:`nbattn.cuda.blocks.mma.grid_dependency_wait`
    before it reads anything that kernel writes.  Returns False, having launched nothing,
    in the simulator (the caller then launches plainly)."""
    if SIMULATOR:
        return False
    BoundLaunch(dispatcher, griddim, blockdim, args, programmatic=True)(handle_of(stream))
    return True


def handle_of(stream) -> int:
    """A numba stream (or 0) as a driver handle."""
    if isinstance(stream, int):
        return stream
    h = getattr(stream, "handle", 0)
    return int(getattr(h, "value", h) or 0)


def launch(kernel, grid, threads, stream, args) -> None:
    """``kernel[grid, threads, stream, smem](*args)`` with ``smem`` the kernel's
    ``dynamic_smem`` attribute (bytes of dynamic shared memory; 0 when absent),
    opted in past 48 KB; a kernel marked ``programmatic`` (the one-round merge)
    is launched programmatically (see :class:`BoundLaunch`)."""
    smem = int(getattr(kernel, "dynamic_smem", 0))
    if getattr(kernel, "programmatic", False) and launch_programmatic(kernel, grid, threads, stream, args):
        return
    if smem > 48 * 1024 and not SIMULATOR:
        _opt_in_shared(kernel._compile_for_args(*args), smem)
    kernel[grid, threads, stream, smem](*args)


_SM_COUNT: list = []
_CC: list = []


def sm_count() -> int:
    """Multiprocessors of the GPU, asked once (the kernels' heuristics assume one kind
    of GPU per process); 4 in the simulator."""
    if not _SM_COUNT:
        _SM_COUNT.append(4 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SM_COUNT[0]


def compute_capability() -> tuple | None:
    """``(major, minor)`` of the GPU, asked once; None in the simulator."""
    if not _CC:
        _CC.append(None if SIMULATOR else tuple(cuda.get_current_device().compute_capability))
    return _CC[0]
