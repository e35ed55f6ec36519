"""The one place where nbattn touches numba-cuda beyond its documented API.

numba-cuda is in maintenance mode upstream; keeping private-API use here means
one file to fix when it moves.

    jit_kernel(fn)      cuda.jit(fn), with cache=True on the GPU when numba can
                        hash the closure (its on-disk cache key pickles the
                        closure cells; a factory-made kernel whose cells do not
                        pickle compiles in memory instead of failing)
    sm_count()          multiprocessors of the current device (4 under the simulator)
"""
from __future__ import annotations

import logging

from numba import cuda

from .primitives import SIMULATOR

log = logging.getLogger("nbattn")

__all__ = ["jit_kernel", "sm_count"]


def _closure_hashable(fn) -> bool:
    if fn.__closure__ is None:
        return True
    try:
        from numba.cuda.serialize import dumps  # what numba's cache index key uses
        dumps(tuple(c.cell_contents for c in fn.__closure__))
        return True
    except Exception as exc:  # pragma: no cover - depends on user closures
        log.info("nbattn: %s compiles without the on-disk cache (%s)", fn.__name__, exc)
        return False


def jit_kernel(fn):
    if SIMULATOR:
        return cuda.jit(fn)
    return cuda.jit(fn, cache=_closure_hashable(fn))


def sm_count() -> int:
    if SIMULATOR:
        return 4
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
