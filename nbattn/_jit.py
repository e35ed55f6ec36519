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
import pathlib

from numba import njit
from numba.core.caching import FunctionCache

__all__ = ["njit_cached", "package_digest"]

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


class _PackageCache(FunctionCache):
    """numba's function cache, its index key extended by :func:`package_digest`."""

    def _index_key(self, sig, codegen):
        return super()._index_key(sig, codegen) + (("nbattn", package_digest()),)


def njit_cached(fn):
    """``numba.njit(cache=True)(fn)``, the cache keyed by the package's source (module doc)."""
    dispatcher = njit(cache=True)(fn)
    dispatcher._cache = _PackageCache(dispatcher.py_func)
    return dispatcher
