"""The register-tiled CUDA-core prefill tile: the teaching tile's math on register micro-tiles.

It computes exactly :func:`nbattn.cuda.kernels.prefill_core.core_tile` -- same
signature, work list, shared pieces (:mod:`nbattn.cuda.kernels.prefill_common`)
and entries -- all fp32 on CUDA cores (FMA).  The simulator runs it (CI).  How it
differs from the teaching tile:

Rows belong to warps, not to the block.  ``NT = NW * 32`` threads (GPU): warp
``w`` owns the fused rows ``w*WR .. w*WR+WR-1`` of the ``T_q = NW*WR`` row tile,
whole -- their scores, softmax state and output -- so the softmax needs no
block-wide step.  A warp's lanes are an ``RG x CG`` grid (lane = rg*CG + cg), and
lane (rg, cg) holds in registers:

- an ``R x C`` micro-tile of S: rows ``rg + RG*i`` of its warp, keys
  ``cg + CG*c`` of the KV tile (``T_k = CG*C``);
- an ``R x D/CG`` micro-tile of O: the same rows, dims ``4cg + 4CG*k + (0..3)``;
- the running max ``m`` and its partial sum ``l`` of each of its rows (the CG
  lanes of a row add their ``l`` by shuffles at the end).

Rows and keys are interleaved (not blocked): the lanes of a warp read consecutive
padded rows of Q and K at once, in distinct banks.  The shapes a call may take are
:class:`nbattn.cuda.tuning.PrefillTuning` fields (:func:`cuda_core_tiles`).

Shared memory is one float array, Q | K | V | P, fp32, rows padded by 4 floats: Q
(T_q x D, once per work item), K and V (T_k x D each), P (per warp, T_k x WR: P
transposed).  Past :data:`STATIC_LIMIT` it is numba's dynamic shared array, of
size :func:`dynamic_smem`.  Every shared access of the inner loops is a 16-byte
vector (:func:`nbattn.cuda.blocks.primitives.ld_v4` / ``st_v4``).

Per KV tile (keys ``t0 .. t0+T_k-1``)::

    K(t0), V(t0) words (in registers since the last step) -> K, V as fp32; barrier
    issue the next tile's K and V 16-byte global loads into registers (they land
      while this step computes; PrefillTuning.prefetch_max_chunks)
    S = Q K^T; the variant per element, or one multiply by scale*log2(e) on whole
      tiles; online softmax in base 2 (row max over the CG lanes of a row by xor
      shuffles, p = 2^(s - m')); P -> the warp's P; warp barrier
    O = alpha O + P V; barrier (K, V and P are free for the next step)

The micro-kernels (S, softmax, P V, K/V fetch, write) are generated as
straight-line source per tile shape, the accumulators as named scalars and
tuples: a ``cuda.local.array`` stays in registers only if every loop indexing it
is unrolled, and the compiler does not unroll them all (docs/concepts/
generated_kernels.md; :func:`source` returns the text).

Simulator (CI): a "warp" is 2 x 4 threads (shuffles are the block-wide emulation
of :func:`nbattn.cuda.blocks.primitives.shfl_xor_f32`), 16-byte loads element loads.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, uint32

from ..blocks import mma as _mma
from ..blocks import nanrule as NR
from ..blocks.primitives import (SHARED_ALIGN, SIMULATOR, bf16x2_to_f32, device_fn, element_io, exp2f,
                                 f16x2_to_f32, f32_as_u32, ld_v4, shfl_xor_f32, st_v4, u32_as_f32, warp_sync)
from ..blocks.variants import LOG2E, sigmoid_weight
from ..tuning import PREFILL, PrefillTuning
from .prefill_common import (NO_KEY, KernelSpec, compile_functions, key_locator, kv_reader, tile_item, tile_rows,
                             tile_score, tile_skip, tile_thread, tup, warp_unmasked_keys)

__all__ = ["cuda_core_tiles", "cuda_core_tile", "covers", "launch_bounds", "dynamic_smem", "smem_floats",
           "smem_bytes", "source", "STATIC_LIMIT", "ELEMS_PER_16B"]

# Past STATIC_LIMIT bytes a tile's float arrays are one dynamic array (the launch passes
# the size, kernel attribute ``dynamic_smem``, and opts in past 48 KB).
STATIC_LIMIT = 48 * 1024 - 1024    # the static limit, minus the per-row int arrays and slack
ELEMS_PER_16B = {"f16": 8, "bf16": 8, "f32": 4}


def smem_floats(D: int, RG: int, CG: int, NW: int, C: int, R: int) -> tuple[int, int, int, int]:
    """Offsets (floats) of the K tile, the V tile and P in the tile's shared array
    (Q first), and its length: rows padded by 4 floats (``R`` rows per lane)."""
    T_q, T_k = NW * RG * R, CG * C
    off_k = T_q * (D + 4)
    off_v = off_k + T_k * (D + 4)
    off_p = off_v + T_k * (D + 4)
    return off_k, off_v, off_p, off_p + NW * T_k * RG * R


def smem_bytes(D: int, RG: int, CG: int, NW: int, C: int, R: int) -> int:
    """Bytes of the tile's shared float array (:func:`smem_floats`)."""
    return 4 * smem_floats(D, RG, CG, NW, C, R)[3]


def dynamic_smem(spec: KernelSpec) -> int:
    """Bytes of dynamic shared memory a launch of ``spec``'s kernel passes (0: the
    tile's arrays are static, or the spec is not this tile's)."""
    shape = _shape_of(spec)
    if shape is None or SIMULATOR:
        return 0
    n = smem_bytes(spec.head_dim, *shape, spec.tuning.rows_per_lane)
    return n if n > STATIC_LIMIT else 0


def _shapes(head_dim: int, kind: str, tuning: PrefillTuning) -> list:
    """The (RG, CG, NW, C) shapes this tile can build for (head_dim, kind):
    head_dim splits into 16-byte chunks per lane of O (D % (4*CG) == 0), the
    O micro-tile stays within 64 registers, Q, K/V and P fit ``tuning.smem_budget``,
    K/V tiles are at most ``tuning.max_tile_k`` keys, and a K/V tile's 16-byte
    chunks split evenly over the threads."""
    R = tuning.rows_per_lane
    D = int(head_dim)
    if kind not in ELEMS_PER_16B or D <= 0:
        return []
    out = []
    for RG, CG in tuning.lane_grids:
        if D % (4 * CG) or R * D // CG > 64:
            continue
        for NW in ((2,) if SIMULATOR else (4, 2)):
            for C in ((2,) if SIMULATOR else (8, 4, 2, 1)):
                chunks = CG * C * D // ELEMS_PER_16B[kind]
                if tuning.max_tile_k is not None and CG * C > tuning.max_tile_k:
                    continue
                if (smem_bytes(D, RG, CG, NW, C, R) <= tuning.smem_budget and R * C <= 32
                        and chunks % (NW * RG * CG) == 0):
                    out.append((RG, CG, NW, C))
    return out


def _tiles_of(RG: int, CG: int, NW: int, C: int, R: int) -> tuple[int, int, int]:
    return NW * RG * R, CG * C, NW * RG * CG


def _rank(shape, policy: str):
    """``"rows"``: 4 x 8 lanes, then the most warps, then the most keys a lane;
    ``"keys"``: 4 x 8 lanes, then the most keys a lane, then warps."""
    RG, CG, NW, C = shape
    if policy == "keys":
        return (CG == 8, C, NW)
    return (CG == 8, NW, C)


def cuda_core_tiles(head_dim: int, kind: str, tuning: PrefillTuning = PREFILL):
    """(T_q, T_k, threads) of this tile for (head_dim, kind) under ``tuning`` (the
    fitting shape ``tuning.policy`` ranks first), or None when it does not cover
    them or ``tuning.cuda_core`` is off (the caller falls back to ``core_tile``)."""
    if not tuning.cuda_core:
        return None
    shapes = _shapes(head_dim, kind, tuning)
    if not shapes:
        return None
    return _tiles_of(*max(shapes, key=lambda s: _rank(s, tuning.policy)), tuning.rows_per_lane)


def _shape_of(spec: KernelSpec):
    """(RG, CG, NW, C) of a spec sized for this tile, else None (tile sizes and
    thread count name one shape: checked for the defaults when the module loads)."""
    if spec.tensor_cores or not spec.tuning.cuda_core or spec.variant.has_rope or spec.custom_mask:
        return None
    R = spec.tuning.rows_per_lane
    for shape in _shapes(spec.head_dim, spec.kind, spec.tuning):
        if _tiles_of(*shape, R) == (spec.tile_q, spec.tile_k, spec.threads):
            return shape
    return None


def covers(spec: KernelSpec) -> bool:
    """True when ``spec`` was sized for this tile (``kernel_tiles`` chose it)."""
    return _shape_of(spec) is not None


def launch_bounds(spec: KernelSpec):
    """Launch bounds of this tile's kernels: None (the "rows" shape needs 246-250
    registers, so two 128-thread CTAs fit an SM whatever ptxas is told)."""
    return None


for _d in (32, 64, 96, 128, 256):
    for _k in ELEMS_PER_16B:
        _t = [_tiles_of(*sh, PREFILL.rows_per_lane) for sh in _shapes(_d, _k, PREFILL)]
        assert len(set(_t)) == len(_t), "two tile shapes with the same (T_q, T_k, threads)"


# ---------------------------------------------------------------------------
# 16-byte global loads with a simulator face
# ---------------------------------------------------------------------------

if SIMULATOR:
    def load16(arr, idx):
        """Four uint32 words of the 16 bytes at ``arr[idx]`` (last index along a row)."""
        head, d = tuple(idx[:-1]), int(idx[-1])
        if arr.dtype.itemsize == 2:
            return tuple(np.uint32(int(arr[head + (d + 2 * i,)]) | (int(arr[head + (d + 2 * i + 1,)]) << 16))
                         for i in range(4))
        return tuple(f32_as_u32(arr[head + (d + i,)]) for i in range(4))
else:  # pragma: no cover - needs a GPU
    load16 = _mma.load_u32x4


def _unpack_fn(kind: str):
    """Device function ``(w0, w1, w2, w3, dst, off)``: the words' elements as fp32
    into ``dst[off:]`` with 16-byte stores (8 values for 16-bit kinds, 4 for fp32)."""
    if kind == "f32":
        @device_fn
        def unpack(w0, w1, w2, w3, dst, off):
            st_v4(dst, off, u32_as_f32(w0), u32_as_f32(w1), u32_as_f32(w2), u32_as_f32(w3))
    else:
        pair = f16x2_to_f32 if kind == "f16" else bf16x2_to_f32

        @device_fn
        def unpack(w0, w1, w2, w3, dst, off):
            a0, a1 = pair(w0)
            a2, a3 = pair(w1)
            st_v4(dst, off, a0, a1, a2, a3)
            b0, b1 = pair(w2)
            b2, b3 = pair(w3)
            st_v4(dst, off + 4, b0, b1, b2, b3)
    return unpack


# ---------------------------------------------------------------------------
# Generated micro-kernels
# ---------------------------------------------------------------------------

class Layout(NamedTuple):
    """A build's shape: RG x CG lanes, NW warps, C keys and R rows a lane, head_dim D, WR rows
    a warp, row strides QS = KS, EPC elements a 16-byte chunk, CPR chunks a row, KPT a thread."""
    RG: int
    CG: int
    NW: int
    C: int
    R: int
    D: int
    WR: int
    QS: int
    KS: int
    EPC: int
    CPR: int
    KPT: int
    NT: int


def layout(spec: KernelSpec) -> Layout:
    """The :class:`Layout` of a spec sized for this tile."""
    shape = _shape_of(spec)
    assert shape is not None, "spec not sized for the register-tiled CUDA-core tile"
    RG, CG, NW, C = shape
    R, D, NT = spec.tuning.rows_per_lane, spec.head_dim, spec.threads
    EPC = ELEMS_PER_16B[spec.kind]    # elements per 16-byte chunk
    CPR = D // EPC                    # chunks per row
    assert (spec.tile_k * CPR) % NT == 0, "K/V tile chunks must split evenly over the threads"
    # padded rows: consecutive rows start 4 banks apart
    return Layout(RG, CG, NW, C, R, D, RG * R, D + 4, D + 4, EPC, CPR, spec.tile_k * CPR // NT, NT)


MICRO_NAMES = ("o_zero", "stats0", "qk", "scaled", "masked", "softmax", "poison", "put_p", "pv", "fetch",
               "refetch", "put_kv", "write")


def micro_source(lay: Layout, sigmoid: bool, unroll: tuple) -> str:
    """Source of the straight-line device functions of one tile shape (see the module doc;
    ``unroll`` = PrefillTuning.unroll):

    - ``o_zero()``: the zero O micro-tile (R*DPT floats, row-major);
    - ``qk(s_q, s_kv, qa, ka)``: S micro-tile (R*C floats, row-major) from
      ``s_q[qa + i*RG*QS + d]`` and ``s_kv[ka + c*CG*KS + d]``;
    - ``scaled(s, f)`` / ``masked(s, ...)``: interior tiles / the variant per element;
    - ``softmax(s, m, l)`` -> (p, m, l, alpha), R-tuples but p;
    - ``put_p(p, s_p, pa)``: P^T rows (key cg + CG*c) at ``s_p[pa + key*WR + i]``;
    - ``pv(o, s_p, s_kv, pa, va, alpha)``: O = alpha O + P V;
    - ``fetch(src, which, t0, hi, ...)`` -> (words, locs): the lane's KPT
      16-byte chunks of a K or V tile and where they live; ``refetch(src,
      which, locs, head, tid)`` reads the other of K/V at the same places;
      ``put_kv(words, locs, s_kv, base, s_kpos, tid, with_pos)`` stores them as
      fp32 from ``s_kv[base]`` on (the tile's K or V);
    - ``write(o, l, m, ...)``: o / l and the LSE of the lane's valid rows.
    """
    RG, CG, C, R, D, WR, QS, KS = lay.RG, lay.CG, lay.C, lay.R, lay.D, lay.WR, lay.QS, lay.KS
    EPC, CPR, KPT, NT = lay.EPC, lay.CPR, lay.KPT, lay.NT
    DPT = D // CG            # O dims per lane
    NCH = DPT // 4           # 16-byte chunks of a lane's O row
    S = [[f"s{i}_{c}" for c in range(C)] for i in range(R)]
    Sf = [x for row in S for x in row]
    O = [[f"o{i}_{x}" for x in range(DPT)] for i in range(R)]
    Of = [x for row in O for x in row]
    L = []
    L.append("def o_zero():")
    L.append("    z = float32(0.0)")
    L.append("    return " + tup(["z"] * len(Of)))

    # S = Q K^T: per 4 dims, R + C 16-byte loads feed 4*R*C FMAs; U chunks a loop
    # trip (unroll[0]), the trip count a constant.
    U = max(u for u in range(1, unroll[0] + 1) if (D // 4) % u == 0)
    L.append("def qk(s_q, s_kv, qa, ka):")
    L.append("    z = float32(0.0)")
    for x in Sf:
        L.append(f"    {x} = z")
    L.append(f"    for d in range(0, {D}, {4 * U}):")
    for u in range(U):
        for i in range(R):
            L.append(f"        q{i}_0, q{i}_1, q{i}_2, q{i}_3 = ld_v4(s_q, qa + {i * RG * QS + 4 * u} + d)")
        for c in range(C):
            L.append(f"        k{c}_0, k{c}_1, k{c}_2, k{c}_3 = ld_v4(s_kv, ka + {c * CG * KS + 4 * u} + d)")
        for e in range(4):
            for i in range(R):
                for c in range(C):
                    L.append(f"        {S[i][c]} = cuda.fma(q{i}_{e}, k{c}_{e}, {S[i][c]})")
    L.append("    return " + tup(Sf))

    L.append("def stats0():")
    L.append("    return " + tup(["neg_inf"] * R) + ", " + tup(["float32(0.0)"] * R))

    # x - x is 0 for a finite score and NaN for inf or NaN: the NaN rule without a branch
    L.append("def scaled(s, f):")
    L.append("    " + ", ".join(Sf) + ", = s")
    L.append("    return " + tup([f"{x} * f + ({x} - {x})" for x in Sf]))

    L.append("def masked(s, rbase, n_rows, kbase, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes):")
    L.append("    " + ", ".join(Sf) + ", = s")
    outs = []
    for i in range(R):
        for c in range(C):
            r = f"rbase + {i * RG}"
            outs.append(f"score({S[i][c]}, {r}, {r} < n_rows, kbase + {c * CG}, s_qpos, s_diag, s_req, "
                        f"s_kpos, head0, row0, slopes)")
    L.append("    return (" + ",\n            ".join(outs) + ",)")

    M = [f"m{i}" for i in range(R)]
    Lr = [f"l{i}" for i in range(R)]
    A = [f"alpha{i}" for i in range(R)]
    L.append("def softmax(s, m, l):")
    L.append("    " + ", ".join(Sf) + ", = s")
    L.append("    " + ", ".join(M) + ", = m")
    L.append("    " + ", ".join(Lr) + ", = l")
    if sigmoid:
        for x in Sf:
            L.append(f"    {x} = sigmoid_weight({x}, bias) if {x} != neg_inf else float32(0.0)")
        for a in A:
            L.append(f"    {a} = float32(1.0)")
    else:
        for i in range(R):
            L.append(f"    mx = {S[i][0]}")
            for x in S[i][1:]:
                L.append(f"    mx = max_nan(mx, {x})")
            mask = 1
            while mask < CG:            # the CG lanes of a row are lanes rg*CG + (0..CG-1)
                L.append(f"    mx = max_nan(mx, shfl_xor(mx, {mask}))")
                mask *= 2
            L.append(f"    new = max_nan(m{i}, mx)")
            # a row with no key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN
            L.append("    base = new if new != neg_inf else float32(0.0)")
            L.append(f"    alpha{i} = exp2(m{i} - base)")
            for x in S[i]:
                L.append(f"    {x} = exp2({x} - base)")
            L.append(f"    l{i} = l{i} * alpha{i} + (" + " + ".join(S[i]) + ")")
            L.append(f"    m{i} = new")
    L.append("    return " + tup(Sf) + ", " + tup(M) + ", " + tup(Lr) + ", " + tup(A))

    # The NaN rule: a non-finite V chunk is stored as zeros, its K chunk as NaN.
    KW = [f"w{n}_{x}" for n in range(KPT) for x in range(4)]
    VW = [f"x{n}_{x}" for n in range(KPT) for x in range(4)]
    L.append("def poison(kw, vw):")
    L.append("    " + ", ".join(KW) + ", = kw")
    L.append("    " + ", ".join(VW) + ", = vw")
    for n in range(KPT):
        ks, vs = ", ".join(KW[4 * n:4 * n + 4]), ", ".join(VW[4 * n:4 * n + 4])
        L.append(f"    {ks}, {vs} = poison_kv({ks}, {vs})")
    L.append("    return " + tup(KW) + ", " + tup(VW))

    L.append("def put_p(p, s_p, pa):")
    L.append("    " + ", ".join(Sf) + ", = p")
    for c in range(C):
        for i0 in range(0, R, 4):
            vals = ", ".join(S[i][c] for i in range(i0, i0 + 4))
            L.append(f"    st_v4(s_p, pa + {c * CG * WR + i0}, {vals})")
    L.append("    return 0")

    # O = alpha O + P V: per key, R/4 + NCH 16-byte loads feed R*DPT FMAs.
    T_k = CG * C
    UV = max(u for u in range(1, unroll[1] + 1) if T_k % u == 0)
    L.append("def pv(o, s_p, s_kv, pa, va, alpha):")
    L.append("    " + ", ".join(Of) + ", = o")
    L.append("    " + ", ".join(A) + ", = alpha")
    L.append("    one = float32(1.0)")
    L.append("    if " + " or ".join(f"{a} != one" for a in A) + ":")
    for i in range(R):
        for x in O[i]:
            L.append(f"        {x} = {x} * alpha{i}")
    L.append(f"    for j in range(0, {T_k}, {UV}):")
    for u in range(UV):
        for i0 in range(0, R, 4):
            L.append(f"        p{i0}, p{i0 + 1}, p{i0 + 2}, p{i0 + 3} = ld_v4(s_p, pa + (j + {u}) * {WR} + {i0})")
        for k in range(NCH):
            L.append(f"        v{k}_0, v{k}_1, v{k}_2, v{k}_3 = ld_v4(s_kv, va + (j + {u}) * {KS} + {4 * CG * k})")
        for k in range(NCH):
            for e in range(4):
                for i in range(R):
                    x = O[i][4 * k + e]
                    L.append(f"        {x} = cuda.fma(p{i}, v{k}_{e}, {x})")
    L.append("    return " + tup(Of))

    # K/V chunks: chunk e = tid + n*NT of the tile is key e // CPR, elements (e % CPR)*EPC ...
    W = [f"w{n}_{x}" for n in range(KPT) for x in range(4)]
    LOC = [f"{a}{n}" for n in range(KPT) for a in ("pg", "sl", "ps")]
    L.append("def fetch(src, which, t0, hi, kv_indices, kv_ptr, kv_base, block, n_keys, head, tid):")
    L.append("    zw = uint32(0)")
    for n in range(KPT):
        L.append(f"    e = tid + {n * NT}")
        L.append(f"    t = t0 + e // {CPR}")
        L.append(f"    d = (e % {CPR}) * {EPC}")
        L.append(f"    pg{n} = 0")
        L.append(f"    sl{n} = 0")
        L.append(f"    ps{n} = NO_KEY")
        L.append("    if t < hi:")
        L.append(f"        pg{n}, sl{n}, ps{n} = locate(kv_indices, kv_ptr, kv_base, t, block, n_keys)")
        L.append(f"    if ps{n} != NO_KEY:")
        L.append(f"        w{n}_0, w{n}_1, w{n}_2, w{n}_3 = kv(src, which, pg{n}, sl{n}, head, d)")
        L.append("    else:")
        L.append(f"        w{n}_0, w{n}_1, w{n}_2, w{n}_3 = zw, zw, zw, zw")
    L.append("    return " + tup(W) + ", " + tup(LOC))

    L.append("def refetch(src, which, locs, head, tid):")
    L.append("    " + ", ".join(LOC) + ", = locs")
    L.append("    zw = uint32(0)")
    for n in range(KPT):
        L.append(f"    d = ((tid + {n * NT}) % {CPR}) * {EPC}")
        L.append(f"    if ps{n} != NO_KEY:")
        L.append(f"        w{n}_0, w{n}_1, w{n}_2, w{n}_3 = kv(src, which, pg{n}, sl{n}, head, d)")
        L.append("    else:")
        L.append(f"        w{n}_0, w{n}_1, w{n}_2, w{n}_3 = zw, zw, zw, zw")
    L.append("    return " + tup(W))

    L.append("def put_kv(words, locs, s_kv, base, s_kpos, tid, with_pos):")
    L.append("    " + ", ".join(W) + ", = words")
    L.append("    " + ", ".join(LOC) + ", = locs")
    for n in range(KPT):
        L.append(f"    e = tid + {n * NT}")
        L.append(f"    j = e // {CPR}")
        L.append(f"    c = e % {CPR}")
        L.append(f"    unpack(w{n}_0, w{n}_1, w{n}_2, w{n}_3, s_kv, base + j * {KS} + c * {EPC})")
        L.append("    if with_pos and c == 0:")
        L.append(f"        s_kpos[j] = ps{n}")
    L.append("    return 0")

    # Write: rows rbase + i*RG, dims 4cg + 4CG*k + e.
    L.append("def write(o, l, m, rbase, n_rows, cg, qo_start, row0, out_shift, head0, out, lse):")
    L.append("    " + ", ".join(Of) + ", = o")
    L.append("    " + ", ".join(Lr) + ", = l")
    L.append("    " + ", ".join(M) + ", = m")
    for i in range(R):
        if not sigmoid:
            mask = 1
            while mask < CG:
                L.append(f"    l{i} += shfl_xor(l{i}, {mask})")
                mask *= 2
            # the NaN rule: a NaN max or sum is a poisoned row; a -inf max a row that saw no key
            L.append(f"    bad = m{i} != m{i} or l{i} != l{i}")
            L.append(f"    empty = m{i} == neg_inf")
            L.append(f"    inv = nan if bad else (float32(0.0) if empty else float32(1.0) / l{i})")
        else:
            L.append("    inv = float32(1.0)")
        L.append(f"    r = rbase + {i * RG}")
        L.append("    if r < n_rows:")
        L.append("        qi = qo_start + (row0 + r) // group")
        L.append("        h = head0 + (row0 + r) % group")
        for k in range(NCH):
            for e in range(4):
                L.append(f"        store(out, (qi + out_shift, h, 4 * cg + {4 * CG * k + e}), {O[i][4 * k + e]} * inv)")
        L.append("        if cg == 0:")
        if sigmoid:
            L.append("            lse[qi + out_shift, h] = math.nan")
        else:
            L.append(f"            lse[qi + out_shift, h] = nan if bad else (neg_inf if empty else m{i} + math.log2(l{i}))")
    L.append("    return 0")
    return "\n".join(L) + "\n"


def _micro_env(spec: KernelSpec, positional: bool, unpack) -> dict:
    """Globals of the generated micro-kernels of ``spec`` (``unpack``: :func:`_unpack_fn`'s)."""
    var = spec.variant
    _, store, _ = element_io(spec.out_kind)
    return dict(score=tile_score(spec, positional), locate=key_locator(spec.mode),
                kv=kv_reader(spec.mode, spec.kv_layout, load16), unpack=unpack, store=store,
                NO_KEY=NO_KEY, group=spec.group, bias=float32(var.sigmoid_bias), poison_kv=NR.poison_kv(spec.kind),
                float32=float32, uint32=uint32, math=math, ld_v4=ld_v4, st_v4=st_v4, cuda=cuda, exp2=exp2f,
                shfl_xor=shfl_xor_f32, sigmoid_weight=sigmoid_weight, neg_inf=float32(-math.inf),
                max_nan=NR.max_nan, nan=NR.NAN_F32)


def source(spec: KernelSpec) -> str:
    """The generated source of ``spec``'s micro-kernels (the text this tile compiles)."""
    return micro_source(layout(spec), spec.variant.use_sigmoid, spec.tuning.unroll)


# ---------------------------------------------------------------------------
# The tile
# ---------------------------------------------------------------------------

def cuda_core_tile(spec: KernelSpec):
    """The per-row body of a CUDA-core build sized by :func:`cuda_core_tiles`
    (launch: grid (n_work, num_kv_heads) or the persistent grid, ``spec.threads``)."""
    lay = layout(spec)
    RG, CG, NW, C, R, D, WR, QS, KS, EPC, CPR, KPT, NT = lay
    group = spec.group
    T_q, T_k = spec.tile_q, spec.tile_k
    WARP = RG * CG
    positional = spec.mode != "bsr"
    stage = tile_rows(spec, positional)
    item = tile_item(spec)
    thread = tile_thread(spec, WARP, CG)
    next_tile = tile_skip(T_k)
    unmasked_keys, inside = warp_unmasked_keys(spec, positional, WR)
    scale_log2 = float32(spec.variant.scale(D) * LOG2E)
    # Register prefetch of the next K/V tile overlaps its load with math but
    # holds 4*KPT words through S or P V; wide K/V tiles turn it off.
    prefetch = KPT <= spec.tuning.prefetch_max_chunks
    Q_CHUNKS = T_q * CPR
    Q_ITERS = -(-Q_CHUNKS // NT)
    OFF_K, OFF_V, OFF_P, SMEM = smem_floats(D, RG, CG, NW, C, R)
    DECL = 0 if dynamic_smem(spec) else SMEM      # 0: numba's dynamic shared array
    unpack = _unpack_fn(spec.kind)

    mk = compile_functions(micro_source(lay, spec.variant.use_sigmoid, spec.tuning.unroll),
                           f"cuda-core micro-kernels D={D} C={C}", _micro_env(spec, positional, unpack),
                           MICRO_NAMES)
    o_zero, stats0, qk, scaled = mk["o_zero"], mk["stats0"], mk["qk"], mk["scaled"]
    masked, softmax, poison = mk["masked"], mk["softmax"], mk["poison"]
    put_p, pv, fetch, refetch, put_kv, write = (mk["put_p"], mk["pv"], mk["fetch"], mk["refetch"], mk["put_kv"],
                                                mk["write"])

    @device_fn
    def tile(wi, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        tid, kv_head, head0, warp, lane, rg, cg = thread()
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, wi)
        sm = cuda.shared.array(DECL, float32, alignment=SHARED_ALIGN)   # Q | K | V | P (floats)
        s_kpos = cuda.shared.array(T_k, int32)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)      # q_idx - kvoff: last key t a causal row sees
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)

        # Q tile as fp32 (rows past the tile zero), per-row positions.
        for n in range(Q_ITERS):
            e = tid + n * NT
            if e < Q_CHUNKS:
                r = e // CPR
                d = (e % CPR) * EPC
                if r < n_rows:
                    w0, w1, w2, w3 = load16(q, (qo_start + (row0 + r) // group, head0 + (row0 + r) % group, d))
                else:
                    w0 = w1 = w2 = w3 = uint32(0)
                unpack(w0, w1, w2, w3, sm, r * QS + d)
        lo, hi, sink_end = stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
                                 s_qpos, s_diag, s_req, s_range)

        rbase = warp * WR + rg               # the lane's rows: rbase + i*RG
        u_lo, u_hi = unmasked_keys(s_diag, warp * WR, n_rows)    # keys this warp's rows all see, unmasked
        qa = rbase * QS
        ka = OFF_K + cg * KS
        pa = OFF_P + warp * (T_k * WR) + rg * R     # P^T of the warp; the lane's rows are contiguous
        va = OFF_V + 4 * cg

        t0 = next_tile(kv_begin, lo, sink_end)
        kw, locs = fetch(k_src, 0, t0, hi, kv_indices, kv_ptr, kv_base, block, n_keys, kv_head, tid)
        o = o_zero()
        m, l = stats0()
        vw = refetch(v_src, 1, locs, kv_head, tid)
        while t0 < hi:
            kw, vw = poison(kw, vw)
            put_kv(kw, locs, sm, OFF_K, s_kpos, tid, True)
            put_kv(vw, locs, sm, OFF_V, s_kpos, tid, False)
            cuda.syncthreads()                                   # K and V tiles in
            t1 = next_tile(t0 + T_k, lo, sink_end)
            if prefetch:                                         # in flight during S, softmax and P V
                kw, locs = fetch(k_src, 0, t1, hi, kv_indices, kv_ptr, kv_base, block, n_keys, kv_head, tid)
                vw = refetch(v_src, 1, locs, kv_head, tid)
            s = qk(sm, sm, qa, ka)
            last = t0 + T_k - 1
            if inside(t0, last, hi, u_lo, u_hi):
                s = scaled(s, scale_log2)
            else:
                s = masked(s, rbase, n_rows, cg, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
            p, m, l, alpha = softmax(s, m, l)
            put_p(p, sm, pa + cg * WR)
            warp_sync()                                          # P^T is the warp's own
            if not prefetch:
                kw, locs = fetch(k_src, 0, t1, hi, kv_indices, kv_ptr, kv_base, block, n_keys, kv_head, tid)
                vw = refetch(v_src, 1, locs, kv_head, tid)
            o = pv(o, sm, sm, pa, va, alpha)
            cuda.syncthreads()                                   # everyone done with K, V and P
            t0 = t1

        write(o, l, m, rbase, n_rows, cg, qo_start, row0, out_shift, head0, out, lse)

    return tile
