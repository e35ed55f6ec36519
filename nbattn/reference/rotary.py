"""The rotation of rotary position embeddings, in float64 (docs/concepts/rope.md).

Used by the standalone functions (:mod:`nbattn.reference.rope`) and by
attention-time RoPE (``pos_encoding_mode="ROPE_LLAMA"`` in
:func:`nbattn.reference.attend`), so both turn vectors the same way.
"""
from __future__ import annotations

import numpy as np

__all__ = ["inv_freq", "rotate", "rope_angles"]


def inv_freq(rotary_dim: int, rope_theta: float) -> np.ndarray:
    """``rope_theta ** (-2i / rotary_dim)`` for pair ``i < rotary_dim/2``."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    return rope_theta ** (-2.0 * i / rotary_dim)


def rotate(x: np.ndarray, angle: np.ndarray, rotary_dim: int, interleave: bool) -> np.ndarray:
    """``x [nnz, H, D]`` with its pairs turned by ``angle [nnz, rotary_dim/2]``, in float64."""
    out = x.astype(np.float64)                   # a new array; the tail dims stay as they are
    half = rotary_dim // 2
    first = slice(0, rotary_dim, 2) if interleave else slice(0, half)
    second = slice(1, rotary_dim, 2) if interleave else slice(half, rotary_dim)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = out[..., first].copy(), out[..., second].copy()
    out[..., first] = x1 * cos - x2 * sin
    out[..., second] = x1 * sin + x2 * cos
    return out


def rope_angles(pos: np.ndarray, rotary_dim: int, rope_scale: float, rope_theta: float) -> np.ndarray:
    """``[len(pos), rotary_dim/2]`` angles of plain (Llama) RoPE: pair ``p`` of a vector at
    position ``pos`` turns by ``(pos / rope_scale) * rope_theta ** (-2p / rotary_dim)``."""
    return (np.asarray(pos, np.float64) / float(rope_scale))[:, None] * inv_freq(rotary_dim, float(rope_theta))[None, :]
