"""A first Hopper attention tile on warpgroup products (``wgmma``), for one request
with contiguous K/V: the same math as the teaching tile
(:mod:`nbattn.cuda.kernels.prefill_core`) on 64 query rows of one head at a time.

Not used by the attention forms: it is the starting point of the Hopper prefill
tile (docs/gpu.md, "Hopper"), written to be read, checked against the golden
model on a Hopper GPU by ``tests/test_wgmma.py``, and only then made fast (bulk
copies into a ring of stages, two consumer warpgroups, the NaN rule, variants).
It keeps finite inputs only: a NaN or infinite score is not turned into a NaN row
as the package's rule asks (docs/bad_input.md).

One CTA is one warpgroup (128 threads) and owns rows ``q0 .. q0 + 63`` of head
``h``.  Per tile of 64 keys::

    load:            K rows and V^T into shared memory as 8 x 8 core matrices
    compute qk:      S = Q K^T            eight m64n64k16 products, A and B in shared memory
    update m and l:  m' = max(m, rowmax(S)),  P = 2^(S - m'),  l' = 2^(m - m') l + rowsum(P)
    update acc:      O = 2^(m - m') O + P V   four m64n128k16 products, P from registers

Scores are in base 2 (``sm_scale * log2 e`` folded in), as in every kernel of the
package; at the end ``o = O / l`` and ``lse = m + log2 l``.  Query row ``i`` sits
at position ``n_k - n_q + i`` (bottom-right), so the causal mask keeps key ``j``
when ``j <= n_k - n_q + i``; a row that keeps no key gets ``o = 0, lse = -inf``.
Each thread holds rows ``r0 = 16 w + lane // 4`` and ``r0 + 8`` of S and O
(:mod:`nbattn.cuda.blocks.wgmma`), so a row's max and sum are shuffles across the
four lanes of a quad, and P becomes the A fragment of the P V product where it is.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint16

from ..blocks.mma import pack_f16x2, shared_addr
from ..blocks.primitives import exp2f, shfl_xor_f32
from ..blocks.wgmma import (core_offset, fence_proxy_async, smem_desc, wgmma_commit, wgmma_fence,
                            wgmma_m64n64k16_f16, wgmma_m64n128k16_f16_rs, wgmma_wait0)

__all__ = ["prefill_wgmma_kernel", "THREADS", "BLOCK_M", "BLOCK_N", "HEAD_DIM"]

THREADS = 128            # one warpgroup
BLOCK_M = 64             # query rows a CTA
BLOCK_N = 64             # keys a tile
HEAD_DIM = 128
LEAD = 128               # descriptor: next core matrix along K
NEG_INF = float32(-math.inf)

_cache: dict = {}


def prefill_wgmma_kernel(causal: bool):
    """The kernel ``tile(q, k, v, o, lse, scale_log2, group)`` for fp16 ``q [n_q, Hq, 128]``,
    ``k, v [n_k, Hkv, 128]`` (raw uint16 words), float32 ``o [n_q, Hq, 128]`` and
    ``lse [n_q, Hq]`` (base 2); ``scale_log2 = sm_scale * log2(e)``, ``group = Hq // Hkv``.
    Launch grid ``(ceil(n_q / 64), Hq)``, :data:`THREADS` threads."""
    if causal in _cache:
        return _cache[causal]
    D, BM, BN = HEAD_DIM, BLOCK_M, BLOCK_N
    Q_ELEMS, KV_ELEMS = BM * D, BN * D
    QK_STRIDE = (D // 8) * 128       # next 8 rows of Q or K (16 core matrices along head_dim)
    PV_STRIDE = (BN // 8) * 128      # next 8 rows of V^T (8 core matrices along the keys)

    @cuda.jit
    def tile(q, k, v, o, lse, scale_log2, group):
        sq = cuda.shared.array(Q_ELEMS, np.uint16, alignment=128)
        sk = cuda.shared.array(KV_ELEMS, np.uint16, alignment=128)
        svt = cuda.shared.array(KV_ELEMS, np.uint16, alignment=128)
        s_acc = cuda.local.array(32, float32)         # S: rows r0, r0 + 8; 16 keys each
        o_acc = cuda.local.array(64, float32)         # O: rows r0, r0 + 8; 32 dims each
        t = cuda.threadIdx.x
        lane = t % 32
        quad = lane % 4
        r0 = 16 * (t // 32) + lane // 4
        h = cuda.blockIdx.y
        kvh = h // group
        q0 = cuda.blockIdx.x * BM
        n_q = q.shape[0]
        n_k = k.shape[0]
        pos0 = n_k - n_q + q0 + r0                    # my rows' positions
        pos1 = pos0 + 8
        for e in range(t, Q_ELEMS, THREADS):          # the Q tile (rows past n_q: zeros)
            r = e // D
            d = e % D
            sq[core_offset(r, d, D // 8) // 2] = q[q0 + r, h, d] if q0 + r < n_q else uint16(0)
        for i in range(64):
            o_acc[i] = float32(0.0)
        m0 = m1 = NEG_INF
        l0 = l1 = float32(0.0)
        end = n_k
        if causal:                                    # keys past the last row's position are hidden
            end = min(n_k, max(0, n_k - n_q + q0 + BM))
        base_q, base_k, base_v = shared_addr(sq), shared_addr(sk), shared_addr(svt)

        for k0 in range(0, end, BN):
            cuda.syncthreads()                        # every thread is done with the last tile
            for e in range(t, KV_ELEMS, THREADS):     # K rows, and V transposed (row = dim)
                j = e // D
                d = e % D
                inside = k0 + j < n_k
                sk[core_offset(j, d, D // 8) // 2] = k[k0 + j, kvh, d] if inside else uint16(0)
                svt[core_offset(d, j, BN // 8) // 2] = v[k0 + j, kvh, d] if inside else uint16(0)
            cuda.syncthreads()
            fence_proxy_async()

            # -- compute qk: S = Q K^T, 16 dims a product --
            wgmma_fence()
            for s in range(D // 16):
                wgmma_m64n64k16_f16(s_acc, smem_desc(base_q + s * 256, LEAD, QK_STRIDE),
                                    smem_desc(base_k + s * 256, LEAD, QK_STRIDE), 1 if s > 0 else 0)
            wgmma_commit()
            wgmma_wait0()

            # -- update m and l: scaled scores in base 2, masks, the row max over the quad --
            mx0 = mx1 = NEG_INF
            for i in range(8):
                for c in range(2):
                    j = k0 + 8 * i + 2 * quad + c
                    a = s_acc[4 * i + c] * scale_log2
                    b = s_acc[4 * i + 2 + c] * scale_log2
                    if j >= n_k or (causal and j > pos0):
                        a = NEG_INF
                    if j >= n_k or (causal and j > pos1):
                        b = NEG_INF
                    s_acc[4 * i + c] = a
                    s_acc[4 * i + 2 + c] = b
                    mx0 = max(mx0, a)
                    mx1 = max(mx1, b)
            mx0 = max(mx0, shfl_xor_f32(mx0, 1))
            mx0 = max(mx0, shfl_xor_f32(mx0, 2))
            mx1 = max(mx1, shfl_xor_f32(mx1, 1))
            mx1 = max(mx1, shfl_xor_f32(mx1, 2))
            n0 = max(m0, mx0)
            n1 = max(m1, mx1)
            sub0 = n0 if n0 != NEG_INF else float32(0.0)      # a row with no key yet: P = 0
            sub1 = n1 if n1 != NEG_INF else float32(0.0)
            alpha0 = exp2f(m0 - sub0)
            alpha1 = exp2f(m1 - sub1)
            m0, m1 = n0, n1
            l0 *= alpha0                                       # my part of the row sums
            l1 *= alpha1
            for i in range(8):
                for c in range(2):
                    s_acc[4 * i + c] = exp2f(s_acc[4 * i + c] - sub0)
                    s_acc[4 * i + 2 + c] = exp2f(s_acc[4 * i + 2 + c] - sub1)
                    l0 += s_acc[4 * i + c]
                    l1 += s_acc[4 * i + 2 + c]

            # -- update acc: O = alpha O + P V, P as the A fragment, 16 keys a product --
            for i in range(16):
                o_acc[4 * i] *= alpha0
                o_acc[4 * i + 1] *= alpha0
                o_acc[4 * i + 2] *= alpha1
                o_acc[4 * i + 3] *= alpha1
            wgmma_fence()
            for s in range(BN // 16):
                frag = (pack_f16x2(s_acc[8 * s], s_acc[8 * s + 1]), pack_f16x2(s_acc[8 * s + 2], s_acc[8 * s + 3]),
                        pack_f16x2(s_acc[8 * s + 4], s_acc[8 * s + 5]),
                        pack_f16x2(s_acc[8 * s + 6], s_acc[8 * s + 7]))
                wgmma_m64n128k16_f16_rs(o_acc, frag, smem_desc(base_v + s * 256, LEAD, PV_STRIDE), 1)
            wgmma_commit()
            wgmma_wait0()

        # -- the end: the row sums over the quad, o = O / l, lse = m + log2 l --
        l0 += shfl_xor_f32(l0, 1)
        l0 += shfl_xor_f32(l0, 2)
        l1 += shfl_xor_f32(l1, 1)
        l1 += shfl_xor_f32(l1, 2)
        inv0 = float32(1.0) / l0 if m0 != NEG_INF else float32(0.0)
        inv1 = float32(1.0) / l1 if m1 != NEG_INF else float32(0.0)
        for half in range(2):
            row = q0 + r0 + 8 * half
            if row < n_q:
                inv = inv0 if half == 0 else inv1
                for i in range(16):
                    col = 8 * i + 2 * quad
                    o[row, h, col] = o_acc[4 * i + 2 * half] * inv
                    o[row, h, col + 1] = o_acc[4 * i + 2 * half + 1] * inv
                if quad == 0:
                    m, l_row = (m0, l0) if half == 0 else (m1, l1)
                    lse[row, h] = m + math.log2(l_row) if m != NEG_INF else NEG_INF

    _cache[causal] = tile
    return tile
