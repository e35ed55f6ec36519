"""Learnable attention sinks on the kernels: one more state, merged once.

``sinks [num_qo_heads]`` is one logit per query head that joins each row's
softmax normalizer and carries no value.  As in the golden model
(:mod:`nbattn.reference.sinks`), the sink is the attention state
``(o = 0, lse = sinks[h] * log2(e))`` and a row's result is its state merged
with it once, here by the merge kernel (:func:`nbattn.cuda.merge_state_in_place`)
after the attention kernels:

    o   <- o * 2^lse / (2^lse + 2^lse_sink)
    lse <- log2(2^lse + 2^lse_sink)

A row that sees no key comes out as the sink (``o = 0``, ``lse = lse_sink``),
a NaN row stays NaN.  A split or cascaded computation merges its partial
states first and the sink last, so it equals the unsplit one.

:func:`with_sinks` gives an attention form of :mod:`nbattn.cuda` the
``sinks=`` keyword; the argument is checked (:func:`nbattn.reference.sinks.check_sinks`:
same rules, same messages) before any kernel runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ..reference.sinks import check_sinks, sink_lse
from ..variants import Variant
from .host import arrays as A
from .merge import merge_state_in_place

__all__ = ["with_sinks", "apply_sinks", "check_sinks"]


def _num_qo_heads(q: Any) -> int:
    shape = tuple(getattr(q, "shape", ()))
    return int(shape[-2]) if len(shape) >= 2 else -1


def apply_sinks(o, lse, sinks: np.ndarray) -> None:
    """Merge the sink state into ``o [..., Hq, D]`` and ``lse [..., Hq]`` in place
    (``sinks``: checked float64 logits, see :func:`check_sinks`)."""
    kind = A.kind_of(o)
    s = np.ascontiguousarray(np.broadcast_to(sink_lse(sinks).astype(np.float32), tuple(lse.shape)))
    if kind in ("torch", "torch_cpu"):
        import torch
        zeros = torch.zeros_like(o)
        s_other = torch.from_numpy(s).to(lse.device)
    elif A.is_device_kind(kind):
        from numba import cuda
        zeros = cuda.to_device(np.zeros(tuple(o.shape), np.dtype(o.dtype)))
        s_other = cuda.to_device(s)
    else:
        zeros, s_other = np.zeros_like(o), s
    merge_state_in_place(o, lse, zeros, s_other)


def with_sinks(fn: Callable) -> Callable:
    """``fn`` (an attention form whose first argument is q) with a ``sinks=`` keyword."""
    @functools.wraps(fn)
    def call(*args, sinks=None, **kwargs):
        if sinks is None:
            return fn(*args, **kwargs)
        q = args[0] if args else kwargs.get("q")
        checked = check_sinks(sinks, _num_qo_heads(q), Variant(use_sigmoid=bool(kwargs.get("use_sigmoid", False))))
        want_lse = bool(kwargs.get("return_lse", False))
        o, lse = fn(*args, **dict(kwargs, return_lse=True))
        apply_sinks(o, lse, checked)
        return (o, lse) if want_lse else o
    call.__doc__ = (fn.__doc__ or "") + (
        "\n\n    ``sinks [num_qo_heads]``: learnable sink logits, merged once into every row "
        "(:mod:`nbattn.cuda.sinks`).")
    return call
