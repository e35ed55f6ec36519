"""Attention states and the merge operator (SPEC section 3).

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
    (m = -inf) gives weights 0 and LSE -inf instead of NaN.
    """
    s_a = np.asarray(s_a)
    s_b = np.asarray(s_b)
    m = np.maximum(s_a, s_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)
    a = np.exp2(s_a - m_safe)
    b = np.exp2(s_b - m_safe)
    total = a + b
    nz = total > 0
    inv = np.where(nz, 1.0 / np.where(nz, total, 1.0), 0.0)
    lse = np.where(nz, m_safe + np.log2(np.where(nz, total, 1.0)), -np.inf)
    return (a * inv).astype(s_a.dtype), (b * inv).astype(s_a.dtype), lse.astype(s_a.dtype)


def merge_state(v_a: np.ndarray, s_a: np.ndarray, v_b: np.ndarray,
                s_b: np.ndarray) -> AttentionState:
    """Merge the states of two disjoint key sets (SPEC section 3)."""
    v_a, v_b = np.asarray(v_a), np.asarray(v_b)
    if v_a.shape != v_b.shape or np.shape(s_a) != np.shape(s_b) or v_a.shape[:-1] != np.shape(s_a):
        raise ValueError(f"v_b: shapes must match, got v_a {v_a.shape}, s_a {np.shape(s_a)}, "
                         f"v_b {v_b.shape}, s_b {np.shape(s_b)}")
    w_a, w_b, lse = merge_weights(s_a, s_b)
    o = w_a[..., None] * v_a + w_b[..., None] * v_b
    return AttentionState(o.astype(v_a.dtype), lse)


def merge_state_in_place(v: np.ndarray, s: np.ndarray, v_other: np.ndarray, s_other: np.ndarray,
                         mask: np.ndarray | None = None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place; rows where
    ``mask`` (bool ``[rows]``) is False are left unchanged."""
    o, lse = merge_state(v, s, v_other, s_other)
    if mask is None:
        v[...] = o
        s[...] = lse
    else:
        mask = np.asarray(mask, dtype=bool)
        v[mask] = o[mask]
        s[mask] = lse[mask]


def merge_states(v: np.ndarray, s: np.ndarray) -> AttentionState:
    """Merge ``num_states`` states per row, in the order of axis 1.

    ``v: [rows, num_states, num_heads, head_dim]``, ``s: [rows, num_states, num_heads]``.
    A left fold of :func:`merge_state`, so the reduction order is the array order.
    """
    v, s = np.asarray(v), np.asarray(s)
    if v.ndim != 4 or s.shape != v.shape[:3]:
        raise ValueError(f"v: must be [rows, num_states, num_heads, head_dim] with s "
                         f"[rows, num_states, num_heads], got {v.shape} and {s.shape}")
    o = np.zeros_like(v[:, 0])
    lse = np.full(s[:, 0].shape, -np.inf, dtype=s.dtype)
    for i in range(v.shape[1]):
        o, lse = merge_state(o, lse, v[:, i], s[:, i])
    return AttentionState(o, lse)
