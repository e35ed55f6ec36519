"""Attention states and the merge operator (docs/concepts/state.md).

A state over a key set A is ``(o_A, lse_A)``: the normalized output and the
**base-2** log-sum-exp ``log2(sum_j exp(s_j))``.  The empty key set is
``(0, -inf)``.  Merging normalizes the two weights before combining vectors,
so outputs near float max do not overflow, and never produces NaN.

Shapes follow FlashInfer: ``v`` is ``[..., head_dim]`` and ``s`` is ``[...]``
(e.g. ``[rows, num_heads, head_dim]`` and ``[rows, num_heads]``);
:func:`merge_states` takes ``v: [rows, num_states, num_heads, head_dim]`` and
``s: [rows, num_states, num_heads]``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

LN2 = math.log(2.0)


class AttentionState(NamedTuple):
    o: np.ndarray    # [..., head_dim]
    lse: np.ndarray  # [...], base 2


def lse_natural_to_base2(lse: np.ndarray) -> np.ndarray:
    """A natural-log LSE (torch, most papers) in base 2: divide by ln 2 once."""
    return np.asarray(lse) / LN2


def lse_base2_to_natural(lse: np.ndarray) -> np.ndarray:
    return np.asarray(lse) * LN2


def merge_weights(s_a: np.ndarray, s_b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalized weights ``(w_a, w_b)`` and the merged LSE of two states.

    ``m = max(lse_a, lse_b); a = 2^(lse_a-m); b = 2^(lse_b-m)``; both empty
    (m = -inf) gives weights 0 and LSE -inf; a NaN LSE gives NaN weights and a
    NaN LSE (a merge of a NaN state is NaN).
    """
    s_a = np.asarray(s_a)
    s_b = np.asarray(s_b)
    w_a, w_b, lse = _weights(s_a.astype(np.float64), s_b.astype(np.float64))
    return w_a.astype(s_a.dtype), w_b.astype(s_a.dtype), lse.astype(s_a.dtype)


def _weights(s_a, s_b):
    nan = np.isnan(s_a) | np.isnan(s_b) | np.isposinf(s_a) | np.isposinf(s_b)   # +inf is no state either
    m = np.maximum(s_a, s_b)
    m_safe = np.where(np.isneginf(m) | nan, 0.0, m)
    a = np.exp2(np.where(nan, 0.0, s_a) - m_safe)
    b = np.exp2(np.where(nan, 0.0, s_b) - m_safe)
    total = a + b
    nz = total > 0
    inv = np.where(nz, 1.0 / np.where(nz, total, 1.0), 0.0)
    lse = np.where(nz, m_safe + np.log2(np.where(nz, total, 1.0)), -np.inf)
    return np.where(nan, np.nan, a * inv), np.where(nan, np.nan, b * inv), np.where(nan, np.nan, lse)


def _float_state(name: str, x) -> np.ndarray:
    """A state array as NumPy floats (torch tensors and bf16 read as float32)."""
    from ..layout import LayoutError, to_numpy
    arr = to_numpy(x) if not isinstance(x, np.ndarray) else x
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:     # bf16 seen as raw 2 bytes
        arr = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif arr.dtype.kind != "f":
        raise LayoutError(f"{name}: must be a floating-point array, got {arr.dtype}")
    return arr


def merge_state(v_a: np.ndarray, s_a: np.ndarray, v_b: np.ndarray,
                s_b: np.ndarray) -> AttentionState:
    """Merge the states of two disjoint key sets.

    Computed in float64 and rounded once to ``v_a``'s dtype (``s_a``'s for the
    LSE).  A NaN (or +inf) LSE makes the merged (row, head) NaN; a NaN element of an
    output reaches the same element of the result."""
    v_a, v_b = _float_state("v_a", v_a), _float_state("v_b", v_b)
    s_a, s_b = _float_state("s_a", s_a), _float_state("s_b", s_b)
    if v_a.dtype != v_b.dtype or s_a.dtype != s_b.dtype:
        raise ValueError(f"v_b: the two states must have the same dtypes, got v_a {v_a.dtype}, "
                         f"v_b {v_b.dtype}, s_a {s_a.dtype}, s_b {s_b.dtype}")
    if v_a.shape != v_b.shape or np.shape(s_a) != np.shape(s_b) or v_a.shape[:-1] != np.shape(s_a):
        raise ValueError(f"v_b: shapes must match, got v_a {v_a.shape}, s_a {np.shape(s_a)}, "
                         f"v_b {v_b.shape}, s_b {np.shape(s_b)}")
    w_a, w_b, lse = _weights(s_a.astype(np.float64), s_b.astype(np.float64))
    o = w_a[..., None] * v_a.astype(np.float64) + w_b[..., None] * v_b.astype(np.float64)
    return AttentionState(o.astype(v_a.dtype), lse.astype(s_a.dtype))


def merge_state_in_place(v: np.ndarray, s: np.ndarray, v_other: np.ndarray, s_other: np.ndarray,
                         mask: np.ndarray | None = None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place; rows where
    ``mask`` (bool ``[rows]``) is False are left unchanged."""
    for name, x in (("v", v), ("s", s)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: must be a NumPy array (it is written in place), got {type(x).__name__}")
        if not x.flags.writeable:
            raise ValueError(f"{name}: is read-only; merge_state_in_place writes the merged state into it")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != np.shape(s)[:1]:
            raise ValueError(f"mask: must be a bool array of shape [rows] = {np.shape(s)[:1]}, "
                             f"got {mask.dtype} {mask.shape}")
    o, lse = merge_state(v, s, v_other, s_other)
    if mask is None:
        v[...] = o
        s[...] = lse
    else:
        v[mask] = o[mask]
        s[mask] = lse[mask]


def merge_states(v: np.ndarray, s: np.ndarray) -> AttentionState:
    """Merge ``num_states`` states per row.

    ``v: [rows, num_states, num_heads, head_dim]``, ``s: [rows, num_states, num_heads]``.
    Accumulated in float64 and rounded once to ``v``'s dtype (the LSE to
    ``s``'s), so the result is the exact merge correctly rounded up to
    float64 error.  ``num_states = 0`` gives empty states ``(0, -inf)``.  A NaN
    LSE (or a +inf one) in any state makes the merged (row, head) NaN.
    """
    v, s = _float_state("v", v), _float_state("s", s)
    if v.ndim != 4 or s.shape != v.shape[:3]:
        raise ValueError(f"v: must be [rows, num_states, num_heads, head_dim] with s "
                         f"[rows, num_states, num_heads], got {v.shape} and {s.shape}")
    s64 = s.astype(np.float64)
    nan = (np.isnan(s64) | np.isposinf(s64)).any(axis=1)            # [rows, heads]; +inf is no state either
    s64 = np.where(np.isnan(s64) | np.isposinf(s64), -np.inf, s64)
    m = s64.max(axis=1, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    w = np.exp2(s64 - m_safe[:, None])                               # empty states: exactly 0
    total = w.sum(axis=1)
    nz = total > 0
    w = w * np.where(nz, 1.0 / np.where(nz, total, 1.0), 0.0)[:, None]
    o = np.einsum("rsh,rshd->rhd", w, v.astype(np.float64))
    lse = np.where(nz, m_safe + np.log2(np.where(nz, total, 1.0)), -np.inf)
    o[nan] = np.nan
    lse[nan] = np.nan
    return AttentionState(o.astype(v.dtype), lse.astype(s.dtype))
