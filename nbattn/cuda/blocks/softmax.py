"""The softmax algebra of attention states, as device functions (docs/concepts/state.md).

A state over a set of keys is ``(o, lse)``: the normalized output and the
base-2 log-sum-exp of the scores (the kernels fold ``log2(e)`` into the scale,
so every exponent here is ``2^x``).  Two pieces of algebra recur in every
kernel, and are written once here:

* the merge of two states, or of two running ``(max, mass)`` pairs of LSE
  terms -- what a split-KV merge and the end of a decode CTA do;
* the online-softmax update: when a running max grows, the mass and output so
  far are rescaled by ``2^(m_old - m_new)``, and each new key weighs
  ``2^(s - m_new)``.

The empty-state rule of the golden model (:mod:`nbattn.reference.state`) holds
throughout: an empty state has ``lse = -inf`` and weighs 0; two empty states
merge to an empty one (``o = 0``, ``lse = -inf``), never to NaN.  A NaN LSE
stays NaN (:mod:`nbattn.cuda.blocks.nanrule`).
"""
from __future__ import annotations

import math

from numba import float32

from .primitives import device_fn, exp2f
from .nanrule import NAN_F32

__all__ = ["NEG_INF", "merge_weights", "lse_fold", "state_weight", "state_mass", "rescale", "key_weight",
           "online_step"]

NEG_INF = float32(-math.inf)


@device_fn
def merge_weights(la, lb):
    """Normalized weights of two states and the merged LSE (empty+empty -> 0, 0, -inf;
    a NaN LSE -> NaN, NaN, NaN: a merge of a NaN state is NaN)."""
    # m = max(la, lb); wa = 2^(la-m) / (2^(la-m) + 2^(lb-m)); wb likewise; lse = m + log2(2^(la-m) + 2^(lb-m))
    if la != la or lb != lb:
        return NAN_F32, NAN_F32, NAN_F32
    m = max(la, lb)
    if m == NEG_INF:
        return float32(0.0), float32(0.0), NEG_INF
    a = math.exp2(la - m)
    b = math.exp2(lb - m)
    total = a + b
    return float32(a / total), float32(b / total), float32(m + math.log2(total))


@device_fn
def lse_fold(m1, l1, m2, l2):
    """Fold two (max, mass) pairs of base-2 LSE terms, ``mass = sum 2^(lse - max)``;
    empty + empty stays (-inf, 0); a NaN max stays NaN."""
    # m = max(m1, m2); l = l1 * 2^(m1 - m) + l2 * 2^(m2 - m)   (the LSE is m + log2(l))
    if m1 != m1 or m2 != m2:
        return NAN_F32, NAN_F32
    mm = max(m1, m2)
    if mm == NEG_INF:
        return NEG_INF, float32(0.0)
    return mm, l1 * math.exp2(m1 - mm) + l2 * math.exp2(m2 - mm)


@device_fn
def state_mass(lk, mx):
    """Mass ``2^(lk - mx)`` of a state of LSE ``lk`` beside the row max ``mx``; 0 when empty."""
    # mass_k = 2^(lse_k - M)
    if lk == NEG_INF:
        return float32(0.0)
    return float32(math.exp2(lk - mx))


@device_fn
def state_weight(lk, mx, inv):
    """Weight of a state of LSE ``lk`` in a merge of row max ``mx`` and inverse total
    mass ``inv``: normalized before it touches a vector, so nothing overflows."""
    # w_k = 2^(lse_k - M) / T,  with T = sum_j 2^(lse_j - M) and inv = 1 / T
    if lk == NEG_INF:
        return float32(0.0)
    return float32(math.exp2(lk - mx)) * inv


@device_fn
def rescale(m_old, m_new):
    """Online-softmax rescale of what was summed under max ``m_old`` once the max is
    ``m_new``; 1 while the row has seen no key (``m_new = -inf``)."""
    # alpha = 2^(m_old - m_new);  l <- alpha * l + sum p;  o <- alpha * o + sum p * v
    if m_new == NEG_INF:
        return float32(1.0)
    return exp2f(m_old - m_new)


@device_fn
def key_weight(s, m):
    """Online-softmax weight of a key of score ``s`` under the running max ``m``; 0 for
    a score of -inf (a masked key)."""
    # p = 2^(s - m)
    if s == NEG_INF:
        return float32(0.0)
    return exp2f(s - m)


@device_fn
def online_step(p, n, m_old, m_new, l):
    """One online-softmax step of a row that keeps its own state: the ``n`` new scores
    ``p[:n]`` become their weights in place, under the new running max ``m_new``
    (already the max of ``m_old`` and the scores).  Returns the rescale factor of what
    was summed under ``m_old`` (for the caller's accumulator) and the new mass."""
    # alpha = 2^(m_old - m_new);  p_j = 2^(s_j - m_new);  l' = alpha * l + sum_j p_j
    f = rescale(m_old, m_new)
    l *= f
    for j in range(n):
        w = key_weight(p[j], m_new)
        p[j] = w
        l += w
    return f, l
