"""``njit_cached``: NumPy-side compiled helpers with an on-disk cache that cannot go stale.

numba's ``njit(cache=True)`` checks a cached function against its own file only,
and compiles the functions it calls into its machine code.  Edit a callee in
another module (``nbattn.sched.lpt`` under ``nbattn.sched.plan``) and the caller's
cached code keeps running the old callee.  Here the cache's index key also
carries a digest of every ``.py`` file of the package, so any edit of the package
recompiles every cached helper once.  The CUDA kernels' cache uses the same
digest (:mod:`nbattn.cuda.host.driver`).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pathlib
import sys
import threading

from numba import njit
from numba.core.caching import FunctionCache

__all__ = ["njit_cached", "package_digest", "import_without_scipy"]

_PACKAGE = pathlib.Path(__file__).resolve().parent
_DIGEST: list = []


def package_digest() -> str:
    """sha256 over the package's ``.py`` files (paths and contents), computed once."""
    if not _DIGEST:
        h = hashlib.sha256()
        for path in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


class _NoScipy:
    """An import finder under which, in the thread that set ``on``, SciPy's modules
    not yet imported are missing (:func:`import_without_scipy`)."""

    def __init__(self):
        self.local = threading.local()

    def find_spec(self, name, path=None, target=None):
        if getattr(self.local, "on", False) and (name == "scipy" or name.startswith("scipy.")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def import_without_scipy(module: str) -> None:
    """Import numba's ``arraymath`` module (``numba.np.arraymath``, or numba-cuda's
    ``numba.cuda.np.arraymath``) as if SciPy were not installed.

    A target loads that module on its first compiled call.  At import it tries
    ``scipy.linalg.cython_blas`` only to set ``_HAVE_BLAS``, a flag that
    ``np.convolve`` / ``np.correlate`` read, and importing ``scipy.linalg`` takes
    0.3-0.4 s: most of a first call in a new process where SciPy is installed.
    The flag is then set to whether SciPy can be imported, as the import would
    have found; numba's linear algebra imports SciPy itself when it is compiled.
    Any failure leaves the import to numba."""
    if module in sys.modules or "scipy.linalg.cython_blas" in sys.modules:
        return
    finder = _NoScipy()
    sys.meta_path.insert(0, finder)
    finder.local.on = True
    try:
        mod = importlib.import_module(module)
    except Exception:  # pragma: no cover - numba moved the module
        return
    finally:
        finder.local.on = False
        sys.meta_path.remove(finder)
    mod._HAVE_BLAS = importlib.util.find_spec("scipy") is not None


class _PackageCache(FunctionCache):
    """numba's function cache, its index key extended by :func:`package_digest`;
    the CPU target's first load skips SciPy (:func:`import_without_scipy`)."""

    def load_overload(self, sig, target_context):
        import_without_scipy("numba.np.arraymath")
        return super().load_overload(sig, target_context)

    def _index_key(self, sig, codegen):
        return super()._index_key(sig, codegen) + (("nbattn", package_digest()),)


def njit_cached(fn):
    """``numba.njit(cache=True)(fn)``, the cache keyed by the package's source (module doc)."""
    dispatcher = njit(cache=True)(fn)
    dispatcher._cache = _PackageCache(dispatcher.py_func)
    return dispatcher
