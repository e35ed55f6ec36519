"""Rotary position embeddings at attention time, as device functions
(``pos_encoding_mode="ROPE_LLAMA"``; docs/concepts/rope.md).

The golden model's rotation (:mod:`nbattn.reference.rotary`): pair ``i`` of a
head_dim ``D`` vector is its elements ``i`` and ``i + D/2`` (Llama's
non-interleaved layout), and at position ``pos`` it turns by::

    angle_i = (pos / rope_scale) * rope_theta ** (-2 i / D)
    x'_i        = x_i cos(angle_i) - x_{i+D/2} sin(angle_i)
    x'_{i+D/2}  = x_i sin(angle_i) + x_{i+D/2} cos(angle_i)

q turns by its own position, each key by its position in the request, before
the score.  The angle and its cosine and sine are taken in float64 (positions
reach 10^5 and more, where a float32 angle would be off by 10^-2 radians);
the rotated values are float32, as every score is.

Three forms, by kernel layout:

- :func:`chunk_rotation` for a kernel where a lane holds one chunk of ``VEC``
  consecutive elements and reads its partner chunk (elements ``± D/2``) too
  (the decode teaching kernel);
- :func:`row_rotation` for a kernel that holds whole rows in shared memory (the
  prefill teaching tile): one thread turns one pair in place;
- :func:`fast_rotation`, the same turn for the warp decode path, which turns every
  key it streams: the angle is still formed in float64, but reduced to
  ``[-pi, pi]`` there, so that float32 ``cos`` and ``sin`` (about 1e-7 off) take
  the place of float64 ones, which cost more than the whole key's memory traffic.
  The frequencies ``rope_theta ** (-2 i / D) / rope_scale`` come from
  :func:`rope_frequency`, once per CTA.
"""
from __future__ import annotations

import math

from numba import float32, float64

from .primitives import device_fn

__all__ = ["chunk_rotation", "row_rotation", "fast_rotation", "rope_frequency", "partner_chunk",
           "rope_supported"]


def rope_supported(head_dim: int, vec: int) -> bool:
    """Whether a kernel whose lanes hold ``vec`` elements of a ``head_dim`` row can
    pair them: one chunk holds the whole row, or ``D/2`` is a whole number of chunks."""
    return head_dim % 2 == 0 and (vec == head_dim or (head_dim // 2) % vec == 0)


def partner_chunk(head_dim: int, vec: int):
    """Device function ``(chunk) -> chunk``: the chunk holding the partners
    (``± D/2``) of ``chunk``'s elements (itself when one chunk holds the row)."""
    half_chunks = (head_dim // 2) // vec if vec < head_dim else 0

    @device_fn
    def partner(c):
        if half_chunks == 0:
            return c
        return c + half_chunks if c < half_chunks else c - half_chunks

    return partner


def rope_frequency(head_dim: int, rope_scale: float, rope_theta: float):
    """Device function ``freq(i) -> float64``: ``rope_theta ** (-2 i / D) / rope_scale``,
    the angle pair ``i`` turns by per position."""
    inv_scale = 1.0 / float(rope_scale)
    log_theta = math.log(float(rope_theta))

    @device_fn
    def freq(i):
        return inv_scale * math.exp(-2.0 * float64(i) / head_dim * log_theta)

    return freq


def _angle_fn(head_dim: int, rope_scale: float, rope_theta: float):
    freq = rope_frequency(head_dim, rope_scale, rope_theta)

    @device_fn
    def cos_sin(pos, i):
        # angle_i = (pos / rope_scale) * rope_theta ** (-2 i / D), in float64
        ang = float64(pos) * freq(i)
        return math.cos(ang), math.sin(ang)

    return cos_sin


def chunk_rotation(head_dim: int, vec: int, rope_scale: float, rope_theta: float):
    """Device function ``rotate(x, xp, out, o, d0, pos)``: ``out[o + e]`` becomes
    element ``d0 + e`` of the row turned to ``pos``, for ``e < vec``, from ``x[:vec]``
    (elements ``d0 ..``) and ``xp[:vec]`` (the partner chunk's elements; ``x``
    itself when one chunk holds the row)."""
    half = head_dim // 2
    whole = vec == head_dim
    cos_sin = _angle_fn(head_dim, rope_scale, rope_theta)

    @device_fn
    def rotate(x, xp, out, o, d0, pos):
        for e in range(vec):
            d = d0 + e
            pe = (e + half) % vec if whole else e      # where my partner sits in xp
            if d < half:
                c, s = cos_sin(pos, d)
                out[o + e] = float32(float64(x[e]) * c - float64(xp[pe]) * s)
            else:
                c, s = cos_sin(pos, d - half)
                out[o + e] = float32(float64(xp[pe]) * s + float64(x[e]) * c)

    return rotate


def row_rotation(head_dim: int, rope_scale: float, rope_theta: float):
    """Device function ``rotate_pair(rows, r, i, pos)``: pair ``i`` (elements ``i``
    and ``i + D/2``) of row ``r`` of the 2-D array ``rows``, turned to ``pos`` in place."""
    half = head_dim // 2
    cos_sin = _angle_fn(head_dim, rope_scale, rope_theta)

    @device_fn
    def rotate_pair(rows, r, i, pos):
        c, s = cos_sin(pos, i)
        x1 = float64(rows[r, i])
        x2 = float64(rows[r, i + half])
        rows[r, i] = float32(x1 * c - x2 * s)
        rows[r, i + half] = float32(x1 * s + x2 * c)

    return rotate_pair


def fast_rotation(head_dim: int, vec: int):
    """Device function ``turn(x, xo, xp, out, d0, pos, freqs)``: ``out[e]`` becomes
    element ``d0 + e`` of the row turned to ``pos``, for ``e < vec``, from
    ``x[xo:xo + vec]`` (elements ``d0 ..``) and ``xp[:vec]`` (the partner chunk's;
    ``x``'s own chunk when one chunk holds the row).  ``freqs[i]`` is
    :func:`rope_frequency` of pair ``i``.  Same formulas as :func:`chunk_rotation`;
    the angle is reduced to ``[-pi, pi]`` in float64 before float32 takes over."""
    half = head_dim // 2
    whole = vec == head_dim
    inv_two_pi = 1.0 / (2.0 * math.pi)
    two_pi = 2.0 * math.pi

    @device_fn
    def turn(x, xo, xp, out, d0, pos, freqs):
        for e in range(vec):
            d = d0 + e
            i = d if d < half else d - half
            ang = float64(pos) * freqs[i]
            a = float32(ang - math.floor(ang * inv_two_pi + 0.5) * two_pi)    # in [-pi, pi]
            c = math.cos(a)
            s = math.sin(a)
            pe = (e + half) % vec if whole else e      # where my partner sits in xp
            if d < half:
                out[e] = x[xo + e] * c - xp[pe] * s
            else:
                out[e] = xp[pe] * s + x[xo + e] * c

    return turn
