"""fp8 K/V bytes to float32 in registers (``float8_e4m3fn`` and ``float8_e5m2``).

A paged fp8 cache reaches a kernel as raw uint32 words, four fp8 values a
word (the lower byte is the lower element).  :func:`fp8_unpack4` is the
``unpack4`` of :func:`nbattn.cuda.blocks.primitives.element_io` for such
words: four words (one 16-byte load) become 16 float32 values.

Both conversions are exact for all 256 codes, NaN and infinities included.
Every fp8 value is an fp16 value, so a word goes to two fp16 pairs and on to
float32 with the conversion the fp16 kernels already use
(:func:`~nbattn.cuda.blocks.primitives.f16x2_to_f32`).  A GPU of compute
capability 8.9 or later has the fp8 -> fp16 step as one instruction a pair
(``cvt.rn.f16x2.{e4m3x2,e5m2x2}``, :func:`nbattn.cuda.blocks.mma.fp8x4_to_16x2`),
and :func:`fp8x4_to_f32` picks it there.  Everywhere else (the simulator, older
GPUs) the fp16 bits are written with integer operations, as below:

* e5m2 (1 sign, 5 exponent bits of bias 15, 2 mantissa bits) is the upper
  byte of an fp16 number: ``x = fp16(b << 8)``.
* e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinity,
  ``s1111111`` is NaN): its 7 magnitude bits placed as fp16 bits 7..13 give an
  fp16 number whose exponent bias is 15 instead of 7, normals and subnormals
  alike, so ``x = fp16(s << 15 | (b & 0x7F) << 7) * 2^8``; the NaN codes are
  then set apart (they would read as 480).

The scales (``k_scale``, ``v_scale``) are not applied here: the kernels fold
them into the score scale and the output (docs/concepts/layouts.md).
"""
from __future__ import annotations

from numba import float32, uint32

from ..host.driver import compute_capability
from . import mma as MMA
from .nanrule import NAN_F32
from .primitives import SIMULATOR, device_fn, f16x2_to_f32

__all__ = ["FP8_CODES", "e5m2x4_to_f32", "e4m3x4_to_f32", "fp8x4_to_f32", "fp8_unpack4"]

#: kernel dtype code of each torch fp8 dtype the kernels read
FP8_CODES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


@device_fn
def e5m2x4_to_f32(w):
    """The four e5m2 values of word ``w`` as float32 (exact)."""
    # x_i = fp16(byte_i << 8): two fp16 pairs from the four bytes, then fp16 -> f32
    w = uint32(w)
    lo = ((w << uint32(8)) & uint32(0xFF00)) | ((w << uint32(16)) & uint32(0xFF000000))
    hi = ((w >> uint32(8)) & uint32(0xFF00)) | (w & uint32(0xFF000000))
    a, b = f16x2_to_f32(lo)
    c, d = f16x2_to_f32(hi)
    return a, b, c, d


@device_fn
def _e4m3_nan(w, i, x):
    """``x``, or NaN when byte ``i`` of ``w`` is an e4m3fn NaN code (``s1111111``)."""
    if ((w >> uint32(8 * i)) & uint32(0x7F)) == uint32(0x7F):
        return NAN_F32
    return x


@device_fn
def e4m3x4_to_f32(w):
    """The four e4m3fn values of word ``w`` as float32 (exact, the NaN code NaN)."""
    # x_i = fp16(s_i << 15 | m_i << 7) * 2^8, m_i = byte_i & 0x7F; NaN where m_i = 0x7F
    w = uint32(w)
    lo = (((w & uint32(0x80)) << uint32(8)) | ((w & uint32(0x7F)) << uint32(7))
          | ((w & uint32(0x8000)) << uint32(16)) | ((w & uint32(0x7F00)) << uint32(15)))
    hi = (((w & uint32(0x800000)) >> uint32(8)) | ((w & uint32(0x7F0000)) >> uint32(9))
          | (w & uint32(0x80000000)) | ((w & uint32(0x7F000000)) >> uint32(1)))
    a, b = f16x2_to_f32(lo)
    c, d = f16x2_to_f32(hi)
    two8 = float32(256.0)
    a, b, c, d = a * two8, b * two8, c * two8, d * two8
    # a byte of magnitude 0x7F carries into its top bit: some byte of w is NaN
    if (((w & uint32(0x7F7F7F7F)) + uint32(0x01010101)) & uint32(0x80808080)) != uint32(0):
        a = _e4m3_nan(w, 0, a)
        b = _e4m3_nan(w, 1, b)
        c = _e4m3_nan(w, 2, c)
        d = _e4m3_nan(w, 3, d)
    return a, b, c, d


def fp8x4_to_f32(code: str):
    """The word converter of kernel dtype ``code`` (``"e4m3"`` or ``"e5m2"``): the
    fp8 instruction where the GPU has it (module doc), else the integer one."""
    if code not in ("e4m3", "e5m2"):
        raise ValueError(f"not an fp8 kernel dtype code: {code!r}")
    if not SIMULATOR and (compute_capability() or (0, 0)) >= (8, 9):
        to_f16 = MMA.fp8x4_to_16x2(code, "f16")

        @device_fn
        def by_instruction(w):
            lo, hi = to_f16(w)
            a, b = f16x2_to_f32(lo)
            c, d = f16x2_to_f32(hi)
            return a, b, c, d
        return by_instruction
    return e4m3x4_to_f32 if code == "e4m3" else e5m2x4_to_f32


_cache: dict = {}


def fp8_unpack4(code: str):
    """Device function ``(w0, w1, w2, w3, dst, off)``: the 16 fp8 values of four
    words (one 16-byte chunk) as float32 into ``dst[off:off+16]``."""
    hit = _cache.get(code)
    if hit is not None:
        return hit
    conv = fp8x4_to_f32(code)

    @device_fn
    def word(w, dst, off):                     # one word's four values into dst[off:off+4]
        a, b, c, d = conv(w)
        dst[off] = a
        dst[off + 1] = b
        dst[off + 2] = c
        dst[off + 3] = d

    @device_fn
    def unpack4(w0, w1, w2, w3, dst, off):
        word(w0, dst, off)
        word(w1, dst, off + 4)
        word(w2, dst, off + 8)
        word(w3, dst, off + 12)

    _cache[code] = unpack4
    return unpack4
