"""fp8 KV caches in the golden model (FlashInfer's fp8 K/V with ``k_scale`` / ``v_scale``).

K and V may be stored as ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``
tensors (a paged cache, or contiguous ``k`` / ``v``), with one scalar scale
each: K is read as ``k.float() * k_scale`` and V as ``v.float() * v_scale``
(a scale of None means 1.0).  ``q`` keeps its own floating-point dtype.  The
golden model dequantizes exactly: every fp8 value is a float32 (and float64)
number, and the product with the scale is formed in float64.  The attention
is then computed in the function's ``dtype`` as for any other input.

NumPy has no fp8 dtype, so fp8 data must be a torch tensor; a NumPy array
whose dtype is named like fp8 (ml_dtypes) is rejected with a message that
says so.

Writing into an fp8 cache (:func:`~nbattn.reference.append_paged_kv_cache`)
quantizes with :func:`quantize`: ``x / scale`` rounded once to the nearest
fp8 value (ties to even), finite values saturating at the fp8 maximum
(docs/concepts/layouts.md, "fp8 KV caches").

The attention functions only take the arguments; the helpers here check them
and convert the data.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import layout as L

__all__ = ["FP8_DTYPES", "FP8_FORMS", "fp8_kind", "reject_fp8", "check_kv_dtypes", "check_no_fp8", "kv_scales",
           "check_scale", "dequantize", "dequantize_cache", "quantize"]

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
FP8_FORMS = ("single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged",
             "batch_decode_paged")
_TORCH_NAMES = " or ".join(f"torch.{n}" for n in FP8_DTYPES)


def fp8_kind(name: str, x: Any) -> str | None:
    """``'float8_e4m3fn'`` or ``'float8_e5m2'`` for a torch fp8 tensor, None for
    anything that is not fp8.  Other fp8 kinds (``float8_e4m3fnuz``...) and
    fp8 NumPy arrays (ml_dtypes) are rejected, naming ``name``."""
    dt = L.dtype_of(x)
    if not dt.startswith("float8"):
        return None
    if not L.is_torch(x):
        raise L.LayoutError(f"{name}: NumPy has no fp8 dtype; give fp8 data as a torch tensor "
                            f"({_TORCH_NAMES}), got a {type(x).__module__}.{type(x).__name__} of {dt}")
    if dt not in FP8_DTYPES:
        raise L.LayoutError(f"{name}: fp8 dtype {dt} is not supported; use {_TORCH_NAMES}")
    return dt


def check_no_fp8(form: str, **tensors: Any) -> None:
    """Forms that do not read fp8: reject an fp8 argument, naming it (and the forms that do)."""
    for name, x in tensors.items():
        if x is not None and L.dtype_of(x).startswith("float8"):
            raise L.LayoutError(f"{name}: {form} does not read fp8 ({L.dtype_of(x)}); fp8 K/V are read by "
                                f"{', '.join(FP8_FORMS)}")


def reject_fp8(name: str, x: Any) -> None:
    """An fp8 argument where none is read (``q``, or K/V of a form that does not read fp8)."""
    if name == "q":
        raise L.LayoutError(f"q: fp8 queries are not supported (q stays float16, bfloat16 or float32; "
                            f"fp8 is for K/V), got {L.dtype_of(x)}")
    raise L.LayoutError(f"{name}: fp8 ({L.dtype_of(x)}) is not read here; fp8 K/V are read by "
                        f"{', '.join(FP8_FORMS)}")


def check_kv_dtypes(q: Any, **kv: Any) -> str | None:
    """The dtype rule between ``q`` and K/V (``k=, v=`` or ``paged_kv_cache=``).

    Without fp8 it is :func:`nbattn.layout.check_same_dtype` (q, k and v share
    one dtype), unchanged.  With fp8 K/V, K and V must share one fp8 dtype and
    ``q`` may have any non-fp8 floating-point dtype.  Returns the fp8 dtype
    name, or None when nothing is fp8."""
    kinds = {name: fp8_kind(name, x) for name, x in (("q", q),) + tuple(kv.items())}
    if not any(kinds.values()):
        L.check_same_dtype(q=q, **kv)
        return None
    if kinds["q"]:
        reject_fp8("q", q)
    names = list(kv)
    listing = ", ".join(f"{n}={L.dtype_of(x)}" for n, x in kv.items())
    if len({kinds[n] for n in names}) > 1:
        raise L.LayoutError(f"{names[-1]}: K and V must share one fp8 dtype ({' or '.join(FP8_DTYPES)}), "
                            f"got {listing}")
    return kinds[names[0]]


def check_scale(name: str, x: Any) -> float:
    """A scale as a Python float: a real number (or a 0-d array or tensor),
    finite and > 0; None is 1.0."""
    if x is None:
        return 1.0
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_)):
        val = float(x)
    else:
        dt = L.dtype_of(x)
        if not hasattr(x, "shape") or tuple(x.shape) != () or dt.startswith("float8") or not (
                dt.startswith(("float", "bfloat", "int", "uint"))):
            got = (f"a {type(x).__name__} of dtype {dt} and shape {tuple(x.shape)}" if hasattr(x, "shape")
                   else repr(x))
            raise L.LayoutError(f"{name}: must be a float (or a 0-d array of one), got {got}")
        val = float(L.to_numpy(x))
    if not (math.isfinite(val) and val > 0):
        raise L.LayoutError(f"{name}: must be finite and > 0, got {val}")
    return val


def kv_scales(k_scale: Any, v_scale: Any, fp8: str | None, what: str, dtype: str) -> tuple[float, float]:
    """``(k_scale, v_scale)`` as floats (None is 1.0) for fp8 K/V; with K/V that
    are not fp8 (``fp8=None``) a scale other than None is rejected, naming it."""
    if fp8 is None:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise L.LayoutError(f"{name}: only fp8 K/V ({_TORCH_NAMES}) take a scale; {what} has dtype "
                                    f"{dtype}, so pass {name}=None")
        return 1.0, 1.0
    return check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)


def _host64(x: Any) -> np.ndarray:
    import torch
    return x.detach().to("cpu").to(torch.float64).numpy()      # exact: fp8 -> float64


def dequantize(x: Any, scale: float) -> np.ndarray:
    """A torch fp8 tensor as float64 NumPy: ``x.float() * scale`` (the product in float64)."""
    out = _host64(x)
    if scale != 1.0:
        out *= scale
    return out


def dequantize_cache(cache: Any, k_scale: float, v_scale: float) -> np.ndarray:
    """A paged fp8 cache ``[num_pages, 2, ...]`` as float64 NumPy: keys times
    ``k_scale``, values times ``v_scale``."""
    out = _host64(cache)
    if k_scale != 1.0:
        out[:, 0] *= k_scale
    if v_scale != 1.0:
        out[:, 1] *= v_scale
    return out


def _round_to_odd_f32(y: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounding to odd: truncate toward zero and set the last
    bit when inexact.  A second rounding of the result to a format of at most
    22 bits (fp8 has 4) is then the correct rounding of ``y`` itself."""
    t = y.astype(np.float32)
    back = t.astype(np.float64)
    inexact = np.isfinite(y) & (back != y)
    over = inexact & (np.abs(back) > np.abs(y))
    t = np.where(over, np.nextafter(t, np.float32(0)), t)
    return (t.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def quantize(x: np.ndarray, scale: float, dtype: str):
    """``x / scale`` as a CPU torch tensor of fp8 ``dtype`` (``'float8_e4m3fn'``
    or ``'float8_e5m2'``).

    The quotient is formed in float64 and rounded once to the nearest fp8 value,
    ties to even (torch's cast, fed a float32 value rounded to odd so that the
    two roundings make one).  A finite ``x`` stays finite: quotients beyond the
    fp8 maximum (448 for e4m3fn, 57344 for e5m2) saturate to it.  A NaN stays
    NaN; an infinity is an infinity in e5m2 and NaN in e4m3fn, which has no
    infinity (torch's plain cast gives +-448 or NaN there, by version).
    """
    import torch
    fp8 = getattr(torch, dtype)
    top = float(torch.finfo(fp8).max)
    x = np.asarray(x, np.float64)
    finite = np.isfinite(x)
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.where(finite, np.clip(x / scale, -top, top), x)
    if dtype == "float8_e4m3fn":
        y = np.where(np.isinf(x), np.nan, y)                  # no infinity to keep
    return torch.from_numpy(np.ascontiguousarray(_round_to_odd_f32(y))).to(fp8)
