"""Split-KV merges: the fold of :func:`nbattn.cuda.kernels.merge.fold_kernel` over many partials.

How these differ from the teaching fold (same result, same empty-state and NaN
rules, orders fixed by the thread layout so equal inputs give bitwise equal
outputs):

* The partials of a merge are named by a merge map (CSR: ``merge_indptr``,
  ``merge_row``, ``merge_slots``) instead of lying side by side, and they are
  float32 ``[slots, H, D]`` / ``[slots, H]``.
* A left fold is a chain of dependent loads, one partial after another.  So
  the fold is taken apart: first the row's max LSE ``M`` and total mass ``T =
  sum 2^(lse_k - M)`` (:func:`nbattn.cuda.blocks.softmax.lse_fold`), then
  ``o = sum_k 2^(lse_k - M) / T * o_k`` with every load independent of the
  last (:func:`~nbattn.cuda.blocks.softmax.state_weight`).
* :func:`partials_kernel` (any count) finds ``M, T`` by a tree in shared
  memory and sums the outputs in ``KS`` streams of partials with 16-byte loads,
  four in flight; :func:`few_partials_kernel` (at most :data:`FEW_CAP`) has
  every warp find ``M, T`` by xor shuffles, with all loads issued in one round,
  and may be launched programmatically behind the split decode that writes its
  partials (``MergeTuning.few_programmatic``);
* :func:`tile_merge_kernel` runs on a fixed grid, merge count read on the
  device, and merges whole query tiles of fused rows (the plan/run wrappers).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64

from ..blocks import nanrule as NR
from ..blocks.mma import grid_dependency_wait, grid_dependents_launch
from ..blocks.primitives import SIMULATOR, device_fn, element_io, ld_v4, shfl_idx_f32, shfl_xor_f32
from ..blocks.softmax import NEG_INF, lse_fold, state_mass, state_weight
from ..host.driver import jit_kernel
from .merge import KERNELS

__all__ = ["partials_threads", "partials_kernel", "few_partials_kernel", "FEW_CAP", "tile_threads",
           "TILE_ROWS_MAX", "tile_merge_kernel"]

FEW_CAP = 64          # the one-round form holds two LSEs per lane of a warp
TILE_ROWS_MAX = 128   # the largest query tile (docs/concepts/scheduler.md: T_q <= 128)


def partials_threads(per_merge: float) -> int:
    """Threads per CTA of :func:`partials_kernel` (a power of two: the LSE pass is a
    tree): one warp for a few partials a row (batch decode splits in two:
    thousands of small CTAs), eight for many (batch 1: one row, ~64 partials)."""
    if SIMULATOR:
        return 8
    return 32 if per_merge <= 8 else 256


def tile_threads() -> int:
    """Threads per CTA of :func:`tile_merge_kernel`."""
    return 16 if SIMULATOR else 128


@device_fn
def merge_span(merge_indptr, merge_row, m):
    """Output row and partial range ``[first, last)`` of merge ``m`` of a merge map."""
    return merge_row[m], merge_indptr[m], merge_indptr[m + 1]


def stream_sum_writer(code: str, head_dim: int, threads: int, streams: int, sigmoid: bool):
    """Device function ``(tid, red, row, h, num_heads, mx, total, out, lse)``, the end of
    both partial-merge kernels: once a barrier has published ``red`` (the streams' sums,
    ``streams x head_dim``), add them in stream order into ``out[row, h]`` and write the
    LSE ``mx + log2(total)`` (-inf when ``mx`` is; NaN for sigmoid)."""
    key = ("writer", code, head_dim, threads, streams, sigmoid)
    if key not in KERNELS:
        D, NB, KS = head_dim, threads, streams
        _, store_elem, _ = element_io(code)

        @device_fn
        def write_row(tid, red, row, h, num_heads, mx, total, out, lse):
            for d in range(tid, D, NB):
                o = float32(0.0)
                for j in range(KS):
                    o += red[j * D + d]
                if not sigmoid and mx != mx:     # a NaN state among the merged ones (sigmoid
                    o = NR.NAN_F32               # states carry a NaN LSE by convention: their sums decide)
                store_elem(out, (int64(row) * num_heads + h) * D + d, o)
            if tid == 0:
                if sigmoid:
                    lse[int64(row) * num_heads + h] = float32(math.nan)
                else:
                    lse[int64(row) * num_heads + h] = NEG_INF if mx == NEG_INF else mx + math.log2(total)
        KERNELS[key] = write_row
    return KERNELS[key]


def partial_pieces(code: str, head_dim: int, vec: int, threads: int, streams: int, sigmoid: bool):
    """The device functions both partial-merge kernels are made of: ``(load_vec, weight,
    write_row)`` of :func:`vec_loader`, :func:`partial_weight`, :func:`stream_sum_writer`."""
    return (vec_loader(vec), partial_weight(sigmoid),
            stream_sum_writer(code, head_dim, threads, streams, sigmoid))


def partial_weight(sigmoid: bool):
    """Device function ``(lk, mx, inv) -> w``: a partial's weight in the sum of outputs,
    :func:`~nbattn.cuda.blocks.softmax.state_weight` (1 for sigmoid: its outputs add)."""
    key = ("weight", sigmoid)
    if key not in KERNELS:
        @device_fn
        def weight(lk, mx, inv):
            if sigmoid:
                return float32(1.0)
            return state_weight(lk, mx, inv)
        KERNELS[key] = weight
    return KERNELS[key]


def vec_loader(vw: int):
    """Device function ``(part, i, dst, off)``: ``vw`` floats of ``part`` at ``i`` into
    ``dst[off:]``, one 16-byte load when ``vw`` is 4."""
    key = ("load_vec", vw)
    if key not in KERNELS:
        @device_fn
        def load_vec(part, i, dst, off):
            if vw == 4:
                a, b, c, d = ld_v4(part, i)
                dst[off] = a
                dst[off + 1] = b
                dst[off + 2] = c
                dst[off + 3] = d
            else:
                dst[off] = part[i]
        KERNELS[key] = load_vec
    return KERNELS[key]


def partials_kernel(code: str, head_dim: int, use_sigmoid: bool, vec: int, threads: int,
                    fixed_grid: bool = False):
    """One CTA per (merge, head), in two passes so that no load waits on the
    previous partial.

    1. Every thread folds the LSEs of partials ``tid, tid + NB, ...`` into a
       running (max, sum of 2^(lse - max)); a fixed-shape tree in shared memory
       combines the NB pairs into the row's max M and total T.
    2. Thread ``(ks, x)`` sums ``w_k * o_k`` over partials ``ks, ks + KS, ...``
       for ``vec`` dims at ``x`` (16-byte loads when vec = 4), with
       ``w_k = 2^(lse_k - M) / T`` (weights normalized before they touch a
       vector: no overflow), four partials in flight per step; the KS sums
       are added in ks order.

    All-empty rows (M = -inf) give o = 0, lse = -inf.

    ``fixed_grid``: the kernel takes the merge count ``num_merges[0]`` (read on
    the device) as its first argument and CTA x merges ``x, x + gridDim.x, ...``,
    so one launch serves every plan (the plan/run wrappers' fixed grid)."""
    key = ("partials", code, head_dim, use_sigmoid, vec, threads, bool(fixed_grid))
    if key in KERNELS:
        return KERNELS[key]
    D, NB, SIGMOID, VW = head_dim, threads, use_sigmoid, vec
    DL = D // VW                 # vectors per row
    DT = min(DL, NB)             # threads along the row
    KS = NB // DT                # partial streams
    RED = max(KS * D, 1)
    ACC = 4 * VW                 # four partials in flight

    load_vec, weight, write_row = partial_pieces(code, D, VW, NB, KS, SIGMOID)

    @device_fn
    def merge_one(m, h, tid, red, sm_m, sm_l, acc, ov, part_o, part_lse, merge_indptr, merge_row, merge_slots,
                  out, lse, num_heads):
        row, first, last = merge_span(merge_indptr, merge_row, m)

        # pass 1: the row's max LSE and total mass (independent loads, tree combine)
        mx = NEG_INF
        inv = float32(0.0)
        if not SIGMOID:
            mt = NEG_INF
            lt = float32(0.0)
            for k in range(first + tid, last, NB):
                mt, lt = lse_fold(mt, lt, part_lse[int64(merge_slots[k]) * num_heads + h], float32(1.0))
            sm_m[tid] = mt
            sm_l[tid] = lt
            cuda.syncthreads()
            s = NB // 2
            while s > 0:
                if tid < s:
                    m2, l2 = lse_fold(sm_m[tid], sm_l[tid], sm_m[tid + s], sm_l[tid + s])
                    sm_m[tid] = m2
                    sm_l[tid] = l2
                cuda.syncthreads()
                s //= 2
            mx = sm_m[0]
            if mx != NEG_INF:
                inv = float32(1.0) / sm_l[0]

        # pass 2: weighted sums, four partials per step, KS streams added in order
        ks = tid // DT
        x0 = tid - ks * DT
        if ks < KS:
            for x in range(x0, DL, DT):
                for e in range(ACC):
                    acc[e] = 0.0
                k = first + ks
                while k + 3 * KS < last:
                    for u in range(4):
                        slot = int64(merge_slots[k + u * KS])
                        load_vec(part_o, (slot * num_heads + h) * D + x * VW, ov, u * VW)
                    for u in range(4):
                        slot = int64(merge_slots[k + u * KS])
                        w = weight(part_lse[slot * num_heads + h], mx, inv)
                        for e in range(VW):
                            acc[u * VW + e] += w * ov[u * VW + e]
                    k += 4 * KS
                while k < last:
                    slot = int64(merge_slots[k])
                    load_vec(part_o, (slot * num_heads + h) * D + x * VW, ov, 0)
                    w = weight(part_lse[slot * num_heads + h], mx, inv)
                    for e in range(VW):
                        acc[e] += w * ov[e]
                    k += KS
                for e in range(VW):
                    red[ks * D + x * VW + e] = (acc[e] + acc[VW + e]) + (acc[2 * VW + e] + acc[3 * VW + e])
        cuda.syncthreads()
        write_row(tid, red, row, h, num_heads, mx, sm_l[0], out, lse)

    if fixed_grid:
        def kernel(num_merges, part_o, part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads):
            red = cuda.shared.array(RED, np.float32)
            sm_m = cuda.shared.array(NB, np.float32)
            sm_l = cuda.shared.array(NB, np.float32)
            acc = cuda.local.array(ACC, np.float32)
            ov = cuda.local.array(ACC, np.float32)
            for m in range(cuda.blockIdx.x, num_merges[0], cuda.gridDim.x):
                merge_one(m, cuda.blockIdx.y, cuda.threadIdx.x, red, sm_m, sm_l, acc, ov, part_o, part_lse,
                          merge_indptr, merge_row, merge_slots, out, lse, num_heads)
                cuda.syncthreads()      # the next merge reuses the shared arrays
    else:
        def kernel(part_o, part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads):
            red = cuda.shared.array(RED, np.float32)
            sm_m = cuda.shared.array(NB, np.float32)
            sm_l = cuda.shared.array(NB, np.float32)
            acc = cuda.local.array(ACC, np.float32)
            ov = cuda.local.array(ACC, np.float32)
            merge_one(cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x, red, sm_m, sm_l, acc, ov, part_o,
                      part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads)

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]


def few_partials_kernel(code: str, head_dim: int, use_sigmoid: bool, vec: int, streams: int, cap: int,
                        programmatic: bool):
    """:func:`partials_kernel` for merges of at most ``cap <= FEW_CAP`` partials,
    shaped for latency (batch-1 split decode, the cascade's few levels): the
    launch sits between the decode kernel and the answer, so what counts is the
    chain of dependent loads, not bandwidth.

    One CTA per (merge, head), ``streams`` warps.  Every warp reads the LSEs
    itself, lane ``j`` the LSEs of partials ``j`` and ``j + 32``, and gets the
    row's max and mass by xor shuffles: no shared-memory tree, no barrier.
    Warp ``ks`` then sums partials ``ks, ks + streams, ...`` (all their loads
    issued before the first is used; each weight comes from the lane that read
    its LSE), and the streams' sums meet in shared memory, added in stream
    order.  Chain: merge bounds, slots, then the LSE and output loads side by
    side -- three rounds.  With ``programmatic`` the kernel waits for the
    kernel before it (the partials' writer) after reading the merge map, and may
    be launched programmatically (its ``programmatic`` attribute).  A row whose
    partials are all empty gets o = 0, LSE = -inf."""
    key = ("few", code, head_dim, use_sigmoid, vec, streams, cap, programmatic)
    if key in KERNELS:
        return KERNELS[key]
    D, VW, KS, SIGMOID = head_dim, vec, streams, use_sigmoid
    DL = D // VW                       # vectors per row
    XPL = -(-DL // 32)                 # vectors per lane
    PPS = -(-cap // KS)                # most partials per stream
    TWO = cap > 32                     # a second LSE per lane
    PDL = programmatic                 # launched programmatically: wait for the partials' writer
    NB = 32 * KS
    RED, OV, ACC = KS * D, PPS * XPL * VW, XPL * VW     # array sizes must be plain constants

    load_vec, weight, write_row = partial_pieces(code, D, VW, NB, KS, SIGMOID)

    def kernel(part_o, part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads):
        red = cuda.shared.array(RED, np.float32)
        ov = cuda.local.array(OV, np.float32)
        acc = cuda.local.array(ACC, np.float32)
        slots = cuda.local.array(PPS, np.int64)
        grid_dependents_launch()       # a programmatically launched next decode may start its prologue
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % 32
        ks = tid // 32
        row, first, last = merge_span(merge_indptr, merge_row, cuda.blockIdx.x)
        n = last - first
        # the merge map is the host's, not the decode kernel's: read it before the wait
        for i in range(PPS):
            j = ks + KS * i
            slots[i] = int64(merge_slots[first + j]) if j < n else int64(0)
        s1 = int64(merge_slots[first + lane]) if lane < n else int64(0)
        s2 = int64(merge_slots[first + lane + 32]) if TWO and lane + 32 < n else int64(0)
        if PDL:
            grid_dependency_wait()          # the partials are the previous kernel's

        # outputs of my stream's partials, loads in flight together with the LSEs
        for i in range(PPS):
            j = ks + KS * i
            for xi in range(XPL):
                x = lane + 32 * xi
                for e in range(VW):
                    ov[(i * XPL + xi) * VW + e] = 0.0
                if j < n and x < DL:
                    load_vec(part_o, (slots[i] * num_heads + h) * D + x * VW, ov, (i * XPL + xi) * VW)
        lk = NEG_INF
        lk2 = NEG_INF
        if lane < n:
            lk = part_lse[s1 * num_heads + h]
        if TWO and lane + 32 < n:
            lk2 = part_lse[s2 * num_heads + h]
        # M = max over the warp (NaN-sticky); T = sum 2^(lse - M); inv = 1 / T
        mx = NR.max_nan(lk, lk2)
        for b in range(5):
            mx = NR.max_nan(mx, shfl_xor_f32(mx, 1 << b))
        mass = state_mass(lk, mx)
        if lk2 != NEG_INF:
            mass += float32(math.exp2(lk2 - mx))
        for b in range(5):
            mass += shfl_xor_f32(mass, 1 << b)
        inv = float32(0.0) if mx == NEG_INF else float32(1.0) / mass

        for e in range(ACC):
            acc[e] = 0.0
        for i in range(PPS):
            j = ks + KS * i                                 # the same in every lane of the warp
            lj = shfl_idx_f32(lk if j < 32 else lk2, j % 32)  # every lane calls it (simulator: block-wide)
            w = weight(lj, mx, inv)
            if j < n:
                for e in range(ACC):
                    acc[e] += w * ov[i * ACC + e]
        for xi in range(XPL):
            x = lane + 32 * xi
            if x < DL:
                for e in range(VW):
                    red[ks * D + x * VW + e] = acc[xi * VW + e]
        cuda.syncthreads()
        write_row(tid, red, row, h, num_heads, mx, mass, out, lse)

    KERNELS[key] = jit_kernel(kernel)
    KERNELS[key].programmatic = PDL       # only a kernel that waits may be launched so
    return KERNELS[key]


def tile_merge_kernel(code: str, head_dim: int, use_sigmoid: bool):
    """Kernel folding each split query tile's partial slots into its final rows.

    Grid ``(num_ctas, num_kv_heads)``, fixed: the launch does not depend on the
    plan.  A unit of work is ``R`` consecutive rows of one merge's tile, with ``R``
    chosen on the device from the merge count ``num_merges[0]``: as few rows as
    give every CTA of the grid a unit (a plan with one merge spreads its rows over
    the grid), up to the whole tile when there are more merges than CTAs.  CTA x
    takes units ``x, x + gridDim.x, ...``.  Fused row ``f`` of tile ``t`` of request
    ``r`` is position ``f // group``, head ``kv_head*group + f % group``
    (docs/concepts/masks.md); in slot ``s`` its partial row is
    ``s*slot_rows + f//group - first_position``.  The prefill wrapper merges with it;
    the decode wrapper uses the split-KV contraction instead (:func:`partials_kernel`).

    Two passes per unit, like :func:`partials_kernel` and for the same reason:
    (1) ``J = NT // rows`` threads per row (``rows``: the rows of the merge's tile)
    fold the LSEs of partials ``j, j+J, ...`` into (max, mass), and one thread per
    row folds the J pairs from shared memory in j order; (2) each output element
    sums ``2^(lse_k - M) / T * o_k`` over its partials in KV order, four loads
    issued before they are used.  A row whose partials are all empty gets o = 0,
    LSE = -inf.  The order of every sum is the thread layout's, not the unit's, so
    the result does not depend on ``R``.
    """
    key = ("tile", code, head_dim, use_sigmoid)
    if key in KERNELS:
        return KERNELS[key]
    D, NT, SIGMOID = head_dim, tile_threads(), use_sigmoid
    RMAX = TILE_ROWS_MAX
    _, store_elem, _ = element_io(code)

    def kernel(num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots, qo_indptr,
               part_o, part_lse, out, lse, num_qo_heads, group, tile_q, slot_rows):
        sm_m = cuda.shared.array(NT, np.float32)
        sm_l = cuda.shared.array(NT, np.float32)
        row_m = cuda.shared.array(RMAX, np.float32)
        row_l = cuda.shared.array(RMAX, np.float32)
        tid = cuda.threadIdx.x
        kvh = cuda.blockIdx.y
        n_merges = num_merges[0]
        R = min(tile_q, max(1, (n_merges * tile_q + cuda.gridDim.x - 1) // cuda.gridDim.x))
        per_merge = (tile_q + R - 1) // R            # units of one merge
        for u in range(cuda.blockIdx.x, n_merges * per_merge, cuda.gridDim.x):
            m = u // per_merge
            r = merge_request[m]
            qo_start = qo_indptr[r]
            qo_len = qo_indptr[r + 1] - qo_start
            f0 = merge_qo_tile[m] * tile_q
            n_rows = min(tile_q, qo_len * group - f0)
            e_lo = (u - m * per_merge) * R
            e_hi = min(e_lo + R, n_rows)
            if e_lo >= n_rows:                # the same for every thread of the CTA
                continue
            p0 = f0 // group
            first = merge_indptr[m]
            last = merge_indptr[m + 1]

            # pass 1: each row's max LSE and total mass
            if not SIGMOID:
                J = max(1, NT // n_rows)
                rows_per_pass = NT // J
                for e0 in range(e_lo, e_hi, rows_per_pass):
                    e = e0 + tid // J
                    j = tid % J
                    mt = NEG_INF
                    lt = float32(0.0)
                    if tid // J < rows_per_pass and e < e_hi:
                        f = f0 + e
                        h = kvh * group + f % group
                        off = f // group - p0
                        for k in range(first + j, last, J):
                            prow = int64(merge_slots[k]) * slot_rows + off
                            mt, lt = lse_fold(mt, lt, part_lse[prow * num_qo_heads + h], float32(1.0))
                    sm_m[tid] = mt
                    sm_l[tid] = lt
                    cuda.syncthreads()
                    if tid < rows_per_pass and e0 + tid < e_hi:
                        mt = NEG_INF
                        lt = float32(0.0)
                        for i in range(J):
                            mt, lt = lse_fold(mt, lt, sm_m[tid * J + i], sm_l[tid * J + i])
                        row_m[e0 + tid - e_lo] = mt
                        row_l[e0 + tid - e_lo] = lt
                    cuda.syncthreads()

            # pass 2: weighted sums in KV order
            for idx in range(tid, (e_hi - e_lo) * D, NT):
                e = idx // D
                d = idx - e * D
                f = f0 + e_lo + e
                h = kvh * group + f % group
                off = f // group - p0
                o = float32(0.0)
                mx = NEG_INF
                inv = float32(0.0)
                if not SIGMOID:
                    mx = row_m[e]
                    if mx != NEG_INF:
                        inv = float32(1.0) / row_l[e]
                if SIGMOID or mx != NEG_INF:
                    k = first
                    while k + 3 < last:
                        r0 = int64(merge_slots[k]) * slot_rows + off
                        r1 = int64(merge_slots[k + 1]) * slot_rows + off
                        r2 = int64(merge_slots[k + 2]) * slot_rows + off
                        r3 = int64(merge_slots[k + 3]) * slot_rows + off
                        o0 = part_o[(r0 * num_qo_heads + h) * D + d]
                        o1 = part_o[(r1 * num_qo_heads + h) * D + d]
                        o2 = part_o[(r2 * num_qo_heads + h) * D + d]
                        o3 = part_o[(r3 * num_qo_heads + h) * D + d]
                        if SIGMOID:
                            o += o0
                            o += o1
                            o += o2
                            o += o3
                        else:
                            o += float32(math.exp2(part_lse[r0 * num_qo_heads + h] - mx)) * inv * o0
                            o += float32(math.exp2(part_lse[r1 * num_qo_heads + h] - mx)) * inv * o1
                            o += float32(math.exp2(part_lse[r2 * num_qo_heads + h] - mx)) * inv * o2
                            o += float32(math.exp2(part_lse[r3 * num_qo_heads + h] - mx)) * inv * o3
                        k += 4
                    while k < last:
                        r0 = int64(merge_slots[k]) * slot_rows + off
                        o0 = part_o[(r0 * num_qo_heads + h) * D + d]
                        if SIGMOID:
                            o += o0
                        else:
                            o += float32(math.exp2(part_lse[r0 * num_qo_heads + h] - mx)) * inv * o0
                        k += 1
                dst = int64(qo_start + f // group) * num_qo_heads + h
                store_elem(out, dst * D + d, o)
                if d == 0:
                    if SIGMOID:
                        lse[dst] = float32(math.nan)
                    elif mx == NEG_INF:
                        lse[dst] = NEG_INF
                    else:
                        lse[dst] = mx + math.log2(row_l[e])
            cuda.syncthreads()   # the next unit reuses row_m / row_l

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]
