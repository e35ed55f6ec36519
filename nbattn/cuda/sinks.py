"""Learnable attention sinks on the kernels: one more state, merged once.

``sinks [num_qo_heads]`` is one logit per query head that joins each row's
softmax normalizer and carries no value.  As in the golden model
(:mod:`nbattn.reference.sinks`), the sink is the attention state
``(o = 0, lse = sinks[h] * log2(e))`` and a row's result is its state merged
with it once, here by one merge kernel after the attention kernels
(:func:`nbattn.cuda.kernels.merge.sink_kernel`, which reads the logit of each
row's head):

    o   <- o * 2^lse / (2^lse + 2^lse_sink)
    lse <- log2(2^lse + 2^lse_sink)

A row that sees no key comes out as the sink (``o = 0``, ``lse = lse_sink``),
a NaN row stays NaN.  A split or cascaded computation merges its partial
states first and the sink last, so it equals the unsplit one.

:func:`with_sinks` gives an attention form of :mod:`nbattn.cuda` the
``sinks=`` keyword; the argument is checked (:func:`nbattn.reference.sinks.check_sinks`:
same rules, same messages) before any kernel runs.

What a call costs with torch CUDA tensors: a ``sinks`` CUDA tensor is read by
the kernel where it lies.  Its values are checked on the host (one copy, which
waits for the GPU) the first time this tensor object is seen, and again only
when torch counts a write to it (its version counter) or it moves; a write torch
does not count (through ``.data``, or by another library) is read by the
kernel but not checked again.  Host ``sinks`` are checked at every call and
uploaded once per distinct set of values.  The merge launch is bound once per
output shape (:class:`nbattn.cuda.host.driver.BoundLaunch`), so a run with
sinks can be captured in a CUDA graph after one run outside it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import numpy as np
from numba import cuda

from ..layout import LayoutError
from ..reference.sinks import check_sinks
from ..variants import Variant
from .host import arrays as A
from .host.driver import BoundLaunch, stream_handle
from .kernels.merge import pair_threads, sink_kernel

__all__ = ["with_sinks", "apply_sinks", "check_sinks", "checked_sinks"]

_MOST = 64               # entries kept by each cache below before it starts afresh
_SEEN: dict = {}         # id(tensor) -> (weak reference, stamp): CUDA sinks whose values passed
_UPLOADED: dict = {}     # (device index, float32 bytes) -> CUDA float32 tensor of host sinks
_BOUND: dict = {}        # (code, head_dim, states, heads, device index) -> BoundLaunch


def _num_qo_heads(q: Any) -> int:
    shape = tuple(getattr(q, "shape", ()))
    return int(shape[-2]) if len(shape) >= 2 else -1


def _keep(cache: dict, key, value):
    if len(cache) >= _MOST:
        cache.clear()
    cache[key] = value
    return value


def checked_sinks(sinks: Any, q: Any, variant: Variant, num_qo_heads: int | None = None):
    """``sinks`` checked for ``q [..., num_qo_heads, head_dim]`` (``num_qo_heads``:
    q's second-to-last extent unless given) by the golden model's rules.  With
    ``q`` and ``sinks`` both torch CUDA tensors, ``sinks`` comes back as itself
    (the kernel reads it; the module doc says when its values are checked again);
    otherwise as float64 NumPy logits.  None stays None."""
    if sinks is None:
        return None
    if num_qo_heads is None:
        num_qo_heads = _num_qo_heads(q)
    if not (A.kind_of(sinks) == "torch" and getattr(q, "is_cuda", False)):
        return check_sinks(sinks, num_qo_heads, variant)
    if sinks.device != q.device:
        raise LayoutError(f"sinks: must be on q's device {q.device}, got {sinks.device}")
    try:
        stamp = (sinks.data_ptr(), sinks._version, tuple(sinks.shape), sinks.dtype, num_qo_heads,
                 bool(variant.use_sigmoid))
    except RuntimeError:                        # an inference-mode tensor keeps no version: check every call
        check_sinks(sinks, num_qo_heads, variant)
        return sinks
    seen = _SEEN.get(id(sinks))
    if seen is not None and seen[0]() is sinks and seen[1] == stamp:
        return sinks
    check_sinks(sinks, num_qo_heads, variant)     # copies the values to the host once
    _keep(_SEEN, id(sinks), (weakref.ref(sinks), stamp))
    return sinks


def _device_logits(sinks, device):
    """Float32 logits on ``device`` for the kernel: a CUDA tensor as it is (or
    converted on the device), host logits uploaded once per value."""
    import torch
    if isinstance(sinks, torch.Tensor):
        return sinks if sinks.dtype == torch.float32 and sinks.is_contiguous() else \
            sinks.to(torch.float32).contiguous()
    host = np.ascontiguousarray(sinks, np.float32)
    key = (device.index, host.tobytes())
    hit = _UPLOADED.get(key)
    return hit if hit is not None else _keep(_UPLOADED, key, torch.from_numpy(host).to(device))


def apply_sinks(o, lse, sinks) -> None:
    """Merge the sink state into ``o [..., Hq, D]`` and ``lse [..., Hq]`` in place
    (``sinks``: what :func:`checked_sinks` returned)."""
    code = A.dtype_code(o, "out")
    heads, head_dim = int(o.shape[-2]), int(o.shape[-1])
    states = int(np.prod(tuple(lse.shape)))
    if states == 0:
        return
    kind = A.kind_of(o)
    if kind == "torch":        # the bound launch: pointers patched, nothing converted
        logits = _device_logits(sinks, o.device)
        key = (code, head_dim, states, heads, o.device.index)
        bl = _BOUND.get(key)
        if bl is None:
            args = (A.flat(A.to_device(o, "out", 0, code)), A.flat(A.to_device(lse, "lse", 0, "f32")),
                    A.flat(A.to_device(logits, "sinks", 0, "f32")), heads)
            bl = _keep(_BOUND, key, BoundLaunch(sink_kernel(code, head_dim), states, pair_threads(head_dim), args))
        bl.set(0, o)
        bl.set(1, lse)
        bl.set(2, logits)
        bl(stream_handle(o))
        return
    stream = A.launch_stream(o, lse)
    do, dl = A.to_device(o, "out", stream, code), A.to_device(lse, "lse", stream, "f32")
    ds = cuda.to_device(np.ascontiguousarray(sinks, np.float32), stream=stream)
    sink_kernel(code, head_dim)[states, pair_threads(head_dim), stream](A.flat(do), A.flat(dl), ds, heads)
    if not A.is_device_kind(kind):  # host arrays: write the result back into them
        A.copy_into_host(o, do.copy_to_host(stream=stream).view(A.NP_DTYPE[code]))
        A.copy_into_host(lse, dl.copy_to_host(stream=stream))


def with_sinks(fn: Callable) -> Callable:
    """``fn`` (an attention form whose first argument is q) with a ``sinks=`` keyword."""
    @functools.wraps(fn)
    def call(*args, sinks=None, **kwargs):
        if sinks is None:
            return fn(*args, **kwargs)
        q = args[0] if args else kwargs.get("q")
        checked = checked_sinks(sinks, q, Variant(use_sigmoid=bool(kwargs.get("use_sigmoid", False))))
        want_lse = bool(kwargs.get("return_lse", False))
        o, lse = fn(*args, **dict(kwargs, return_lse=True))
        apply_sinks(o, lse, checked)
        return (o, lse) if want_lse else o
    call.__doc__ = (fn.__doc__ or "") + (
        "\n\n    ``sinks [num_qo_heads]``: learnable sink logits, merged once into every row "
        "(:mod:`nbattn.cuda.sinks`).")
    return call
