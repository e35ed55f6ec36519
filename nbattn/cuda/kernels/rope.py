"""The standalone rotary-embedding kernel, beside its NumPy spec
:func:`nbattn.reference.rotary.rotate` (docs/concepts/rope.md).

One thread turns one pair of one head of one row.  The pair is ``(p, p + R/2)``
(rotate half) or ``(2p, 2p + 1)`` (interleaved), for ``R = rotary_dim``; the
host gives the per-pair frequencies, so plain and Llama 3.1 RoPE are the same
kernel with other numbers in ``freq``:

    angle = (pos[r] / position_scale) * freq[p]            (float64)
    x1' = x1 cos(angle) - x2 sin(angle)
    x2' = x1 sin(angle) + x2 cos(angle)

The angle, its cosine and sine and the two products are float64, as in the
golden model (positions reach 10^5 and more, where a float32 angle is off by
10^-2 radians).  The result is rounded to float32 and then to the element type,
so an fp16 / bf16 result may differ from the golden model's single rounding by
one unit in the last place, in rare ties; a float32 result is the golden
model's.  Dimensions past ``rotary_dim`` are copied as raw words by the threads
of the row's pairs (pair ``p`` copies dimensions ``R + p``, ``R + p + R/2``, ...).
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64

from ..blocks.primitives import element_io

__all__ = ["rope_kernel"]

_cache: dict = {}


def rope_kernel(code: str, interleave: bool):
    """The kernel ``rope(x, out, pos, position_scale, freq, heads, head_dim,
    rotary_dim)`` for element type ``code``: ``x`` and ``out`` are the raw 1-D
    views of ``[nnz, heads, head_dim]`` arrays; launch one thread per pair
    (``nnz * heads * rotary_dim / 2``)."""
    key = (code, bool(interleave))
    if key in _cache:
        return _cache[key]
    load, store, _ = element_io(code)

    @cuda.jit
    def rope(x, out, pos, position_scale, freq, heads, head_dim, rotary_dim):
        half = rotary_dim // 2
        t = cuda.grid(1)
        if t >= pos.shape[0] * heads * half:
            return
        row_head = t // half                  # which (row, head), and which pair in it
        p = t - row_head * half
        r = row_head // heads
        base = row_head * head_dim
        i1 = base + (2 * p if interleave else p)
        i2 = i1 + (1 if interleave else half)
        # angle = (pos / position_scale) * freq_p, then the turn, in float64
        angle = float64(pos[r]) / position_scale * freq[p]
        c = math.cos(angle)
        s = math.sin(angle)
        x1 = float64(load(x, i1))
        x2 = float64(load(x, i2))
        store(out, i1, float32(x1 * c - x2 * s))
        store(out, i2, float32(x1 * s + x2 * c))
        # the dimensions RoPE leaves alone, copied as they are
        for d in range(rotary_dim + p, head_dim, half):
            out[base + d] = x[base + d]

    _cache[key] = rope
    return rope
