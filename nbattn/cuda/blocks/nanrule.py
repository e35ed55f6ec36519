"""Device pieces of the NaN rule, shared by every attention kernel.

The rule (the golden model's :func:`nbattn.reference.attention.attend`):

- a key is *visible* to a row when every mask keeps it (range, causal,
  window and sinks, ``mask_mod``, block sparsity);
- a visible key whose raw score ``q . k * sm_scale`` is not finite, whose V
  holds a non-finite element, or whose final score is NaN (+inf too, for
  softmax) makes the row's o and LSE NaN;
- an invisible key never affects a row: it is skipped, not weighted by 0;
- a row that sees no key (or whose visible keys all score -inf) is
  ``o = 0, LSE = -inf``, decided by the running max staying -inf (a flag),
  never by ``l > 0`` (a NaN sum is not "no keys").

How the kernels keep it, without a branch in their inner products:

1. When a KV tile is loaded, a 16-byte chunk of V with a non-finite element is
   stored as zeros and the matching chunk of K as NaN (:func:`poison_kv`).
   The key's V then cannot reach a row that skips it (its weight is 0 and the
   stored V finite), while every row that sees it gets a NaN score.
2. A visible key's raw score is checked before the variant transform
   (:func:`checked`): a soft cap or ``score_mod`` cannot turn NaN/inf into a
   finite number.
3. The running max is NaN-sticky (:func:`max_nan`): ``max`` in compiled code
   skips a NaN operand, so a NaN score is carried explicitly.  A NaN max makes
   every later weight, rescale factor and the final sum NaN.
4. The final write tests the max (NaN -> NaN row; -inf -> empty row).

The decode kernels on the GPU paths (warp and tensor-core) keep steps 1-3
out of their main loop, because checking every 16-byte V chunk costs a
bandwidth-bound loop much of its speed.  Their first pass over a work item
does plain arithmetic, in which every breach of the rule leaves a trace:

- a visible key's non-finite V reaches the accumulator through ``p * v``
  whatever its weight (``0 * inf`` and ``0 * NaN`` are NaN), and so does a
  hidden key's (a false alarm, which costs time only);
- a non-finite raw score makes the sum of the raw scores the lane took
  non-finite (a finite score cannot overflow that sum for fp16; where it does,
  the alarm is again false);
- a NaN final score makes the mass ``l`` NaN, a +inf one the max.

:func:`state_suspect` reads those traces once per item.  When any thread of the
CTA finds one (``syncthreads_or``), the item runs again with steps 1-3 kept key
by key, so the result is the careful one.  Where nothing is found, the careful
pass would have computed exactly the same numbers (each step is the identity on
finite values), so the first pass's result stands.

The pipelined tensor-core tile copies V with ``cp.async`` after its scores
are taken, so step 1 cannot reach K there.  It checks its result instead: a
row whose O holds a non-finite value while its max is not NaN met a
non-finite V (a hidden key's, through a 0 weight, or a visible key's, in one
column only).  Then, rarely, the CTA walks its keys again; this time each
key's V row is checked (:func:`chunk_bad`) when its address is taken, and a
bad key's V is zero-filled and its K read from a row of NaN (kept after the
ALiBi slopes, :func:`nbattn.cuda.prefill.tile_slopes`): step 1 by addresses.
"""
from __future__ import annotations

import math

from numba import float32, int32, uint32

from .primitives import device_fn

__all__ = ["chunk_bad", "poison_kv", "checked", "max_nan", "state_suspect", "NAN_F32", "EXP_MASK", "NAN_WORD"]

NAN_F32 = float32(math.nan)
POS_INF = float32(math.inf)
# Exponent bits (all ones = inf or NaN) of each element in a 32-bit word, and a NaN word.
EXP_MASK = {"f32": (0x7F800000, 0), "f16": (0x7C00, 0x7C000000), "bf16": (0x7F80, 0x7F800000)}
NAN_WORD = {"f32": 0x7FC00000, "f16": 0x7E007E00, "bf16": 0x7FC07FC0, "e4m3": 0x7F7F7F7F, "e5m2": 0x7F7F7F7F}
# fp8 (four bytes a word): the magnitude bits that are all ones in a non-finite code
# (e4m3fn: s1111111, its NaN; e5m2: s11111mm, inf or NaN), and the add that carries
# such a byte, and no other, into its top bit
FP8_BAD = {"e4m3": (0x7F7F7F7F, 0x01010101), "e5m2": (0x7C7C7C7C, 0x04040404)}

_cache: dict = {}


def chunk_bad(code: str):
    """Device function ``(w0, w1, w2, w3) -> bool`` on the raw uint32 words of a
    16-byte chunk: True when an element is inf or NaN (all exponent bits set; for the
    fp8 codes ``"e4m3"`` / ``"e5m2"``, the four bytes of each word are checked)."""
    key = ("bad", code)
    if key in _cache:
        return _cache[key]
    if code in FP8_BAD:
        _cache[key] = _fp8_chunk_bad(*FP8_BAD[code])
        return _cache[key]
    lo_m, hi_m = EXP_MASK[code]
    LO, HI = uint32(lo_m), uint32(hi_m)
    TWO = hi_m != 0

    @device_fn
    def bad(w):
        if (w & LO) == LO:
            return True
        if TWO and (w & HI) == HI:
            return True
        return False

    @device_fn
    def chunk(w0, w1, w2, w3):
        return bad(w0) or bad(w1) or bad(w2) or bad(w3)

    _cache[key] = chunk
    return chunk


def _fp8_chunk_bad(mask: int, carry: int):
    M, C, TOP = uint32(mask), uint32(carry), uint32(0x80808080)

    @device_fn
    def bad(w):
        # ((w & M) + C) & 0x80808080 != 0  <=>  some byte b has (b & M) == M
        return (((uint32(w) & M) + C) & TOP) != uint32(0)

    @device_fn
    def chunk(w0, w1, w2, w3):
        return bad(w0) or bad(w1) or bad(w2) or bad(w3)
    return chunk


def poison_kv(code: str):
    """Device function ``(k0, k1, k2, k3, v0, v1, v2, v3) -> (k0..k3, v0..v3)`` on raw
    uint32 words: a V chunk with a non-finite element comes back as zeros and the
    K chunk of the same key and dims as NaN (step 1 of the module doc)."""
    if code in _cache:
        return _cache[code]
    bad = chunk_bad(code)
    NANW = uint32(NAN_WORD[code])

    @device_fn
    def poison(k0, k1, k2, k3, v0, v1, v2, v3):
        if bad(v0, v1, v2, v3):
            z = uint32(0)
            return NANW, NANW, NANW, NANW, z, z, z, z
        return k0, k1, k2, k3, v0, v1, v2, v3

    _cache[code] = poison
    return poison


@device_fn
def checked(raw, s):
    """The score ``s`` a visible key gets from its raw score ``raw``: NaN when
    ``raw`` is not finite, else ``s`` (step 2)."""
    if math.isfinite(raw):
        return s
    return NAN_F32


@device_fn
def max_nan(m, x):
    """NaN-sticky running max: NaN when either is NaN (step 3)."""
    if m != m or x != x:
        return NAN_F32
    return max(m, x)


@device_fn
def state_suspect(acc, n, m, l, raw_sum):
    """1 when a pass's state over a work item shows a trace of a non-finite value
    (module doc), else 0 (an int32: ``cuda.syncthreads_or`` takes an integer on
    the GPU): an accumulator element of ``acc[:n]`` or the sum of raw scores not
    finite, a NaN mass, or a NaN or +inf running max."""
    bad = not (math.isfinite(raw_sum) and math.isfinite(l) and m < POS_INF)
    for e in range(n):
        if not math.isfinite(acc[e]):
            bad = True
    return int32(1) if bad else int32(0)
