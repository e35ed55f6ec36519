"""The mma.sync prefill tile (GPU only, fp16/bf16; head dims other than 64 and 128).

It computes exactly :func:`nbattn.cuda.kernels.prefill_core.core_tile` -- same
work list, launch, arguments and shared pieces
(:mod:`nbattn.cuda.kernels.prefill_common`) -- and differs from it in where the
math runs:

- rows belong to warps: 16 fused rows per warp, so the softmax state of a row is
  held by the 4 lanes of a quad (row max and sum by quad shuffles) and no
  block-wide step is needed;
- ``S = Q K^T`` and ``O += P V`` run on the tensor cores (``mma.sync.m16n8k16``,
  :mod:`nbattn.cuda.blocks.mma`) in fp16/bf16 with fp32 accumulators; the
  softmax works on the accumulator fragments, and P is fed to the second product
  straight from registers (the C layout of two n-tiles is the A layout);
- K is staged as packed pairs and V transposed (V^T, pairs along keys), both by
  16-byte loads, rows padded by 4 words so the fragment reads hit 32 distinct banks;
- where each key lives is worked out once per key tile, not per element
  (:func:`nbattn.cuda.kernels.prefill_common.tile_locator`);
- a 16-key step that every row of the warp sees whole, with no variant, is only
  scaled (no per-element mask).

The straight-line fragment code is generated per head_dim so that O and Q stay in
registers (:func:`fragment_source`; docs/concepts/generated_kernels.md).  Device
functions are force-inlined at the LLVM level (``primitives.device_fn``) rather
than by numba's IR inliner: the same code, a quarter of the compile time.
head_dim 64 and 128 take the pipelined tile instead
(:mod:`nbattn.cuda.kernels.prefill_pipelined`).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32

from ..blocks import mma as _mma
from ..blocks import nanrule as NR
from ..blocks.primitives import device_fn, element_io
from ..blocks.variants import LOG2E, sigmoid_weight
from .prefill_common import (NO_KEY, KernelSpec, compile_functions, kv_reader, pow2_shift,
                             tile_item, tile_locator, tile_rows, tile_score, tile_thread, tup, warp_unmasked_keys)

__all__ = ["mma_tile", "fragment_writer", "fragment_source", "source", "FRAGMENT_NAMES"]

FRAGMENT_NAMES = ("o_zero", "q_frags", "qk", "pv")


def fragment_source(head_dim: int, q_in_registers: bool) -> str:
    """Source of the straight-line fragment functions of one head_dim.

    The O accumulator (head_dim/8 n-tiles x 4 floats per lane) and the Q
    fragments must stay in registers; a ``cuda.local.array`` indexed in loops
    only does if the compiler unrolls every loop, which it does not.  So the
    loops over n-tiles and k-steps are written out here, once, as source text,
    and the state travels as tuples (SSA values).

    - ``o_zero()``: the zero O tuple;
    - ``q_frags(s_q, r_lo, r_hi, tq)``: all A fragments of the warp's 16 rows;
    - ``qk(qf, s_q, r_lo, r_hi, s_k, k, g, tq)``: S for 16 rows x keys k..k+15
      as (x0..x3, y0..y3) -- two n-tiles;
    - ``pv(o, p0, p1, p2, p3, s_vt, kc, g, alpha_lo, alpha_hi)``: O = alpha O + P V;
    - ``o_get(o, i)`` is plain tuple indexing with a constant.
    """
    ndt, ks = head_dim // 8, head_dim // 16
    n_o = 4 * ndt
    lines = []
    names = ", ".join(f"o{i}" for i in range(n_o))
    lines.append("def o_zero():")
    lines.append("    z = float32(0.0)")
    lines.append("    return " + tup(["z"] * n_o))
    lines.append("def q_frags(s_q, r_lo, r_hi, tq):")
    frag = [] if q_in_registers else ["uint32(0)"]
    for k in range(ks if q_in_registers else 0):
        c = k * 8
        frag += [f"s_q[r_lo, {c} + tq]", f"s_q[r_hi, {c} + tq]", f"s_q[r_lo, {c + 4} + tq]", f"s_q[r_hi, {c + 4} + tq]"]
    lines.append("    return " + tup(frag))
    lines.append("def qk(qf, s_q, r_lo, r_hi, s_k, k, g, tq):")
    lines.append("    z = float32(0.0)")
    lines.append("    x0 = x1 = x2 = x3 = z")
    lines.append("    y0 = y1 = y2 = y3 = z")
    lines.append("    ka = k + g")
    lines.append("    kb = k + 8 + g")
    for k in range(ks):
        c = k * 8
        if q_in_registers:
            a = f"qf[{4 * k}], qf[{4 * k + 1}], qf[{4 * k + 2}], qf[{4 * k + 3}]"
        else:
            lines.append(f"    a0 = s_q[r_lo, {c} + tq]; a1 = s_q[r_hi, {c} + tq]; "
                         f"a2 = s_q[r_lo, {c + 4} + tq]; a3 = s_q[r_hi, {c + 4} + tq]")
            a = "a0, a1, a2, a3"
        lines.append(f"    x0, x1, x2, x3 = mma({a}, s_k[ka, {c} + tq], s_k[ka, {c + 4} + tq], x0, x1, x2, x3)")
        lines.append(f"    y0, y1, y2, y3 = mma({a}, s_k[kb, {c} + tq], s_k[kb, {c + 4} + tq], y0, y1, y2, y3)")
    lines.append("    return x0, x1, x2, x3, y0, y1, y2, y3")
    lines.append("def pv(o, p0, p1, p2, p3, s_vt, kc, g, alpha_lo, alpha_hi):")
    lines.append(f"    {names}, = o" if n_o else "    pass")
    for nt in range(ndt):
        i = 4 * nt
        lines.append(f"    o{i}, o{i + 1}, o{i + 2}, o{i + 3} = mma(p0, p1, p2, p3, s_vt[{nt * 8} + g, kc], "
                     f"s_vt[{nt * 8} + g, kc + 4], o{i} * alpha_lo, o{i + 1} * alpha_lo, "
                     f"o{i + 2} * alpha_hi, o{i + 3} * alpha_hi)")
    lines.append(f"    return ({names},)")
    return "\n".join(lines) + "\n"


def fragment_writer(spec: KernelSpec):
    """Device function ``(o, m_lo, m_hi, l_lo, l_hi, ok_lo, ok_hi, r_lo, r_hi, tq, qo_start,
    row0, head0, out_shift, out, lse)``: the end of both tensor-core tiles.  A lane's
    accumulator fragments hold rows ``r_lo`` (C elements 0, 1) and ``r_hi`` (2, 3)
    at columns ``8 nt + 2 tq`` (+1); the row sums are spread over the lane's quad,
    so they are added up by shuffles first, then each row is normalized and
    written with its base-2 LSE (o = 0 and -inf for a row that kept no key, NaN
    LSE for sigmoid, whose rows are not normalized; a NaN max, or NaN sum, is a
    NaN row)."""
    sigmoid = spec.variant.use_sigmoid
    neg_inf = float32(-math.inf)
    put_lo, put_hi = _row_store(spec, 0), _row_store(spec, 2)

    @device_fn
    def write_rows(o, m_lo, m_hi, l_lo, l_hi, ok_lo, ok_hi, r_lo, r_hi, tq, qo_start, row0, head0, out_shift,
                   out, lse):
        if not sigmoid:
            l_lo += cuda.shfl_xor_sync(0xFFFFFFFF, l_lo, 1)
            l_lo += cuda.shfl_xor_sync(0xFFFFFFFF, l_lo, 2)
            l_hi += cuda.shfl_xor_sync(0xFFFFFFFF, l_hi, 1)
            l_hi += cuda.shfl_xor_sync(0xFFFFFFFF, l_hi, 2)
            # the NaN rule: a NaN max or sum is a poisoned row, a -inf max a row with no key
            bad_lo = m_lo != m_lo or l_lo != l_lo
            bad_hi = m_hi != m_hi or l_hi != l_hi
            inv_lo = NR.NAN_F32 if bad_lo else (float32(0.0) if m_lo == neg_inf else float32(1.0) / l_lo)
            inv_hi = NR.NAN_F32 if bad_hi else (float32(0.0) if m_hi == neg_inf else float32(1.0) / l_hi)
        else:
            bad_lo = False
            bad_hi = False
            inv_lo = float32(1.0)
            inv_hi = float32(1.0)
        put_lo(o, ok_lo, r_lo, inv_lo, bad_lo, m_lo, l_lo, tq, qo_start, row0, head0, out_shift, out, lse)
        put_hi(o, ok_hi, r_hi, inv_hi, bad_hi, m_hi, l_hi, tq, qo_start, row0, head0, out_shift, out, lse)

    return write_rows


def _row_store(spec: KernelSpec, c0: int):
    """Device function ``(o, ok, r, inv, bad, m, l, tq, qo_start, row0, head0, out_shift, out,
    lse)``: row ``r`` of the lane's fragments (C elements ``c0``, ``c0 + 1``) times ``inv``
    to ``out`` and its LSE (lane ``tq == 0``), when ``ok``."""
    NDT = spec.head_dim // 8
    group, sigmoid = spec.group, spec.variant.use_sigmoid
    _, store, _ = element_io(spec.out_kind)
    neg_inf = float32(-math.inf)

    @cuda.jit(device=True, inline=True)       # numba-level inlining: the flags stay predicates
    def put(o, ok, r, inv, bad, m, l, tq, qo_start, row0, head0, out_shift, out, lse):
        if ok:
            qi = qo_start + (row0 + r) // group
            h = head0 + (row0 + r) % group
            for nt in range(NDT):
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq), o[nt * 4 + c0] * inv)
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq + 1), o[nt * 4 + c0 + 1] * inv)
            if tq == 0:
                if sigmoid:
                    lse[qi + out_shift, h] = math.nan
                else:
                    lse[qi + out_shift, h] = NR.NAN_F32 if bad else (neg_inf if m == neg_inf else m + math.log2(l))
    return put


def mma_tile(spec: KernelSpec):
    """The mma.sync tile (head_dim other than 64/128).  Launch: grid (n_work, num_kv_heads), T_q/16 warps.

    Warp w owns fused rows ``16w .. 16w+15`` of the tile.  Per KV tile (T_k
    keys in shared memory) it walks 16 keys at a time: S (16x16) = two
    m16n8k16 n-tiles over head_dim, the variant and mask per element, the
    online-softmax update on the fragments (row max and sum across the 4
    lanes of a quad by shuffles), then P (packed to f16/bf16 in registers,
    the C layout being the A layout) times V^T from shared memory into the
    O fragments ``o[nt*4 + c]`` (n-tile nt of head_dim, component c).
    """
    D, group = spec.head_dim, spec.group
    T_q, T_k, NT = spec.tile_q, spec.tile_k, spec.threads
    var = spec.variant
    sigmoid = var.use_sigmoid
    positional = spec.mode != "bsr"
    stage = tile_rows(spec, positional)
    item = tile_item(spec)
    thread = tile_thread(spec, 32, 4)
    write_rows = fragment_writer(spec)
    # keys that need no per-element work (prefill_common.warp_unmasked_keys)
    unmasked_keys, inside = warp_unmasked_keys(spec, positional, 16)
    scale_log2 = float32(var.scale(D) * LOG2E)
    vec = kv_reader(spec.mode, spec.kv_layout, _mma.load_u32x4)  # 16 B: eight 2-byte elements from d on
    loc = tile_locator(spec.mode)
    assert T_k <= NT
    bias = float32(var.sigmoid_bias)
    mma = _mma.mma_bf16 if spec.kind == "bf16" else _mma.mma_f16
    pack = _mma.pack_bf16x2 if spec.kind == "bf16" else _mma.pack_f16x2
    load_q = _mma.load_u32x4
    q_in_registers = D <= 128          # D=256 would need 64 more registers: read A from shared memory
    frags = compile_functions(fragment_source(D, q_in_registers), f"fragments D={D}",
                              {"float32": float32, "uint32": uint32, "mma": mma}, FRAGMENT_NAMES)
    o_zero, q_frags, qk, pv = frags["o_zero"], frags["q_frags"], frags["qk"], frags["pv"]
    neg_inf = float32(-math.inf)
    W = D // 2 + 4              # padded row of packed pairs (Q, K)
    WV = T_k // 2 + 4           # padded row of V^T (pairs along keys)
    lo16 = uint32(0xFFFF)
    hi16 = uint32(0xFFFF0000)
    sh16 = uint32(16)

    score = tile_score(spec, positional)
    poison = NR.poison_kv(spec.kind)

    @device_fn
    def tile(wi, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        tid, kv_head, head0, warp, lane, g, tq = thread()
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, wi)
        s_q = cuda.shared.array((T_q, W), uint32)
        s_k = cuda.shared.array((T_k, W), uint32)
        s_vt = cuda.shared.array((D, WV), uint32)
        s_kpos = cuda.shared.array(T_k, int32)
        s_kpage = cuda.shared.array(T_k, int32)
        s_kslot = cuda.shared.array(T_k, int32)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)
        shift = pow2_shift(block)

        # Q tile: 16-byte loads, packed pairs stay packed.
        for e in range(tid, T_q * (D // 8), NT):
            r = e // (D // 8)
            c = e % (D // 8)
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                w0, w1, w2, w3 = load_q(q, (qi, head0 + (row0 + r) % group, c * 8))
            else:
                w0 = w1 = w2 = w3 = uint32(0)
            s_q[r, c * 4] = w0
            s_q[r, c * 4 + 1] = w1
            s_q[r, c * 4 + 2] = w2
            s_q[r, c * 4 + 3] = w3
        lo, hi, sink_end = stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
                                 s_qpos, s_diag, s_req, s_range)

        r_lo = warp * 16 + g
        r_hi = r_lo + 8
        ok_lo = r_lo < n_rows
        ok_hi = r_hi < n_rows
        u_lo, u_hi = unmasked_keys(s_diag, warp * 16, n_rows)    # keys this warp's rows all see, unmasked

        o = o_zero()
        qf = q_frags(s_q, r_lo, r_hi, tq)     # (a dummy when A is read from shared memory)
        m_lo = neg_inf
        m_hi = neg_inf
        l_lo = float32(0.0)
        l_hi = float32(0.0)

        for t0 in range(kv_begin, hi, T_k):
            if t0 + T_k <= lo and t0 >= sink_end:
                continue
            # Where each key lives, once per tile (not once per 16-byte chunk).
            if tid < T_k:
                t = t0 + tid
                page, slot, pos = loc(kv_indices, kv_ptr, kv_base, min(t, hi - 1), block, n_keys, shift)
                s_kpage[tid] = page
                s_kslot[tid] = slot
                s_kpos[tid] = pos if t < hi else NO_KEY
            cuda.syncthreads()
            # K rows as packed pairs; V transposed so that pairs run along keys.  Two keys
            # per step, K and V of the same dims together: the NaN rule's poison (a bad V
            # chunk stored as zeros, its K chunk as NaN) needs both.
            for e in range(tid, (T_k // 2) * (D // 8), NT):
                jj = e // (D // 8)
                c = e % (D // 8)
                ka0 = ka1 = ka2 = ka3 = a0 = a1 = a2 = a3 = uint32(0)
                kb0 = kb1 = kb2 = kb3 = b0 = b1 = b2 = b3 = uint32(0)
                if s_kpos[2 * jj] != NO_KEY:
                    ka0, ka1, ka2, ka3 = vec(k_src, 0, s_kpage[2 * jj], s_kslot[2 * jj], kv_head, c * 8)
                    a0, a1, a2, a3 = vec(v_src, 1, s_kpage[2 * jj], s_kslot[2 * jj], kv_head, c * 8)
                    ka0, ka1, ka2, ka3, a0, a1, a2, a3 = poison(ka0, ka1, ka2, ka3, a0, a1, a2, a3)
                if s_kpos[2 * jj + 1] != NO_KEY:
                    kb0, kb1, kb2, kb3 = vec(k_src, 0, s_kpage[2 * jj + 1], s_kslot[2 * jj + 1], kv_head, c * 8)
                    b0, b1, b2, b3 = vec(v_src, 1, s_kpage[2 * jj + 1], s_kslot[2 * jj + 1], kv_head, c * 8)
                    kb0, kb1, kb2, kb3, b0, b1, b2, b3 = poison(kb0, kb1, kb2, kb3, b0, b1, b2, b3)
                s_k[2 * jj, c * 4] = ka0
                s_k[2 * jj, c * 4 + 1] = ka1
                s_k[2 * jj, c * 4 + 2] = ka2
                s_k[2 * jj, c * 4 + 3] = ka3
                s_k[2 * jj + 1, c * 4] = kb0
                s_k[2 * jj + 1, c * 4 + 1] = kb1
                s_k[2 * jj + 1, c * 4 + 2] = kb2
                s_k[2 * jj + 1, c * 4 + 3] = kb3
                d0 = c * 8
                s_vt[d0, jj] = (a0 & lo16) | (b0 << sh16)
                s_vt[d0 + 1, jj] = (a0 >> sh16) | (b0 & hi16)
                s_vt[d0 + 2, jj] = (a1 & lo16) | (b1 << sh16)
                s_vt[d0 + 3, jj] = (a1 >> sh16) | (b1 & hi16)
                s_vt[d0 + 4, jj] = (a2 & lo16) | (b2 << sh16)
                s_vt[d0 + 5, jj] = (a2 >> sh16) | (b2 & hi16)
                s_vt[d0 + 6, jj] = (a3 & lo16) | (b3 << sh16)
                s_vt[d0 + 7, jj] = (a3 >> sh16) | (b3 & hi16)
            cuda.syncthreads()

            for k0 in range(0, T_k, 16):
                if t0 + k0 >= hi:
                    break
                # S = Q K^T for 16 rows x 16 keys (two n-tiles)
                x0, x1, x2, x3, y0, y1, y2, y3 = qk(qf, s_q, r_lo, r_hi, s_k, k0, g, tq)
                # variant and mask; the fast case is a 16-key step every row sees whole
                kt = k0 + 2 * tq
                last = t0 + k0 + 15
                if inside(t0 + k0, last, hi, u_lo, u_hi):
                    x0 = x0 * scale_log2 + (x0 - x0)   # NaN rule: inf -> NaN
                    x1 = x1 * scale_log2 + (x1 - x1)   # NaN rule: inf -> NaN
                    x2 = x2 * scale_log2 + (x2 - x2)   # NaN rule: inf -> NaN
                    x3 = x3 * scale_log2 + (x3 - x3)   # NaN rule: inf -> NaN
                    y0 = y0 * scale_log2 + (y0 - y0)   # NaN rule: inf -> NaN
                    y1 = y1 * scale_log2 + (y1 - y1)   # NaN rule: inf -> NaN
                    y2 = y2 * scale_log2 + (y2 - y2)   # NaN rule: inf -> NaN
                    y3 = y3 * scale_log2 + (y3 - y3)   # NaN rule: inf -> NaN
                else:
                    x0 = score(x0, r_lo, ok_lo, kt, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    x1 = score(x1, r_lo, ok_lo, kt + 1, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    x2 = score(x2, r_hi, ok_hi, kt, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    x3 = score(x3, r_hi, ok_hi, kt + 1, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    y0 = score(y0, r_lo, ok_lo, kt + 8, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    y1 = score(y1, r_lo, ok_lo, kt + 9, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    y2 = score(y2, r_hi, ok_hi, kt + 8, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                    y3 = score(y3, r_hi, ok_hi, kt + 9, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes)
                if sigmoid:
                    alpha_lo = float32(1.0)
                    alpha_hi = float32(1.0)
                    x0 = sigmoid_weight(x0, bias) if x0 != neg_inf else float32(0.0)
                    x1 = sigmoid_weight(x1, bias) if x1 != neg_inf else float32(0.0)
                    x2 = sigmoid_weight(x2, bias) if x2 != neg_inf else float32(0.0)
                    x3 = sigmoid_weight(x3, bias) if x3 != neg_inf else float32(0.0)
                    y0 = sigmoid_weight(y0, bias) if y0 != neg_inf else float32(0.0)
                    y1 = sigmoid_weight(y1, bias) if y1 != neg_inf else float32(0.0)
                    y2 = sigmoid_weight(y2, bias) if y2 != neg_inf else float32(0.0)
                    y3 = sigmoid_weight(y3, bias) if y3 != neg_inf else float32(0.0)
                else:
                    # online softmax (base 2) per row; a quad of lanes holds one row
                    mx_lo = NR.max_nan(NR.max_nan(x0, x1), NR.max_nan(y0, y1))
                    mx_hi = NR.max_nan(NR.max_nan(x2, x3), NR.max_nan(y2, y3))
                    mx_lo = NR.max_nan(mx_lo, cuda.shfl_xor_sync(0xFFFFFFFF, mx_lo, 1))
                    mx_lo = NR.max_nan(mx_lo, cuda.shfl_xor_sync(0xFFFFFFFF, mx_lo, 2))
                    mx_hi = NR.max_nan(mx_hi, cuda.shfl_xor_sync(0xFFFFFFFF, mx_hi, 1))
                    mx_hi = NR.max_nan(mx_hi, cuda.shfl_xor_sync(0xFFFFFFFF, mx_hi, 2))
                    new_lo = NR.max_nan(m_lo, mx_lo)
                    new_hi = NR.max_nan(m_hi, mx_hi)
                    base_lo = new_lo if new_lo != neg_inf else float32(0.0)
                    base_hi = new_hi if new_hi != neg_inf else float32(0.0)
                    alpha_lo = math.exp2(m_lo - base_lo)
                    alpha_hi = math.exp2(m_hi - base_hi)
                    x0 = math.exp2(x0 - base_lo)
                    x1 = math.exp2(x1 - base_lo)
                    y0 = math.exp2(y0 - base_lo)
                    y1 = math.exp2(y1 - base_lo)
                    x2 = math.exp2(x2 - base_hi)
                    x3 = math.exp2(x3 - base_hi)
                    y2 = math.exp2(y2 - base_hi)
                    y3 = math.exp2(y3 - base_hi)
                    l_lo = l_lo * alpha_lo + (x0 + x1 + y0 + y1)
                    l_hi = l_hi * alpha_hi + (x2 + x3 + y2 + y3)
                    m_lo = new_lo
                    m_hi = new_hi
                # O = alpha O + P V^T: P's C fragments are the A fragment
                p0 = pack(x0, x1)
                p1 = pack(x2, x3)
                p2 = pack(y0, y1)
                p3 = pack(y2, y3)
                o = pv(o, p0, p1, p2, p3, s_vt, k0 // 2 + tq, g, alpha_lo, alpha_hi)
            cuda.syncthreads()

        write_rows(o, m_lo, m_hi, l_lo, l_hi, ok_lo, ok_hi, r_lo, r_hi, tq, qo_start, row0, head0, out_shift,
                   out, lse)

    return tile





def source(spec: KernelSpec) -> str:
    """The generated fragment source :func:`mma_tile` compiles for ``spec``."""
    return fragment_source(spec.head_dim, spec.head_dim <= 128)
