"""Start-up decisions that must happen before anything imports ``numba.cuda``.

Two jobs, both run once when :mod:`nbattn` is imported:

1. numba-cuda 0.30 registers an overload for ``np.row_stack``, a name numpy 2.5
   removed; the first kernel compile then dies with an AttributeError.  We alias
   the missing name to ``np.vstack`` (its documented equivalent) when absent.
2. Pick numba's CUDA simulator when no GPU is usable, unless the user already set
   ``NUMBA_ENABLE_CUDASIM`` themselves.  The choice is logged once, when the
   kernels (:mod:`nbattn.cuda`) are first imported: ``nbattn --help``, the
   golden model and the figures never run a kernel and stay quiet.

GPU detection goes through the driver library with ctypes, so that deciding does
not import ``numba.cuda`` (whose config is frozen at its first import).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

import numpy as np

log = logging.getLogger("nbattn")

_ENV = "NUMBA_ENABLE_CUDASIM"


def ensure_row_stack() -> bool:
    """Alias ``np.row_stack`` to ``np.vstack`` when numpy no longer has it.

    Returns True when the alias was installed by this call.
    """
    if "row_stack" in np.__dict__:
        return False
    np.row_stack = np.vstack  # type: ignore[attr-defined]
    return True


def driver_gpu_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except AttributeError:
            return 0
    return 0


def choose_backend() -> str:
    """Set ``NUMBA_ENABLE_CUDASIM`` when no GPU is present; return 'gpu' or 'simulator'."""
    user = os.environ.get(_ENV)
    if user is not None:
        return "simulator" if user not in ("", "0") else "gpu"
    if "numba.cuda" in sys.modules:
        # Too late to switch: numba.cuda already read its configuration.
        from numba.cuda.core import config  # type: ignore

        return "simulator" if config.ENABLE_CUDASIM else "gpu"
    if driver_gpu_count() > 0:
        return "gpu"
    os.environ[_ENV] = "1"
    # numba.core.config may already have read the environment (pytest imports
    # numba.core.errors for its warning filters); numba.cuda reads that config.
    core_config = sys.modules.get("numba.core.config")
    if core_config is not None:
        core_config.reload_config()
    _NoticeOnKernelImport.install()
    return "simulator"


SIMULATOR_NOTICE = ("nbattn: no CUDA GPU found; numba.cuda kernels run in the CUDA simulator "
                    f"(set {_ENV}=0 or =1 to choose yourself)")


class _NoticeOnKernelImport:
    """An import hook that logs :data:`SIMULATOR_NOTICE` when ``nbattn.cuda`` is
    first imported, then removes itself.  It finds nothing: the normal finders
    still load the module."""

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "nbattn.cuda":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            log.warning(SIMULATOR_NOTICE)
        return None


ensure_row_stack()
BACKEND = choose_backend()


def simulator_enabled() -> bool:
    return BACKEND == "simulator"
