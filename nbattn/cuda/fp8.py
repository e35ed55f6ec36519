"""fp8 KV caches on the kernels: the argument rules, and the forms that refuse them.

What reads fp8 (docs/concepts/layouts.md, "fp8 KV caches"):

* :func:`nbattn.cuda.batch_decode_paged` and
  :class:`nbattn.cuda.BatchDecodeWithPagedKVCacheWrapper` (``plan(...,
  kv_data_type=torch.float8_e4m3fn)``, then ``run(..., k_scale=, v_scale=)``; the
  plan/run checks are :func:`plan_kv_code`, :func:`check_run_dtypes` and
  :func:`run_scales`) read a paged
  ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` cache with scalar
  ``k_scale`` / ``v_scale`` (None is 1.0) and ``q`` in float16, bfloat16 or
  float32.  The kernels see the cache as raw bytes and dequantize in registers
  (:mod:`nbattn.cuda.blocks.fp8`); ``k_scale`` joins ``sm_scale`` (a score is
  ``q . k * sm_scale * k_scale``) and ``v_scale`` multiplies the output once,
  when a work item writes its state (``o = v_scale * sum_j p_j v_j / l``; the
  merge of split states is linear in ``o``, so it commutes).
* the prefill forms (:func:`nbattn.cuda.batch_prefill_paged`,
  ``batch_prefill_ragged``, ``single_prefill``, ``single_decode``) and
  :class:`nbattn.cuda.BatchPrefillWithPagedKVCacheWrapper` widen the fp8 pages a
  call reads into a scratch cache of q's dtype, scales applied (:func:`widen`,
  :func:`launch_widen`), then run the 16-bit tiles;
* :func:`nbattn.cuda.append_paged_kv_cache` writes into an fp8 cache,
  quantizing on the host with the golden model's
  :func:`nbattn.reference.fp8.quantize`.

The checks are the golden model's (:mod:`nbattn.reference.fp8`), so the
messages are the same.  Every other form refuses fp8 K/V and the scales with
:class:`Fp8NotSupported` (a ``ValueError`` and a ``NotImplementedError``)
naming the argument, before anything is launched (:func:`refuse_fp8`).
"""
from __future__ import annotations

import functools
import inspect
import math
import threading
from typing import Any, Callable

import numpy as np

from .. import layout as L
from ..reference.fp8 import FP8_DTYPES, FP8_FORMS, check_kv_dtypes, check_scale, fp8_kind, kv_scales, reject_fp8
from .blocks.fp8 import FP8_CODES
from .blocks.primitives import SIMULATOR
from .host import arrays as A
from .host.driver import BoundLaunch, handle_of
from .host.staging import Span, StagingRing
from .host.prefill_launch import check_kind_match, numba_stream
from .kernels.fp8_widen import widen_kernel

__all__ = ["Fp8NotSupported", "FP8_READERS", "is_fp8", "fp8_data_type", "plan_kv_code",
           "check_run_dtypes", "run_scales", "refuse_fp8", "kv_fp8", "prefill_kv", "check_widened_range",
           "widen", "launch_widen", "page_values"]

FP8_READERS = ("nbattn.cuda.batch_decode_paged, single_decode, batch_prefill_paged, batch_prefill_ragged, "
               "single_prefill, BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper and "
               "append_paged_kv_cache")
_TORCH_FP8 = tuple(f"torch.{n}" for n in FP8_DTYPES)
_NAMES = {code: name for name, code in FP8_CODES.items()}
_PAGE_IDS = StagingRing(most=8)     # widen()'s page ids on their way to the device


class Fp8NotSupported(L.LayoutError, NotImplementedError):
    """An fp8 K/V argument (or a scale) given to a kernel form that does not read fp8."""


def is_fp8(x: Any) -> bool:
    """Whether ``x`` has an fp8 dtype (a cheap test on the dtype's name)."""
    return str(getattr(x, "dtype", "")).replace("torch.", "").startswith("float8")


def kv_fp8(q: Any, k_scale: Any, v_scale: Any, **kv: Any) -> tuple[str | None, float, float]:
    """``(kv_code, k_scale, v_scale)`` of a call with K/V ``kv`` (``paged_kv_cache=`` or
    ``k=, v=``): their fp8 kernel code (``"e4m3"`` / ``"e5m2"``) and the scales as
    floats, or ``(None, 1.0, 1.0)`` for K/V that are not fp8 (where a scale other than
    None is refused).  The golden model's rules and messages
    (:func:`nbattn.reference.fp8.check_kv_dtypes`, :func:`~nbattn.reference.fp8.kv_scales`)."""
    if is_fp8(q):
        reject_fp8("q", q)
    name, first = next(iter(kv.items()))
    if not any(is_fp8(x) for x in kv.values()):
        kv_scales(k_scale, v_scale, None, name, L.dtype_of(first))
        return None, 1.0, 1.0
    kind = check_kv_dtypes(q, **kv)
    ks, vs = kv_scales(k_scale, v_scale, kind, name, kind)
    A.dtype_code(q, "q")                                  # q: float16, bfloat16 or float32
    return FP8_CODES[kind], ks, vs


#: the largest finite value of each fp8 format and of each dtype K/V are widened to
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
WIDE_MAX = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}


def check_widened_range(fp8: str, code: str, k_scale: float, v_scale: float) -> None:
    """Widening multiplies every fp8 value by its scale in q's dtype (``code``): refuse a
    scale with which a finite fp8 value would overflow there, naming it."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if FP8_MAX[fp8] * s > WIDE_MAX[code]:
            raise L.LayoutError(
                f"{name}: the prefill forms widen fp8 K/V to q's dtype ({code}) with the scale applied, and "
                f"{FP8_MAX[fp8]:g} * {name} = {FP8_MAX[fp8] * s:g} exceeds its largest value "
                f"{WIDE_MAX[code]:g}; use q in bfloat16 or float32, or a smaller {name}")


def prefill_kv(q: Any, k_scale: Any, v_scale: Any, **kv: Any) -> tuple[str | None, float, float, str]:
    """A prefill form's K/V dtype rule: ``(fp8 code or None, k_scale, v_scale, kind)``,
    ``kind`` the element type the tiles run in -- the shared dtype of ``q`` and K/V, or
    q's for fp8 K/V, which :func:`widen` turns into it (its scales checked for range)."""
    fp8, ks, vs = kv_fp8(q, k_scale, v_scale, **kv)
    if fp8 is None:
        return None, ks, vs, check_kind_match(q=q, **kv)
    kind = A.dtype_code(q, "q")
    check_widened_range(fp8, kind, ks, vs)
    return fp8, ks, vs, kind


def widen(x: Any, name: str, fp8: str, code: str, k_scale: float, v_scale: float, stream, direct: bool,
          pages: np.ndarray | None = None) -> Any:
    """The device array of fp8 ``x`` widened to ``code`` (q's dtype) with the scales
    applied (:mod:`nbattn.cuda.kernels.fp8_widen`).  ``pages``: a paged cache's page
    ids; page ``j`` of the result is page ``pages[j]`` of ``x``, its K half times
    ``k_scale`` and its V half times ``v_scale``.  Without ``pages``, all of ``x``
    times ``k_scale``.  ``direct``: the result is a torch CUDA tensor of q's dtype on
    ``x``'s device (the prefill forms' torch path), else a raw-typed numba array."""
    A.check_contiguous(x, name)
    shape = tuple(int(n) for n in x.shape)
    paged = pages is not None
    per = page_values(shape, name, paged)
    pages = np.ascontiguousarray(pages, np.int32) if paged else np.zeros(1, np.int32)
    if paged:
        shape = (len(pages),) + shape[1:]
    s = numba_stream(stream)
    if direct:      # torch CUDA tensors as they are: the bound launch reads their addresses
        import torch
        result = dst = torch.empty(shape, dtype=getattr(torch, _TORCH_NAMES[code]), device=x.device)
        src = x
    else:
        src = A.to_device(x, name, stream, fp8)
        result, dst = A.new_output("numba", shape, code, s)
    if len(pages) and per:
        # the page ids go through a staging ring (one asynchronous copy, no allocation, no
        # wait for the kernels queued before), as the prefill forms' other metadata does
        h = handle_of(s)
        with _PAGE_IDS.lock:
            slot, (span,) = _PAGE_IDS.stage([pages], h)
            launch_widen(src, span, per, per // 2 if paged else per, fp8, code, k_scale, v_scale, dst, h)
            slot.done(h)
    return result


def page_values(shape: tuple, name: str, paged: bool) -> int:
    """Values of one page of a paged fp8 cache of ``shape`` (K then V), or of all of a
    contiguous K or V: a multiple of 4, so that pages start on a 32-bit word."""
    per = math.prod(shape[1:]) if paged else math.prod(shape)
    if per % 4:
        raise L.LayoutError(f"{name}: an fp8 {'page' if paged else 'tensor'} must hold a multiple of 4 "
                            f"values to be read as words, got {per}")
    return per


#: The widening launches, bound once per (fp8 code, output code); a call patches the rest.
_BOUND: dict = {}
_BOUND_LOCK = threading.Lock()
_TORCH_NAMES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


def _words(x) -> int:
    """32-bit words of a contiguous device array or torch tensor."""
    size = x.element_size() if hasattr(x, "element_size") else np.dtype(x.dtype).itemsize
    return math.prod(int(n) for n in x.shape) * size // 4


def launch_widen(src, pages, per: int, k_values: int, fp8: str, code: str, k_scale: float, v_scale: float,
                 dst, stream: int) -> None:
    """Launch the widening kernel on driver stream handle ``stream``: page ``j`` (``per``
    values) of ``dst`` (q's dtype ``code``) from page ``pages[j]`` of fp8 ``src``, its
    first ``k_values`` values times ``k_scale`` and the rest times ``v_scale``.  ``src``
    and ``dst``: contiguous torch CUDA tensors or device arrays; ``pages``: an int32
    device array or a staging :class:`~nbattn.cuda.host.staging.Span`.  The launch is
    bound once per dtype pair (:class:`~nbattn.cuda.host.driver.BoundLaunch`), so a call
    costs no numba dispatch; the grid covers ``len(pages)`` pages."""
    n_pages = int(pages.n if isinstance(pages, Span) else pages.shape[0])
    n = n_pages * per // 4
    threads = 32 if SIMULATOR else 256
    blocks = 1 if SIMULATOR else max(1, min(-(-n // threads), 65535))
    key = (fp8, code)
    bl = _BOUND.get(key)
    if bl is None:
        view = pages.view() if isinstance(pages, Span) else pages
        bl = _BOUND[key] = BoundLaunch(
            widen_kernel(fp8, code), blocks, threads,
            (A.words(A.to_device(src, "paged_kv_cache", 0, fp8)), view, np.int64(per // 4), np.int64(k_values),
             np.float32(k_scale), np.float32(v_scale), A.flat(A.to_device(dst, "out", 0, code))),
            convert={0: lambda x: A.words(A.to_device(x, "paged_kv_cache", 0, fp8)),
                     1: lambda x: x.view() if isinstance(x, Span) else x,
                     6: lambda x: A.flat(A.to_device(x, "out", 0, code))})
    with _BOUND_LOCK:                     # the patched launch is this call's until it is queued
        bl.set(0, src, _words(src))
        bl.set(1, pages, n_pages)
        bl.set(6, dst, _words(dst) * 4 // np.dtype(A.RAW[code]).itemsize)
        bl.set_scalar(2, np.int64(per // 4))
        bl.set_scalar(3, np.int64(k_values))
        bl.set_scalar(4, np.float32(k_scale))
        bl.set_scalar(5, np.float32(v_scale))
        bl.set_grid(blocks)
        bl(stream)


def fp8_data_type(kv_data_type: Any) -> str | None:
    """A plan()'s ``kv_data_type`` as an fp8 kernel code, None when it is not fp8
    (``torch.float8_e4m3fn`` or its name, with or without ``torch.``)."""
    if kv_data_type is None:
        return None
    text = str(kv_data_type).replace("torch.", "")
    if not text.startswith("float8"):
        return None
    if text not in FP8_CODES:
        raise L.LayoutError(f"kv_data_type: fp8 dtype {text} is not supported; use {' or '.join(_TORCH_FP8)}")
    return FP8_CODES[text]


def plan_kv_code(q_data_type: Any, kv_data_type: Any) -> str | None:
    """The decode wrapper's plan(): the fp8 kernel code of ``kv_data_type`` (None when
    it is not fp8); an fp8 ``q_data_type`` is refused (fp8 is for K/V only)."""
    if str(q_data_type).replace("torch.", "").startswith("float8"):
        raise L.LayoutError(f"q_data_type: fp8 queries are not supported (q stays float16, bfloat16 or "
                            f"float32; fp8 is for K/V), got {q_data_type}")
    return fp8_data_type(kv_data_type)


def check_run_dtypes(q: Any, cache: Any, code: str, fp8: str | None) -> str:
    """The decode wrapper's run() dtype checks where fp8 is involved (a plan of q type
    ``code`` with fp8 kernel code ``fp8``, or a plain plan, ``fp8=None``, given an fp8
    cache): returns the cache's kernel code (``fp8``), else raises naming the argument."""
    if is_fp8(q):
        reject_fp8("q", q)
    if A.dtype_code(q, "q") != code:
        raise L.LayoutError(f"q: dtype {L.dtype_of(q)} differs from plan()'s q_data_type ({code})")
    kind = fp8_kind("paged_kv_cache", cache)
    if fp8 is None:
        raise L.LayoutError(f"paged_kv_cache: dtype {kind} differs from plan()'s kv_data_type ({code}); plan "
                            f"with kv_data_type=torch.{kind} to read an fp8 cache")
    want = _NAMES[fp8]
    if kind != want:
        raise L.LayoutError(f"paged_kv_cache: dtype {L.dtype_of(cache)} differs from plan()'s kv_data_type "
                            f"({want}); give {want} data, or plan with kv_data_type=torch.{L.dtype_of(cache)}"
                            if kind else f"paged_kv_cache: must be a torch {want} tensor, as plan()'s "
                            f"kv_data_type says, got {L.dtype_of(cache)}")
    return fp8


def run_scales(fp8: str | None, cache: Any, k_scale: Any, v_scale: Any) -> tuple[float, float]:
    """The decode wrapper's run() scales as floats (None: 1.0), checked as the golden
    model checks them; after a plain plan (``fp8=None``) a scale is refused."""
    if fp8 is None:
        return kv_scales(k_scale, v_scale, None, "paged_kv_cache", L.dtype_of(cache))
    return check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)


def refuse_fp8(fn: Callable, form: str, names: tuple = ("k", "v", "paged_kv_cache")) -> Callable:
    """``fn`` (a kernel form that does not read fp8) refusing fp8 K/V (arguments
    ``names``) and ``k_scale`` / ``v_scale`` first, with :class:`Fp8NotSupported`."""
    sig = inspect.signature(fn)
    pos = [n for n in sig.parameters if n in names]
    golden = f", and so does nbattn.reference.{form}" if form in FP8_FORMS else ""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        for name in pos:
            x = bound.get(name)
            if x is not None and is_fp8(x):
                raise Fp8NotSupported(f"{name}: nbattn.cuda.{form} does not read fp8 K/V ({L.dtype_of(x)}); "
                                      f"of the kernels, {FP8_READERS} do{golden} "
                                      f"(docs/concepts/layouts.md, 'fp8 KV caches')")
        for name in ("k_scale", "v_scale"):
            if kwargs.get(name) is not None:
                raise Fp8NotSupported(f"{name}: nbattn.cuda.{form} does not read fp8 K/V, so it takes no "
                                      f"scale; {FP8_READERS} do")
        kwargs.pop("k_scale", None)
        kwargs.pop("v_scale", None)
        return fn(*args, **kwargs)
    return call
