"""The one place where nbattn touches numba-cuda beyond its documented API.

numba-cuda is in maintenance mode upstream; keeping private-API use here means
one file to fix when it moves.

    jit_kernel(fn, **kw)  cuda.jit(fn, **kw) with an on-disk cache on the GPU whose
                          key survives a new process (see below)
    stable_key(fn)        that key: a digest of everything the compiled kernel
                          depends on, or None when something in it has no
                          process-independent description
    sm_count()            multiprocessors of the current device (4 under the simulator)

Why a key of our own
--------------------
numba's cache indexes a kernel by its bytecode and the *pickled* cells of its
closure.  nbattn's kernels come from factories whose closures hold other
device functions (numba dispatchers), and a dispatcher pickles with an id drawn
per process, so the index never matched in a new process: every process
recompiled (measured on the H200: 2.64 s vs 3.18 s first call, i.e. no hit).
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

import dataclasses
import enum
import hashlib
import logging
import pathlib
import struct
import types

import numpy as np
from numba import cuda

from .primitives import SIMULATOR

log = logging.getLogger("nbattn")

__all__ = ["jit_kernel", "stable_key", "sm_count"]

_PACKAGE = pathlib.Path(__file__).resolve().parents[1]
_source_digest: str | None = None


class _Unstable(Exception):
    pass


def _package_digest() -> str:
    global _source_digest
    if _source_digest is None:
        h = hashlib.sha256()
        for path in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _source_digest = h.hexdigest()
    return _source_digest


def _names(code) -> set:
    """Global (and attribute) names a code object and the code nested in it load."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _describe_code(code, seen: set) -> str:
    consts = ",".join(_describe_code(c, seen) if isinstance(c, types.CodeType) else _describe(c, seen)
                      for c in code.co_consts)
    return f"{hashlib.sha256(code.co_code).hexdigest()}:{','.join(code.co_names)}:[{consts}]"


def _describe(obj, seen: set) -> str:
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, complex, np.generic, np.dtype)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, enum.Enum):
        return f"enum:{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, (tuple, list, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, frozenset) else obj
        return f"{type(obj).__name__}(" + ",".join(_describe(x, seen) for x in items) + ")"
    if isinstance(obj, np.ndarray):
        return f"ndarray:{obj.dtype}:{obj.shape}:{hashlib.sha256(obj.tobytes()).hexdigest()}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={_describe(getattr(obj, f.name), seen)}"
                          for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({fields})"
    inner = getattr(obj, "py_func", None) or getattr(obj, "_defn", None)   # dispatcher / intrinsic
    if inner is not None and inner is not obj:
        return f"{type(obj).__name__}[{_describe(inner, seen)}]"
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, struct.Struct):
        return f"struct:{obj.format}"
    code = getattr(obj, "__code__", None)
    if code is not None:
        if id(obj) in seen:           # recursion through closures
            return f"fn-cycle:{obj.__qualname__}"
        seen.add(id(obj))
        cells = ",".join(_describe(c.cell_contents, seen) for c in (obj.__closure__ or ()))
        # numba freezes a function's globals into the code it compiles, so they are part of
        # what the kernel computes: a function built by exec() reaches its helpers this way
        glob = getattr(obj, "__globals__", {})
        used = sorted(n for n in _names(code) if n in glob)
        globs = ",".join(f"{n}={_describe(glob[n], seen)}" for n in used)
        return (f"fn:{obj.__module__}.{obj.__qualname__}:{_describe_code(code, seen)}"
                f":[{cells}]:[{globs}]")
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
    return hashlib.sha256((_package_digest() + text).encode()).hexdigest()


def _keyed_cache(py_func, key: str):
    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class KeyedCache(CUDACache):
        """numba's CUDA cache with the closure part of the index key replaced by ours."""

        def _index_key(self, sig, codegen):
            # numba's own key minus the pickled closure (which never matches across processes)
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


def launch_programmatic(dispatcher, griddim, blockdim, stream, args) -> bool:
    """Launch ``dispatcher[griddim, blockdim, stream](*args)`` with programmatic stream
    serialization (sm_90 programmatic dependent launch): the kernel may start while the
    stream's previous kernel runs, and must call :func:`nbattn.cuda.mma.grid_dependency_wait`
    before it reads anything that kernel writes.  numba's launch has no such option, so
    this repeats its argument marshalling and launches through ``cuda.core`` with the
    attribute.  Returns False, having launched nothing, in the simulator or where this
    numba-cuda / cuda.core lacks a piece (the caller then launches plainly)."""
    if SIMULATOR:
        return False
    try:
        from cuda.core import LaunchConfig, launch

        cfg = dispatcher[griddim, blockdim, stream]
        kernel = dispatcher._compile_for_args(*args)
        cufunc = kernel._codelibrary.get_cufunc()
        retr, kernel_args = [], []
        for ty, val in zip(kernel.argument_types, args):
            kernel._prepare_args(ty, val, cfg.stream, retr, kernel_args)
        config = LaunchConfig(grid=cfg.griddim, block=cfg.blockdim, shmem_size=0,
                              programmatic_stream_serialization=True)
    except Exception as exc:  # noqa: BLE001  (numba/cuda.core internals moved: plain launch)
        log.info("nbattn: programmatic launch unavailable (%r)", exc)
        return False
    launch(cfg.stream, config, cufunc.kernel, *kernel_args)
    return True


def launch(kernel, grid, threads, stream, args) -> None:
    """``kernel[grid, threads, stream, smem](*args)`` with ``smem`` the kernel's
    ``dynamic_smem`` attribute (bytes of dynamic shared memory; 0 when absent).
    Past 48 KB a launch fails unless the function's ``MAX_DYNAMIC_SHARED_SIZE_BYTES``
    attribute was raised first; numba's launch does not do it, so this sets it
    once per compiled kernel, the way numba's own ``set_shared_memory_carveout``
    sets its attribute.  A kernel marked ``programmatic`` (it waits for its
    predecessor with ``griddepcontrol.wait``: the one-round merge) is launched by
    :func:`launch_programmatic`."""
    smem = int(getattr(kernel, "dynamic_smem", 0))
    if smem == 0 and getattr(kernel, "programmatic", False) and launch_programmatic(kernel, grid, threads,
                                                                                   stream, args):
        return
    if smem > 48 * 1024 and not SIMULATOR:
        compiled = kernel._compile_for_args(*args)
        if getattr(compiled, "_nbattn_smem", 0) < smem:
            from numba.cuda.cudadrv.driver import binding, driver

            cufunc = compiled._codelibrary.get_cufunc()
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, smem, cufunc.handle, cufunc.device.id)
            compiled._nbattn_smem = smem
    kernel[grid, threads, stream, smem](*args)


def sm_count() -> int:
    if SIMULATOR:
        return 4
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
