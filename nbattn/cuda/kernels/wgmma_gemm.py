"""Warpgroup products on Hopper tensor cores, ``D = A @ B^T`` for a 64 x K ``A``
and a 64 x K ``B`` in fp16 (float32 ``D``, 64 x 64; K = 16 per step): the first
brick of a Hopper prefill tile, where ``A`` is a tile of q rows and ``B`` a tile
of keys over head_dim = K, so ``D`` is a tile of scores (``compute qk`` of
:mod:`nbattn.cuda.kernels.prefill_core`).

The kernel does each step of :mod:`nbattn.cuda.blocks.wgmma` in the plain order
a tile repeats them in: the 128 threads copy both operands into shared memory
as 8 x 8 core matrices, make the copies visible to the asynchronous proxy, issue
one product per 16 columns of K (the descriptors' start moves two core matrices
on each time; the first product overwrites D, the others add to it), wait for
them, and write each thread's 32 accumulators to ``D`` in the fragment layout.  It is not used
by the attention forms yet; ``tests/test_wgmma.py`` checks it against NumPy on a
Hopper GPU.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32

from ..blocks.mma import shared_addr
from ..blocks.wgmma import N_ACC, core_offset, fence_proxy_async, smem_desc, wgmma_commit, wgmma_fence, \
    wgmma_m64n64k16_f16, wgmma_wait0

__all__ = ["wgmma_gemm_kernel", "THREADS", "LEAD_BYTES"]

THREADS = 128                 # one warpgroup
LEAD_BYTES = 128              # next core matrix along K

_cache: dict = {}


def wgmma_gemm_kernel(k_steps: int = 1, lead_bytes: int = LEAD_BYTES, stride_bytes: int | None = None):
    """The kernel ``gemm(a, b, d)``: ``a``, ``b`` raw fp16 words (uint16) of shape
    [64, 16 * k_steps], ``d`` float32 [64, 64]; launch one CTA of :data:`THREADS`
    threads.  The descriptor offsets are arguments so a test can tell them apart
    (``stride_bytes`` None: the next 8-row group, ``2 * k_steps`` core matrices on)."""
    K = 16 * k_steps
    ELEMS = 64 * K                          # a shared array's size must be a constant
    k_cores = 2 * k_steps                   # core matrices along K in each 8-row group
    stride = k_cores * 128 if stride_bytes is None else stride_bytes
    key = (k_steps, lead_bytes, stride)
    if key in _cache:
        return _cache[key]

    @cuda.jit
    def gemm(a, b, d):
        sa = cuda.shared.array(ELEMS, np.uint16, alignment=128)
        sb = cuda.shared.array(ELEMS, np.uint16, alignment=128)
        acc = cuda.local.array(N_ACC, float32)
        t = cuda.threadIdx.x
        # both operands into shared memory, K-major, as 8 x 8 core matrices
        for e in range(t, ELEMS, THREADS):
            row = e // K
            k = e % K
            sa[core_offset(row, k, k_cores) // 2] = a[row, k]
            sb[core_offset(row, k, k_cores) // 2] = b[row, k]
        cuda.syncthreads()
        fence_proxy_async()
        for i in range(N_ACC):
            acc[i] = float32(0.0)
        # D = A @ B^T on the tensor cores, 16 columns of K a product
        base_a = shared_addr(sa)
        base_b = shared_addr(sb)
        wgmma_fence()
        for j in range(k_steps):
            step = j * 2 * 128                  # two core matrices on along K
            wgmma_m64n64k16_f16(acc, smem_desc(base_a + step, lead_bytes, stride),
                                smem_desc(base_b + step, lead_bytes, stride), 1 if j > 0 else 0)
        wgmma_commit()
        wgmma_wait0()
        # each thread's accumulators, per 8 columns as mma.sync's C fragment
        w = t // 32
        lane = t % 32
        r = 16 * w + lane // 4
        for i in range(8):
            c = 8 * i + 2 * (lane % 4)
            d[r, c] = acc[4 * i]
            d[r, c + 1] = acc[4 * i + 1]
            d[r + 8, c] = acc[4 * i + 2]
            d[r + 8, c + 1] = acc[4 * i + 3]

    _cache[key] = gemm
    return gemm
