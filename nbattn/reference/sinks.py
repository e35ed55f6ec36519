"""Learnable attention sinks (GPT-OSS; FlashInfer's ``sinks`` argument).

``sinks [num_qo_heads]`` holds one logit per query head.  It joins every
row's softmax normalizer but carries no value: head ``h`` computes

    o = sum_j e^(s_j) v_j / (e^(sinks[h]) + sum_j e^(s_j))

with ``s_j`` the final scores (after ``sm_scale``, ALiBi, the soft cap and
``score_mod``).  The sink logit is used as given: it is not scaled, capped or
masked.

The golden model defines it as one more attention state, merged once into the
row's final state with :func:`~nbattn.reference.merge_state`: the sink is the
state ``(o = 0, lse = sinks[h] * log2(e))``, the base-2 LSE of the single
logit ``sinks[h]``.  So ``o_final = o * (1 - w_sink)`` with
``w_sink = 2^lse_sink / (2^lse + 2^lse_sink)``, and the returned LSE includes
the sink.  A row that sees no key is the empty state ``(0, -inf)``; merged
with the sink it is the sink, ``o = 0`` and ``lse = sinks[h] * log2(e)``.  A
NaN row stays NaN (a merge of a NaN state is NaN).

The attention functions only take the argument; :func:`check_sinks` checks it
and :func:`apply_sinks` merges it (docs/concepts/sinks.md).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import layout as L
from ..variants import Variant
from .state import LN2, merge_state

__all__ = ["check_sinks", "sink_lse", "apply_sinks"]


def check_sinks(sinks: Any, num_qo_heads: int, variant: Variant) -> np.ndarray | None:
    """``sinks`` as float64 ``[num_qo_heads]`` logits, or None when not given.

    Rejected (a ValueError naming ``sinks``) with sigmoid attention, which has
    no normalizer to join; when not floating-point, not 1-D of length
    ``num_qo_heads``, or holding a NaN or an infinity.  Reads its input only.
    """
    if sinks is None:
        return None
    if variant.use_sigmoid:
        raise L.LayoutError("sinks: sigmoid attention has no softmax normalizer for a sink logit to "
                            "join; pass sinks=None with use_sigmoid=True")
    if L.dtype_of(sinks).startswith("float8"):
        raise L.LayoutError(f"sinks: fp8 ({L.dtype_of(sinks)}) is not read; give float16, bfloat16, "
                            f"float32 or float64 logits")
    arr = L.to_numpy(sinks)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:     # bf16 seen as raw 2 bytes
        arr = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif arr.dtype.kind != "f":
        raise L.LayoutError(f"sinks: must be a floating-point array (one logit per query head), "
                            f"got {arr.dtype}")
    if arr.shape != (num_qo_heads,):
        raise L.LayoutError(f"sinks: must have shape [num_qo_heads] = [{num_qo_heads}], "
                            f"got {tuple(arr.shape)}")
    bad = ~np.isfinite(arr)
    if bad.any():
        h = int(np.argmax(bad))
        raise L.LayoutError(f"sinks: must be finite, got {arr[h]} at head {h}")
    return arr.astype(np.float64)


def sink_lse(sinks: np.ndarray) -> np.ndarray:
    """The sink's base-2 LSE per head: ``sinks * log2(e)`` (float64)."""
    return np.asarray(sinks, np.float64) / LN2


def apply_sinks(o: np.ndarray, lse: np.ndarray, sinks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Merge the sink state ``(0, sinks[h] * log2(e))`` into every row of
    ``o [rows, Hq, D]``, ``lse [rows, Hq]`` (checked ``sinks``, see
    :func:`check_sinks`); ``sinks=None`` returns the arrays themselves."""
    if sinks is None:
        return o, lse
    s = np.broadcast_to(sink_lse(sinks).astype(lse.dtype), lse.shape)
    return merge_state(o, lse, np.zeros_like(o), s)
