"""One call for a differential test: the golden model and the kernels take the
same keywords and input kinds.

:func:`golden_entry` wraps a :mod:`nbattn.reference` function so that

- the kernels' keywords are accepted as documented no-ops: ``stream=``,
  ``tensor_cores=`` and ``kv_chunk=`` (how a kernel runs: nothing for NumPy to
  choose); ``out=`` and ``lse=`` receive a copy of the result, as the kernels
  write theirs, and are what is returned;
- torch tensors (bfloat16 included) are read, and torch in gives torch out:
  the results become CPU torch tensors of the golden model's ``dtype``
  (float32 unless asked), on the device of the first tensor argument.

:func:`kernel_entry` wraps a :mod:`nbattn.cuda` function so that the golden
model's ``dtype=`` keyword is accepted as a no-op (kernels accumulate in
float32 and return the inputs' element type).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from .layout import is_torch, to_numpy

__all__ = ["golden_entry", "kernel_entry", "KERNEL_ONLY", "GOLDEN_ONLY"]

KERNEL_ONLY = ("stream", "tensor_cores", "kv_chunk")
GOLDEN_ONLY = ("dtype",)


def _first_torch(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if is_torch(x):
            return x
        if isinstance(x, (list, tuple)):
            for y in x:
                if is_torch(y):
                    return y
    return None


def _to_torch(x: Any, like: Any):
    import torch
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(like.device)
    if isinstance(x, tuple):
        return type(x)(*(_to_torch(y, like) for y in x)) if hasattr(x, "_fields") else tuple(
            _to_torch(y, like) for y in x)
    return x


def _copy_into(name: str, given: Any, value: np.ndarray) -> Any:
    if is_torch(given):
        import torch
        given.copy_(torch.from_numpy(np.ascontiguousarray(value)).to(given.dtype))
        return given
    arr = given
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: must be a NumPy array or a torch tensor, got {type(given).__name__}")
    if not arr.flags.writeable:
        raise ValueError(f"{name}: is read-only; the result is written into it")
    if arr.shape != np.shape(value):
        raise ValueError(f"{name}: must have shape {np.shape(value)}, got {arr.shape}")
    arr[...] = value
    return arr


def _host(x: Any) -> np.ndarray:
    return to_numpy(x)


def golden_entry(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        for name in KERNEL_ONLY:
            kwargs.pop(name, None)
        out, lse = kwargs.pop("out", None), kwargs.pop("lse", None)
        for name, given in (("out", out), ("lse", lse)):
            if isinstance(given, np.ndarray) and not given.flags.writeable:
                raise ValueError(f"{name}: is read-only; the result is written into it")
        like = _first_torch(args, kwargs)
        want_lse = bool(kwargs.get("return_lse", False))
        if lse is not None:
            kwargs["return_lse"] = True
        res = fn(*args, **kwargs)
        if like is not None:
            res = _to_torch(res, like)
        if out is None and lse is None:
            return res
        o, l, rest = (res[0], res[1], tuple(res[2:])) if isinstance(res, tuple) else (res, None, ())
        if out is not None:
            o = _copy_into("out", out, _host(o))
        if lse is not None:
            l = _copy_into("lse", lse, _host(l))
        return (o, l) + rest if want_lse else ((o,) + rest if rest else o)
    call.__doc__ = (fn.__doc__ or "") + (
        "\n\n    Also takes the kernels' ``stream=``, ``tensor_cores=``, ``kv_chunk=`` (no-ops) and "
        "``out=``/``lse=``\n    (filled with the result); torch tensors in give torch tensors out "
        "(see :mod:`nbattn._diff`).")
    return call


def kernel_entry(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        for name in GOLDEN_ONLY:
            kwargs.pop(name, None)
        return fn(*args, **kwargs)
    call.__doc__ = (fn.__doc__ or "") + (
        "\n\n    Also takes the golden model's ``dtype=`` (a no-op: kernels accumulate in float32).")
    return call
