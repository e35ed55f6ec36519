"""Performance model (docs/concepts/performance.md): GPU ceilings, roofline, result files.

Cheap to import (NumPy and the standard library only); plotting lives in
:mod:`nbattn.plots`.
"""
from . import gpus, results, roofline
from .gpus import A100_SXM_80GB, GPUS, H100_SXM, H200, GPUSpec, get_gpu, match_gpu, with_copy_bandwidth
from .results import Record, ResultFormatError, Suite, load_suite, write_suite
from .roofline import *  # noqa: F401,F403  (the model functions are the public API)

__all__ = [
    "gpus", "results", "roofline",
    "GPUSpec", "H200", "H100_SXM", "A100_SXM_80GB", "GPUS", "get_gpu", "match_gpu",
    "with_copy_bandwidth",
    "Record", "Suite", "ResultFormatError", "load_suite", "write_suite",
    *roofline.__all__,
]
