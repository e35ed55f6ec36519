"""The merge of attention states on the GPU: the teaching kernels (docs/concepts/state.md).

:func:`fold_kernel` is *the* kernel to read for this idea.  Set it beside the
golden model, :func:`nbattn.reference.state.merge_states` (and
:func:`~nbattn.reference.state.merge_state` for :func:`pair_kernel`): the same
left fold of states, one state at a time, in the order given.  A state over a
key set is ``(o, lse)``, the normalized output and the base-2 log-sum-exp;
merging two disjoint sets weighs each output by its share of the exponent mass,
normalized *before* the vectors are combined, so nothing overflows::

    m = max(lse_a, lse_b);  a = 2^(lse_a - m);  b = 2^(lse_b - m)
    o = a/(a+b) * o_a + b/(a+b) * o_b;          lse = m + log2(a + b)

(:func:`nbattn.cuda.blocks.softmax.merge_weights`).  Two empty states (lse =
-inf) merge to an empty one (o = 0, lse = -inf), never NaN; a NaN LSE makes
the merge NaN.  No atomics: equal inputs give bitwise equal outputs.

Launch shape: one CTA per (row, head) for the fold, one per row of the flat
states for the pair merge; threads over ``head_dim``, and every thread
computes the row's weights itself (a few flops, no barrier to share them).

The split-KV merges of :mod:`nbattn.cuda.kernels.merge_split` compute the same
fold over many partials, shaped for bandwidth and latency.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int64

from ..blocks.primitives import SIMULATOR, element_io
from ..blocks.softmax import NEG_INF, merge_weights
from ..host.driver import jit_kernel

LOG2E = 1.0 / math.log(2.0)

__all__ = ["KERNELS", "pair_threads", "fold_kernel", "pair_kernel", "sink_kernel"]

#: Every compiled merge kernel (and generated device function), by its key.
KERNELS: dict = {}


def pair_threads(head_dim: int) -> int:
    """Threads per CTA of :func:`fold_kernel` and :func:`pair_kernel`: one per element of
    a row, in whole warps, at most 128 (8 under the simulator)."""
    if SIMULATOR:
        return min(head_dim, 8)
    return min(128, -(-head_dim // 32) * 32)


def fold_kernel(code: str, head_dim: int):
    """The kernel to read for merging attention states, beside its golden model
    :func:`nbattn.reference.state.merge_states`: a left fold of the states of each
    row, in axis order, with the merge of two states at every step.

    Kernel ``(v, s, num_states, num_heads, out, lse)`` of
    ``v [rows, num_states, num_heads, head_dim]`` (raw-typed by ``code``) and
    ``s [rows, num_states, num_heads]`` (float32), grid ``(rows, num_heads)``."""
    key = ("fold", code, head_dim)
    if key in KERNELS:
        return KERNELS[key]
    D, NB = head_dim, pair_threads(head_dim)
    load_elem, store_elem, _ = element_io(code)

    def kernel(v, s, num_states, num_heads, out, lse):
        r = int64(cuda.blockIdx.x)
        h = cuda.blockIdx.y
        for d in range(cuda.threadIdx.x, D, NB):
            # start from the empty state: o = 0, lse = -inf
            o = float32(0.0)
            l = NEG_INF
            for i in range(num_states):
                # (o, l) <- merge((o, l), (v_i, s_i)):  w_o, w_i from the two LSEs, o = w_o o + w_i v_i
                wa, wb, l = merge_weights(l, s[(r * num_states + i) * num_heads + h])
                o = wa * o + wb * load_elem(v, ((r * num_states + i) * num_heads + h) * D + d)
            store_elem(out, (r * num_heads + h) * D + d, o)
            if d == 0:
                lse[r * num_heads + h] = l

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]


def pair_kernel(code: str, head_dim: int):
    """Kernel ``(va, sa, vb, sb, out, out_s, mask, use_mask)``: ``merge_state`` of two
    flat states row by row, one CTA a row; rows whose ``mask`` is 0 are left alone
    when ``use_mask``.  ``out`` may be ``va`` (the in-place merge)."""
    key = ("pair", code, head_dim)
    if key in KERNELS:
        return KERNELS[key]
    D, NB = head_dim, pair_threads(head_dim)
    load_elem, store_elem, _ = element_io(code)

    def kernel(va, sa, vb, sb, out, out_s, mask, use_mask):
        n = int64(cuda.blockIdx.x)
        active = (not use_mask) or mask[n] != 0
        # m = max(sa, sb); wa = 2^(sa-m) / (2^(sa-m) + 2^(sb-m)); wb likewise; l = m + log2(...)
        wa, wb, l = merge_weights(sa[n], sb[n])
        cuda.syncthreads()  # in place: every thread has read sa[n] before it is overwritten
        if active:
            for d in range(cuda.threadIdx.x, D, NB):
                # o = wa * o_a + wb * o_b
                o = wa * load_elem(va, n * D + d) + wb * load_elem(vb, n * D + d)
                store_elem(out, n * D + d, o)
            if cuda.threadIdx.x == 0:
                out_s[n] = l

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]


def sink_kernel(code: str, head_dim: int):
    """Kernel ``(o, lse, sinks, num_heads)``: every flat state ``n`` (row ``n //
    num_heads``, head ``h = n % num_heads``) merged in place with the sink state
    of its head, ``(0, sinks[h] * log2(e))``, one CTA a state.  It is
    :func:`pair_kernel` with the second state's vector known to be zero and its
    LSE read per head (``sinks`` float32 logits, natural base)."""
    key = ("sink", code, head_dim)
    if key in KERNELS:
        return KERNELS[key]
    D, NB = head_dim, pair_threads(head_dim)
    load_elem, store_elem, _ = element_io(code)
    log2e = float32(LOG2E)

    def kernel(o, lse, sinks, num_heads):
        n = int64(cuda.blockIdx.x)
        # the sink's state: o_s = 0, lse_s = sinks[h] * log2(e);  wa, wb, l as in pair_kernel
        wa, wb, l = merge_weights(lse[n], sinks[n % num_heads] * log2e)
        cuda.syncthreads()  # every thread has read lse[n] before it is overwritten
        for d in range(cuda.threadIdx.x, D, NB):
            # o = wa * o + wb * 0
            store_elem(o, n * D + d, wa * load_elem(o, n * D + d))
        if cuda.threadIdx.x == 0:
            lse[n] = l

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]
