"""Merging attention states on the GPU (docs/concepts/state.md).

A state over a key set is ``(o, lse)``: the normalized output and the base-2
log-sum-exp.  Merging two disjoint sets weighs each output by its share of the
total exponent mass, normalized *before* combining so nothing overflows:

    m = max(lse_a, lse_b); a = 2^(lse_a - m); b = 2^(lse_b - m)
    o = a/(a+b) * o_a + b/(a+b) * o_b;   lse = m + log2(a + b)

Two empty states (lse = -inf) give an empty state (o = 0, lse = -inf), never
NaN.  A fold is always left to right in the order given -- no atomics -- so the
same inputs give bitwise the same output.  Sigmoid attention has no LSE: its
partial outputs simply add.

Launch shape: one CTA per (row, head).  The pair/fold kernels put threads over
head_dim and every thread computes the row's weights itself (a few flops).
The split-KV contraction (:func:`run_merge_partials`) folds many partials per
row, so it works in two passes with independent loads (see
:func:`_partials_kernel`): the order is still fixed by the thread layout.
When the caller knows that no merge has more than 64 partials (split decode,
cascade) a one-round form takes over (:func:`_few_partials_kernel`): every
warp folds the LSEs by shuffles, and split decode launches it
programmatically, so it is resident and has read its merge map before the
decode kernel ends (H200, batch 1 x 32k: 3.0 us alone against 4.9 us for the
two passes, ``benchmarks/results/decode_b1.json``).

Public (same signatures as :mod:`nbattn.reference`):
    merge_state(v_a, s_a, v_b, s_b) -> AttentionState(o, lse)
    merge_states(v, s)              -> AttentionState(o, lse)     v [rows, n, H, D]
    merge_state_in_place(v, s, v_other, s_other, mask=None) -> None

Internal entry point for split-KV runs (decode now; the scheduler's run() and
the prefill/cascade kernels later):
    MergeMap(merge_indptr, merge_row, merge_slots)   device int32 arrays (CSR)
    run_merge_partials(partial_o, partial_lse, merge_map, out, lse, *, code,
                       use_sigmoid=False, max_partials=None, stream=0)
        out[merge_row[m], h, :] / lse[merge_row[m], h] <- fold over slots
        merge_slots[merge_indptr[m]:merge_indptr[m+1]] of partial_o[slot, h, :]
        (float32 [slots, H, D]) and partial_lse[slot, h] (float32 [slots, H]);
        ``out`` is raw-typed (uint16 for 16-bit floats) [rows, H, D].
    merge_partials_launch(...same arguments, no stream...) -> (kernel, grid, threads, args)
        or None: what run_merge_partials launches, for callers that queue launches
        (nbattn.cuda.prefill.enqueue records them for replay).
    run_merge_tiles(num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots,
                    qo_indptr, partial_o, partial_lse, out, lse, *, code, head_dim,
                    num_qo_heads, num_kv_heads, group, tile_q, slot_rows, num_ctas,
                    per_request_row=False, use_sigmoid=False, stream=0)
        the fixed-grid form the plan/run wrappers use (CUDA-graph capturable): grid
        (num_ctas, num_kv_heads) whatever the plan, merge count read on the device
        from ``num_merges[0]``; a merge is one query tile of fused rows (see
        :func:`tile_merge_kernel`).
    merge_weights                 the device function (la, lb) -> (wa, wb, lse)
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from numba import cuda, float32, int64

from ..layout import LayoutError, dtype_of, to_numpy
from ..reference.state import AttentionState
from .host import arrays as A
from .host.driver import jit_kernel, launch_programmatic
from .blocks.mma import grid_dependency_wait, grid_dependents_launch
from .blocks.primitives import SIMULATOR, device_fn, element_io, ld_v4, shfl_idx_f32, shfl_xor_f32
from .blocks import nanrule as NR

__all__ = ["merge_state", "merge_states", "merge_state_in_place", "MergeMap", "run_merge_partials",
           "merge_partials_launch", "run_merge_tiles", "tile_merge_kernel", "merge_weights"]

NEG_INF = float32(-math.inf)


class MergeMap(NamedTuple):
    """Reduction map (CSR over merged outputs), device int32 arrays."""
    merge_indptr: Any
    merge_row: Any
    merge_slots: Any


@device_fn
def merge_weights(la, lb):
    """Normalized weights of two states and the merged LSE (empty+empty -> 0, 0, -inf;
    a NaN LSE -> NaN, NaN, NaN: a merge of a NaN state is NaN)."""
    if la != la or lb != lb:
        return NR.NAN_F32, NR.NAN_F32, NR.NAN_F32
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
    if m1 != m1 or m2 != m2:
        return NR.NAN_F32, NR.NAN_F32
    mm = max(m1, m2)
    if mm == NEG_INF:
        return NEG_INF, float32(0.0)
    return mm, l1 * math.exp2(m1 - mm) + l2 * math.exp2(m2 - mm)


def _threads(head_dim: int) -> int:
    if SIMULATOR:
        return min(head_dim, 8)
    return min(128, -(-head_dim // 32) * 32)


def _partials_threads(per_merge: float) -> int:
    """Threads per CTA of run_merge_partials (a power of two: the LSE pass is a
    tree): one warp for a few partials a row (batch decode splits in two:
    thousands of small CTAs), eight for many (batch 1: one row, ~64 partials)."""
    if SIMULATOR:
        return 8
    return 32 if per_merge <= 8 else 256

_kernels: dict = {}


def _stream_sum_writer(code: str, head_dim: int, threads: int, streams: int, sigmoid: bool):
    """Device function ``(tid, red, row, h, num_heads, mx, total, out, lse)``, the end of
    both partial-merge kernels: once a barrier has published ``red`` (the streams' sums,
    ``streams x head_dim``), add them in stream order into ``out[row, h]`` and write the
    LSE ``mx + log2(total)`` (-inf when ``mx`` is; NaN for sigmoid)."""
    key = ("writer", code, head_dim, threads, streams, sigmoid)
    if key not in _kernels:
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
        _kernels[key] = write_row
    return _kernels[key]


def _vec_loader(vw: int):
    """Device function ``(part, i, dst, off)``: ``vw`` floats of ``part`` at ``i`` into
    ``dst[off:]``, one 16-byte load when ``vw`` is 4."""
    key = ("load_vec", vw)
    if key not in _kernels:
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
        _kernels[key] = load_vec
    return _kernels[key]


def _jit(fn):
    return jit_kernel(fn)


def _partials_kernel(code: str, head_dim: int, use_sigmoid: bool, vec: int, threads: int):
    """One CTA per (merge, head), in two passes so that no load waits on the
    previous partial (a left fold is a chain of dependent loads, ~0.5 us per
    partial on an H200: 66 partials of a 32k batch-1 split cost more than the
    decode itself).

    1. Every thread folds the LSEs of partials ``tid, tid + NB, ...`` into a
       running (max, sum of 2^(lse - max)); a fixed-shape tree in shared memory
       combines the NB pairs into the row's max M and total T.
    2. Thread ``(ks, x)`` sums ``w_k * o_k`` over partials ``ks, ks + KS, ...``
       for ``vec`` dims at ``x`` (16-byte loads when vec = 4), with
       ``w_k = 2^(lse_k - M) / T`` (weights normalized before they touch a
       vector: no overflow), four partials in flight per step; the KS sums
       are added in ks order.

    Every order is fixed by the thread layout: the same inputs give bitwise
    the same output.  All-empty rows (M = -inf) give o = 0, lse = -inf."""
    key = ("partials", code, head_dim, use_sigmoid, vec, threads)
    if key in _kernels:
        return _kernels[key]
    D, NB, SIGMOID, VW = head_dim, threads, use_sigmoid, vec
    DL = D // VW                 # vectors per row
    DT = min(DL, NB)             # threads along the row
    KS = NB // DT                # partial streams
    RED = max(KS * D, 1)
    ACC = 4 * VW                 # four partials in flight

    @device_fn
    def weight(lk, mx, inv):
        if SIGMOID:
            return float32(1.0)
        if lk == NEG_INF:
            return float32(0.0)
        return float32(math.exp2(lk - mx)) * inv

    load_vec = _vec_loader(VW)
    write_row = _stream_sum_writer(code, D, NB, KS, SIGMOID)

    def kernel(part_o, part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads):
        red = cuda.shared.array(RED, np.float32)
        sm_m = cuda.shared.array(NB, np.float32)
        sm_l = cuda.shared.array(NB, np.float32)
        acc = cuda.local.array(ACC, np.float32)
        ov = cuda.local.array(ACC, np.float32)
        m = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        row = merge_row[m]
        first = merge_indptr[m]
        last = merge_indptr[m + 1]

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

    _kernels[key] = _jit(kernel)
    return _kernels[key]


# Most partials per merge the one-round form (:func:`_few_partials_kernel`) takes: two per lane.
FEW_PARTIALS = 64
# Whether callers' max_partials may pick that form.  Off in the simulator, where each of its
# 32-lane warps is 32 Python threads and every shuffle two block barriers (minutes per decode
# test); tests/test_cuda_merge.py turns it on to check the form there.
FEW_FORM = not SIMULATOR
# Whether that form is launched with programmatic stream serialization (sm_90, PTX
# griddepcontrol): its CTAs start while the kernel that writes the partials (the split
# decode, which lets them start early) runs, read the merge map, and wait there for the
# partials -- the merge's launch and first loads leave the critical path.
FEW_PROGRAMMATIC = not SIMULATOR


def _few_partials_kernel(code: str, head_dim: int, use_sigmoid: bool, vec: int, streams: int, cap: int):
    """:func:`_partials_kernel` for merges of at most ``cap <= FEW_PARTIALS`` partials,
    shaped for latency (batch-1 split decode, the cascade's few levels): the
    launch sits between the decode kernel and the answer, so what counts is the
    chain of dependent loads, not bandwidth.

    One CTA per (merge, head), ``streams`` warps.  Every warp reads the LSEs
    itself, lane ``j`` the LSEs of partials ``j`` and ``j + 32``, and gets the
    row's max and mass by xor shuffles: no shared-memory tree, no barrier.
    Warp ``ks`` then sums partials ``ks, ks + streams, ...`` (all their loads
    issued before the first is used; each weight comes from the lane that read
    its LSE), and the streams' sums meet in shared memory, added in stream
    order.  Chain: merge
    bounds, slots, then the LSE and output loads side by side -- three rounds.
    Orders are fixed by the thread layout: equal inputs give bitwise equal
    outputs; a row whose partials are all empty gets o = 0, LSE = -inf."""
    key = ("few", code, head_dim, use_sigmoid, vec, streams, cap, FEW_PROGRAMMATIC)
    if key in _kernels:
        return _kernels[key]
    D, VW, KS, SIGMOID = head_dim, vec, streams, use_sigmoid
    DL = D // VW                       # vectors per row
    XPL = -(-DL // 32)                 # vectors per lane
    PPS = -(-cap // KS)                # most partials per stream
    TWO = cap > 32                     # a second LSE per lane
    PDL = FEW_PROGRAMMATIC             # launched programmatically: wait for the partials' writer
    NB = 32 * KS
    RED, OV, ACC = KS * D, PPS * XPL * VW, XPL * VW     # array sizes must be plain constants

    load_vec = _vec_loader(VW)
    write_row = _stream_sum_writer(code, D, NB, KS, SIGMOID)

    def kernel(part_o, part_lse, merge_indptr, merge_row, merge_slots, out, lse, num_heads):
        red = cuda.shared.array(RED, np.float32)
        ov = cuda.local.array(OV, np.float32)
        acc = cuda.local.array(ACC, np.float32)
        slots = cuda.local.array(PPS, np.int64)
        grid_dependents_launch()       # a programmatically launched next decode may start its prologue
        m = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        lane = tid % 32
        ks = tid // 32
        row = merge_row[m]
        first = merge_indptr[m]
        n = merge_indptr[m + 1] - first
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
        mx = NR.max_nan(lk, lk2)
        for b in range(5):
            mx = NR.max_nan(mx, shfl_xor_f32(mx, 1 << b))
        mass = float32(0.0) if lk == NEG_INF else float32(math.exp2(lk - mx))
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
            w = float32(1.0) if SIGMOID else (float32(0.0) if lj == NEG_INF
                                             else float32(math.exp2(lj - mx)) * inv)
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

    _kernels[key] = _jit(kernel)
    _kernels[key].programmatic = PDL       # only a kernel that waits may be launched so
    return _kernels[key]


def merge_partials_launch(partial_o, partial_lse, merge_map: MergeMap, out, lse, *, code: str,
                          use_sigmoid: bool = False, max_partials: int | None = None):
    """``(kernel, grid, threads, args)`` of :func:`run_merge_partials`; None when
    there is nothing to merge.  ``max_partials`` (the most partials any merge
    has, when the caller knows it) picks the one-round form for up to
    ``FEW_PARTIALS``."""
    m = int(merge_map.merge_row.shape[0])
    if m == 0:
        return None
    num_heads, head_dim = int(partial_o.shape[1]), int(partial_o.shape[2])
    po = A.flat(partial_o)
    vec = 4 if head_dim % 4 == 0 and (SIMULATOR or po.__cuda_array_interface__["data"][0] % 16 == 0) else 1
    if FEW_FORM and max_partials is not None and max_partials <= FEW_PARTIALS:
        cap = 1 << max(1, int(max_partials) - 1).bit_length()     # builds for 2, 4, ..., 64
        streams = 1 if cap <= 2 else (2 if cap <= 4 else (4 if cap <= 32 else 8))
        k = _few_partials_kernel(code, head_dim, bool(use_sigmoid), vec, streams, cap)
        nb = 32 * streams
    else:
        nb = _partials_threads(int(partial_o.shape[0]) / m)
        k = _partials_kernel(code, head_dim, bool(use_sigmoid), vec, nb)
    return k, (m, num_heads), nb, (
        po, A.flat(partial_lse), merge_map.merge_indptr, merge_map.merge_row,
        merge_map.merge_slots, A.flat(out), A.flat(lse), num_heads)


def run_merge_partials(partial_o, partial_lse, merge_map: MergeMap, out, lse, *, code: str,
                       use_sigmoid: bool = False, max_partials: int | None = None, stream=0) -> None:
    """Fold partial slots into final rows (see module doc). Asynchronous on ``stream``."""
    launch = merge_partials_launch(partial_o, partial_lse, merge_map, out, lse, code=code,
                                   use_sigmoid=use_sigmoid, max_partials=max_partials)
    if launch is not None:
        kernel, grid, threads, args = launch
        if not (getattr(kernel, "programmatic", False)
                and launch_programmatic(kernel, grid, threads, stream, args)):
            kernel[grid, threads, stream](*args)


# ---------------------------------------------------------------------------
# Fixed grid (plan/run wrappers): merges of whole query tiles, count on the device
# ---------------------------------------------------------------------------

def _tile_threads() -> int:
    return 16 if SIMULATOR else 128


TILE_ROWS_MAX = 128   # the largest query tile (docs/concepts/scheduler.md: T_q <= 128)


def tile_merge_kernel(code: str, head_dim: int, per_request_row: bool, use_sigmoid: bool):
    """Kernel folding each split query tile's partial slots into its final rows.

    Grid ``(num_ctas, num_kv_heads)``, fixed: CTA x handles merges
    ``x, x + gridDim.x, ...`` below ``num_merges[0]``, so the launch does not
    depend on the plan.  Fused row ``f`` of tile ``t`` of request ``r`` is
    position ``f // group``, head ``kv_head*group + f % group`` (docs/concepts/masks.md);
    in slot ``s`` its partial row is ``s*slot_rows + f//group - first_position``.
    With ``per_request_row`` (decode) request r has one row, row r
    (``qo_indptr`` is not read), and a slot holds one row.

    Two passes per merge, like :func:`_partials_kernel` and for the same reason
    (a left fold over partials is a chain of dependent loads, ~0.5 us each):
    (1) ``J = NT // rows`` threads per row fold the LSEs of partials ``j, j+J,
    ...`` into (max, mass), and one thread per row folds the J pairs from shared
    memory in j order; (2) each output element sums ``2^(lse_k - M) / T * o_k``
    over its partials in KV order, four loads issued before they are used.
    Every order is fixed, so equal inputs give bitwise equal outputs; a row
    whose partials are all empty gets o = 0, LSE = -inf.
    """
    key = ("tile", code, head_dim, per_request_row, use_sigmoid)
    if key in _kernels:
        return _kernels[key]
    D, NT, DECODE, SIGMOID = head_dim, _tile_threads(), per_request_row, use_sigmoid
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
        for m in range(cuda.blockIdx.x, num_merges[0], cuda.gridDim.x):
            r = merge_request[m]
            if DECODE:
                qo_start = r
                qo_len = 1
            else:
                qo_start = qo_indptr[r]
                qo_len = qo_indptr[r + 1] - qo_start
            f0 = merge_qo_tile[m] * tile_q
            n_rows = min(tile_q, qo_len * group - f0)
            p0 = f0 // group
            first = merge_indptr[m]
            last = merge_indptr[m + 1]

            # pass 1: each row's max LSE and total mass
            if not SIGMOID:
                J = max(1, NT // n_rows)
                rows_per_pass = NT // J
                for e0 in range(0, n_rows, rows_per_pass):
                    e = e0 + tid // J
                    j = tid % J
                    mt = NEG_INF
                    lt = float32(0.0)
                    if tid // J < rows_per_pass and e < n_rows:
                        f = f0 + e
                        h = kvh * group + f % group
                        off = f // group - p0
                        for k in range(first + j, last, J):
                            prow = int64(merge_slots[k]) * slot_rows + off
                            mt, lt = lse_fold(mt, lt, part_lse[prow * num_qo_heads + h], float32(1.0))
                    sm_m[tid] = mt
                    sm_l[tid] = lt
                    cuda.syncthreads()
                    if tid < rows_per_pass and e0 + tid < n_rows:
                        mt = NEG_INF
                        lt = float32(0.0)
                        for i in range(J):
                            mt, lt = lse_fold(mt, lt, sm_m[tid * J + i], sm_l[tid * J + i])
                        row_m[e0 + tid] = mt
                        row_l[e0 + tid] = lt
                    cuda.syncthreads()

            # pass 2: weighted sums in KV order
            for idx in range(tid, n_rows * D, NT):
                e = idx // D
                d = idx - e * D
                f = f0 + e
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
            cuda.syncthreads()   # the next merge reuses row_m / row_l

    _kernels[key] = _jit(kernel)
    return _kernels[key]


def merge_tiles_launch(num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots, qo_indptr,
                       partial_o, partial_lse, out, lse, *, code: str, head_dim: int, num_qo_heads: int,
                       num_kv_heads: int, group: int, tile_q: int, slot_rows: int, num_ctas: int,
                       per_request_row: bool = False, use_sigmoid: bool = False):
    """``(kernel, grid, threads, args)`` of :func:`tile_merge_kernel` on its fixed grid
    (see module doc); every array is a flat device array (``out`` raw-typed, at
    ``args[8]``; ``lse`` at ``args[9]``)."""
    if tile_q > TILE_ROWS_MAX:
        raise ValueError(f"tile_q: at most {TILE_ROWS_MAX} rows per merged tile, got {tile_q}")
    k = tile_merge_kernel(code, head_dim, bool(per_request_row), bool(use_sigmoid))
    return k, (num_ctas, num_kv_heads), _tile_threads(), (
        num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots, qo_indptr, partial_o,
        partial_lse, out, lse, num_qo_heads, group, tile_q, slot_rows)


def run_merge_tiles(*args, stream=0, **kw) -> None:
    """Launch :func:`merge_tiles_launch`'s kernel, asynchronously on ``stream``."""
    k, grid, threads, a = merge_tiles_launch(*args, **kw)
    k[grid, threads, stream](*a)


def _fold_kernel(code: str, head_dim: int):
    key = ("fold", code, head_dim)
    if key in _kernels:
        return _kernels[key]
    D, NB = head_dim, _threads(head_dim)
    load_elem, store_elem, _ = element_io(code)

    def kernel(v, s, num_states, num_heads, out, lse):
        r = int64(cuda.blockIdx.x)
        h = cuda.blockIdx.y
        for d in range(cuda.threadIdx.x, D, NB):
            o = float32(0.0)
            l = NEG_INF
            for i in range(num_states):
                wa, wb, l = merge_weights(l, s[(r * num_states + i) * num_heads + h])
                o = wa * o + wb * load_elem(v, ((r * num_states + i) * num_heads + h) * D + d)
            store_elem(out, (r * num_heads + h) * D + d, o)
            if d == 0:
                lse[r * num_heads + h] = l

    _kernels[key] = _jit(kernel)
    return _kernels[key]


def _pair_kernel(code: str, head_dim: int):
    key = ("pair", code, head_dim)
    if key in _kernels:
        return _kernels[key]
    D, NB = head_dim, _threads(head_dim)
    load_elem, store_elem, _ = element_io(code)

    def kernel(va, sa, vb, sb, out, out_s, mask, use_mask):
        n = int64(cuda.blockIdx.x)
        active = (not use_mask) or mask[n] != 0
        wa, wb, l = merge_weights(sa[n], sb[n])
        cuda.syncthreads()  # in place: every thread has read sa[n] before it is overwritten
        if active:
            for d in range(cuda.threadIdx.x, D, NB):
                o = wa * load_elem(va, n * D + d) + wb * load_elem(vb, n * D + d)
                store_elem(out, n * D + d, o)
            if cuda.threadIdx.x == 0:
                out_s[n] = l

    _kernels[key] = _jit(kernel)
    return _kernels[key]


# ---------------------------------------------------------------------------
# Public wrappers: validate, move, launch, return
# ---------------------------------------------------------------------------

def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _check_lse_dtype(name: str, s: Any) -> None:
    if dtype_of(s) != "float32":
        raise LayoutError(f"{name}: LSE must be float32, got {dtype_of(s)}")


def _kinds(**arrays) -> str:
    kinds = {n: A.kind_of(x) for n, x in arrays.items() if x is not None}
    dev = {n: A.is_device_kind(k) for n, k in kinds.items()}
    if len(set(dev.values())) > 1:
        listing = ", ".join(f"{n} {'device' if d else 'host'}" for n, d in dev.items())
        raise LayoutError(f"{list(kinds)[-1]}: all arrays must be on one device, got {listing}")
    return next(iter(kinds.values()))


def _empty_check(head_dim: int, name: str) -> None:
    if head_dim < 1:
        raise LayoutError(f"{name}: head_dim must be >= 1")


def _array_arg(name: str, x) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise LayoutError(f"{name}: must be an array or tensor (NumPy, torch, numba device), "
                          f"got {type(x).__name__}")


def _check_pair(names: tuple[str, str, str, str], v, s, v2, s2) -> str:
    """Dtype code of two states ``(v, s)``, ``(v2, s2)`` that must agree in shape
    and type; ``names`` are the arguments' names for the error messages."""
    nv, ns, nv2, ns2 = names
    for n, x in zip(names, (v, s, v2, s2)):
        _array_arg(n, x)
    if _shape(v) != _shape(v2) or _shape(s) != _shape(s2) or _shape(v)[:-1] != _shape(s):
        raise LayoutError(f"{nv2}: shapes must match, got {nv} {_shape(v)}, {ns} {_shape(s)}, "
                          f"{nv2} {_shape(v2)}, {ns2} {_shape(s2)}")
    code = A.dtype_code(v, nv)
    if A.dtype_code(v2, nv2) != code:
        raise LayoutError(f"{nv2}: dtype must match {nv}, got {dtype_of(v)} and {dtype_of(v2)}")
    _check_lse_dtype(ns, s)
    _check_lse_dtype(ns2, s2)
    return code


def merge_state(v_a, s_a, v_b, s_b) -> AttentionState:
    """Merge the states of two disjoint key sets: ``v [..., D]``, ``s [...]`` (base 2)."""
    code = _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
    kind = _kinds(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    D = _shape(v_a)[-1]
    _empty_check(D, "v_a")
    stream = A.launch_stream(v_a, s_a, v_b, s_b)
    da, db = A.to_device(v_a, "v_a", stream, code), A.to_device(v_b, "v_b", stream, code)
    la, lb = A.to_device(s_a, "s_a", stream, "f32"), A.to_device(s_b, "s_b", stream, "f32")
    o_user, o_dev = A.new_output(kind, _shape(v_a), code, stream, like=v_a)
    l_user, l_dev = A.new_output(kind, _shape(s_a), "f32", stream, like=v_a)
    rows = int(np.prod(_shape(s_a)))
    if rows:
        dummy = cuda.device_array(1, np.uint8, stream=stream)
        _pair_kernel(code, D)[rows, _threads(D), stream](
            A.flat(da), A.flat(la), A.flat(db), A.flat(lb), A.flat(o_dev), A.flat(l_dev), dummy, False)
    return AttentionState(A.finish(kind, o_user, o_dev, code, stream),
                          A.finish(kind, l_user, l_dev, "f32", stream))


def merge_states(v, s) -> AttentionState:
    """Merge ``num_states`` states per row in axis-1 order:
    ``v [rows, num_states, num_heads, head_dim]``, ``s [rows, num_states, num_heads]``."""
    _array_arg("v", v)
    _array_arg("s", s)
    sv, ss = _shape(v), _shape(s)
    if len(sv) != 4 or ss != sv[:3]:
        raise LayoutError(f"v: must be [rows, num_states, num_heads, head_dim] with s "
                          f"[rows, num_states, num_heads], got {sv} and {ss}")
    code = A.dtype_code(v, "v")
    _check_lse_dtype("s", s)
    kind = _kinds(v=v, s=s)
    rows, n, H, D = sv
    _empty_check(D, "v")
    stream = A.launch_stream(v, s)
    dv, ds = A.to_device(v, "v", stream, code), A.to_device(s, "s", stream, "f32")
    o_user, o_dev = A.new_output(kind, (rows, H, D), code, stream, like=v)
    l_user, l_dev = A.new_output(kind, (rows, H), "f32", stream, like=v)
    if rows and H:
        _fold_kernel(code, D)[(rows, H), _threads(D), stream](
            A.flat(dv), A.flat(ds), n, H, A.flat(o_dev), A.flat(l_dev))
    return AttentionState(A.finish(kind, o_user, o_dev, code, stream),
                          A.finish(kind, l_user, l_dev, "f32", stream))


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))``; rows where the boolean
    ``mask [rows]`` (over the first axis of s) is False are left unchanged."""
    code = _check_pair(("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    A.check_writeable("v", v)
    A.check_writeable("s", s)
    rows = int(np.prod(_shape(s)))
    lead = _shape(s)[0] if _shape(s) else 1
    if mask is not None and _shape(mask) != (lead,):
        raise LayoutError(f"mask: must be a boolean [rows] with rows = {lead} (the first axis of s), "
                          f"got shape {_shape(mask)}")
    kind = _kinds(v=v, s=s, v_other=v_other, s_other=s_other)   # mask may live on the host
    D = _shape(v)[-1]
    _empty_check(D, "v")
    if A.is_device_kind(kind):
        A.check_contiguous(v, "v")
        A.check_contiguous(s, "s")
    stream = A.launch_stream(v, s, v_other, s_other)
    dv, ds = A.to_device(v, "v", stream, code), A.to_device(s, "s", stream, "f32")
    do, dso = A.to_device(v_other, "v_other", stream, code), A.to_device(s_other, "s_other", stream, "f32")
    if mask is None:
        dmask, use = cuda.device_array(1, np.uint8, stream=stream), False
    else:
        per_row = np.repeat(np.asarray(to_numpy(mask)).astype(np.uint8), rows // max(lead, 1))
        dmask, use = cuda.to_device(np.ascontiguousarray(per_row), stream=stream), True
    if rows:
        _pair_kernel(code, D)[rows, _threads(D), stream](
            A.flat(dv), A.flat(ds), A.flat(do), A.flat(dso), A.flat(dv), A.flat(ds), dmask, use)
    if not A.is_device_kind(kind):  # host arrays: write the result back into them
        A.copy_into_host(v, dv.copy_to_host(stream=stream).view(A.NP_DTYPE[code]))
        A.copy_into_host(s, ds.copy_to_host(stream=stream))
