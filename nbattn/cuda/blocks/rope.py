"""Rotary position embeddings at attention time, as device functions
(``pos_encoding_mode="ROPE_LLAMA"``; docs/concepts/rope.md).

The golden model's rotation (:mod:`nbattn.reference.rotary`): pair ``i`` of a
head_dim ``D`` vector is its elements ``i`` and ``i + D/2`` (Llama's
non-interleaved layout), and at position ``pos`` it turns by::

    angle_i = (pos / rope_scale) * rope_theta ** (-2 i / D)
    x'_i        = x_i cos(angle_i) - x_{i+D/2} sin(angle_i)
    x'_{i+D/2}  = x_i sin(angle_i) + x_{i+D/2} cos(angle_i)

q turns by its own position, each key by its position in the request, before
the score.  Positions reach 10^5 and more, where a float32 angle would be off by
10^-2 radians: the teaching forms take the angle and its cosine and sine in
float64, the fast forms count it in fixed-point turns (below).  The rotated
values are float32, as every score is.

Four forms, by kernel layout:

- :func:`chunk_rotation` for a kernel where a lane holds one chunk of ``VEC``
  consecutive elements and reads its partner chunk (elements ``± D/2``) too
  (the decode teaching kernel);
- :func:`row_rotation` for a kernel that holds whole rows in shared memory (the
  prefill teaching tile): one thread turns one pair in place;
- :func:`fast_rotation`, the same turn for the warp decode path, which turns every
  key it streams.  A float64 cosine and sine per element cost more than the key's
  memory traffic, so the angle is counted in *turns* (``angle / 2 pi``) as a
  64-bit fixed-point fraction: ``pos * turns_i`` in integers keeps exactly the
  fraction of a turn that matters, for any int32 position, with no float64 at
  all.  Its top bits become a float32 angle in ``[-pi, pi]``, whose cosine and
  sine the GPU's approximate ``cos.approx`` / ``sin.approx`` take (about 5e-7
  off).  The per-pair ``turns_i = rope_theta ** (-2 i / D) / rope_scale / 2 pi``
  come from :func:`turns_per_position`, on the host, once per kernel.
- :func:`word_rotation`, the same turn for the tensor-core prefill tile, whose K
  tiles and Q rows sit in shared memory as 16-bit values in 32-bit words: one
  thread turns two pairs of one row in place, the result rounded back to fp16 /
  bf16 (as rotating the cache first would round it).
"""
from __future__ import annotations

import math

import numpy as np
from numba import float32, float64, uint32

from .primitives import cos_sin_approx, device_fn, mul_mid_u32, u32_as_f32

__all__ = ["chunk_rotation", "row_rotation", "fast_rotation", "word_rotation", "turn_angle", "rope_frequency",
           "turns_per_position", "turns_table", "partner_chunk", "rope_supported"]

_LOW32 = np.uint64(0xFFFFFFFF)
_HALF_TURN_AND_ROUND = np.uint64(0x80000100)   # + half a turn, + half of the 9 bits dropped below
_ONE_F32 = np.uint64(0x3F800000)               # the bits of 1.0f: 23 fraction bits below them


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


def turns_per_position(head_dim: int, rope_scale: float, rope_theta: float) -> np.ndarray:
    """uint32 ``[head_dim]``: how far pair ``i`` turns per position, in turns
    (``rope_theta ** (-2 i / D) / rope_scale / (2 pi)``), whole turns dropped, as a
    64-bit fixed-point fraction: its high 32 bits at ``[i]``, its low 32 bits at
    ``[D/2 + i]``.  :func:`fast_rotation` reads it."""
    half = head_dim // 2
    out = np.zeros(head_dim, np.uint32)
    for i in range(half):
        r = rope_theta ** (-2.0 * i / head_dim) / float(rope_scale) / (2.0 * math.pi)
        fixed = int(math.ldexp(r - math.floor(r), 64)) % 2 ** 64     # exact: a power-of-two scale
        out[i], out[half + i] = fixed >> 32, fixed & 0xFFFFFFFF
    return out


def turns_table(variant, head_dim: int) -> np.ndarray:
    """The :func:`turns_per_position` table a kernel copies into shared memory: the
    variant's with RoPE, else one unused word (a shared array needs a size)."""
    if not variant.has_rope:
        return np.zeros(1, np.uint32)
    return turns_per_position(head_dim, variant.rope_scale, variant.rope_theta)


def turn_angle(head_dim: int):
    """Device function ``cos_sin(p, i, turns) -> (cos, sin)`` (float32) of pair ``i``'s
    angle at position ``p`` (a uint32), from ``turns`` (:func:`turns_per_position`)."""
    half = head_dim // 2
    two_pi = float32(2.0 * math.pi)

    @device_fn
    def cos_sin(p, i, turns):
        # pos * turns_i mod 1 turn, exactly: the top 32 bits of the 64-bit fraction
        frac = mul_mid_u32(p, turns[i], turns[half + i])
        # as float32 turns in [-1/2, 1/2) (23 bits, rounded), then radians
        bits = (((frac + _HALF_TURN_AND_ROUND) & _LOW32) >> 9) | _ONE_F32
        return cos_sin_approx((u32_as_f32(bits) - float32(1.5)) * two_pi)

    return cos_sin


def fast_rotation(head_dim: int, vec: int):
    """Device function ``turn(x, xo, xp, out, d0, pos, turns)``: ``out[e]`` becomes
    element ``d0 + e`` of the row turned to ``pos`` (``0 <= pos < 2**31``), for
    ``e < vec``, from ``x[xo:xo + vec]`` (elements ``d0 ..``) and ``xp[:vec]`` (the
    partner chunk's; ``x``'s own chunk when one chunk holds the row).  ``turns`` is
    :func:`turns_per_position` (a uint32 array, in shared memory in a kernel).  Same
    formulas as :func:`chunk_rotation`, with the angle in fixed-point turns."""
    half = head_dim // 2
    whole = vec == head_dim
    cos_sin = turn_angle(head_dim)

    @device_fn
    def turn(x, xo, xp, out, d0, pos, turns):
        p = uint32(max(pos, 0))            # (an empty request's q sits at -1; nothing reads it)
        for e in range(vec):
            d = d0 + e
            upper = d >= half                          # element i + D/2 of pair i
            c, s = cos_sin(p, d - half if upper else d, turns)
            # x1' = x1 c - x2 s;  x2' = x2 c + x1 s   (my partner sits at pe in xp)
            pe = (e + half) % vec if whole else e
            out[e] = x[xo + e] * c + (s if upper else -s) * xp[pe]

    return turn


def word_rotation(head_dim: int, unpack2, pack2):
    """Device function ``turn_words(words, o, m, pos, turns)`` for a row of 16-bit
    values held as 32-bit words from ``words[o]`` (the tensor-core prefill tile's
    shared-memory rows): word ``m < D/4`` (elements ``2m``, ``2m + 1``) and its
    partner word ``m + D/4`` (elements ``2m + D/2``, ``2m + 1 + D/2``) turned to
    ``pos`` in place, two pairs at once.  ``unpack2(w) -> (lo, hi)`` and
    ``pack2(lo, hi) -> w`` convert a word; the turned values are rounded back to
    the row's type."""
    quarter = head_dim // 4
    cos_sin = turn_angle(head_dim)

    @device_fn
    def turn_words(words, o, m, pos, turns):
        p = uint32(max(pos, 0))
        a0, a1 = unpack2(words[o + m])
        b0, b1 = unpack2(words[o + m + quarter])
        c0, s0 = cos_sin(p, 2 * m, turns)
        c1, s1 = cos_sin(p, 2 * m + 1, turns)
        # x1' = x1 c - x2 s;  x2' = x2 c + x1 s
        words[o + m] = pack2(a0 * c0 - b0 * s0, a1 * c1 - b1 * s1)
        words[o + m + quarter] = pack2(b0 * c0 + a0 * s0, b1 * c1 + a1 * s1)

    return turn_words
