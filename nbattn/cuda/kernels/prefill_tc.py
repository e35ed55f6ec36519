"""The tensor-core paths of the prefill kernel (GPU only, fp16/bf16):
:func:`tensor_core_tile` builds the same tile as the CUDA-core kernel of
:mod:`nbattn.cuda.prefill` -- same work list, launch and arguments -- on
``mma.sync.m16n8k16`` (:mod:`nbattn.cuda.blocks.mma`).  Two kernels, routed by head_dim:

- head_dim 64 and 128 (:func:`pipelined_tile`, T_q = 64, T_k = 64, 4 warps):
  K/V tiles fetched with 16-byte ``cp.async`` so the next tile's loads overlap
  this tile's math (FlashAttention-2's order), Q/K fragments by ``ldmatrix.x4``
  and V's by ``ldmatrix.x4.trans`` from rows padded against bank conflicts,
  Q fragments loaded once into registers, one multiply by scale*log2(e) before
  exp2, and
  the per-element variant/mask only on tiles that need it (a 64-key tile
  every row of a warp sees whole, with no variant, is just scaled).
- other multiples of 16 up to 256 (:func:`mma_tile`): K and V^T staged by
  plain loads and read as 32-bit fragments; no overlap.  head_dim 256 keeps
  it because O, Q and S of the pipelined tile would not fit in registers.

Both: 16 fused rows per warp; ``S = Q K^T`` and ``O += P V`` on the tensor
cores, softmax on the accumulator fragments with quad shuffles, P fed to the
second product straight from registers (the C layout of two n-tiles is the A
layout).  The straight-line fragment code is generated per head_dim so that
O and Q stay in registers.  Device functions are force-inlined at the LLVM
level (``primitives.device_fn``) rather than by numba's IR inliner: the same
code, a quarter of the compile time.

Shared with the CUDA-core kernel: the tile prologue (``tile_rows``), the key walk (``kv_reader``,
``tile_key_range``, ``NO_KEY``; :func:`_tile_locator` answers as :func:`nbattn.cuda.prefill.key_locator`
does, once per key and tile, with a shift for power-of-two blocks), element stores
(:func:`nbattn.cuda.blocks.primitives.element_io`) and the variant applied to a score
(:func:`nbattn.cuda.prefill.tile_score`).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32, uint64

from ..blocks import mma as _mma
from .. import prefill as P
from ..blocks import nanrule as NR
from ..blocks.primitives import device_fn, element_io
from ..blocks.variants import LOG2E, sigmoid_weight

__all__ = ["tensor_core_tile", "tensor_core_tiles", "fast_path", "pipelined_tile", "mma_tile"]


def tensor_core_tiles(head_dim: int) -> tuple[int, int, int]:
    """(T_q, T_k, threads): 16 fused rows per warp, static shared memory under
    48 KB.  head_dim 64/128: the pipelined kernel (one K and one V tile of 64
    keys, rows padded by 16 bytes: 34.8 KB at d128).  Others: the first kernel
    (Q, K and V^T tiles as packed uint32 pairs, rows padded by 4 words so the
    fragment reads hit 32 distinct banks)."""
    if fast_path(head_dim):
        return 64, 64, 128
    if head_dim <= 64:
        return 64, 64, 128
    if head_dim <= 128:
        return 64, 32, 128
    return 32, 16, 64


def _fragment_functions(head_dim: int, mma, q_in_registers: bool) -> dict:
    """Straight-line device functions over register tuples, generated per head_dim.

    The O accumulator (head_dim/8 n-tiles x 4 floats per lane) and the Q
    fragments must stay in registers; a ``cuda.local.array`` indexed in loops
    only does if the compiler unrolls every loop, which it did not (measured:
    60 TFLOP/s).  So the loops over n-tiles and k-steps are written out here,
    once, as source text, and the state travels as tuples (SSA values).

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
    lines.append("    return (" + ", ".join("z" for _ in range(n_o)) + ",)")
    lines.append("def q_frags(s_q, r_lo, r_hi, tq):")
    frag = [] if q_in_registers else ["uint32(0)"]
    for k in range(ks if q_in_registers else 0):
        c = k * 8
        frag += [f"s_q[r_lo, {c} + tq]", f"s_q[r_hi, {c} + tq]", f"s_q[r_lo, {c + 4} + tq]", f"s_q[r_hi, {c + 4} + tq]"]
    lines.append("    return (" + ", ".join(frag) + ",)")
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
    env = {"float32": float32, "uint32": uint32, "mma": mma}
    exec(compile("\n".join(lines), f"<nbattn fragments D={head_dim}>", "exec"), env)
    return {name: device_fn(env[name]) for name in ("o_zero", "q_frags", "qk", "pv")}


def tensor_core_tile(spec: P.KernelSpec):
    """The per-row body (a device function, see :func:`nbattn.cuda.prefill.prefill_entry`)
    of a tensor-core build: :func:`pipelined_tile` for head_dim 64 and 128,
    :func:`mma_tile` for the other multiples of 16."""
    return pipelined_tile(spec) if fast_path(spec.head_dim) else mma_tile(spec)


def _row_writer(spec: P.KernelSpec):
    """Device function ``(o, m_lo, m_hi, l_lo, l_hi, ok_lo, ok_hi, r_lo, r_hi, tq, qo_start,
    row0, head0, out_shift, out, lse)``: the end of both tensor-core tiles.  A lane's
    accumulator fragments hold rows ``r_lo`` (C elements 0, 1) and ``r_hi`` (2, 3)
    at columns ``8 nt + 2 tq`` (+1); the row sums are spread over the lane's quad,
    so they are added up by shuffles first, then each row is normalized and
    written with its base-2 LSE (o = 0 and -inf for a row that kept no key, NaN
    LSE for sigmoid, whose rows are not normalized; a NaN max, or NaN sum, is a
    NaN row)."""
    NDT = spec.head_dim // 8
    group, sigmoid = spec.group, spec.variant.use_sigmoid
    _, store, _ = element_io(spec.out_kind)
    neg_inf = float32(-math.inf)

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
            inv_lo = float32(1.0)
            inv_hi = float32(1.0)
        if ok_lo:
            qi = qo_start + (row0 + r_lo) // group
            h = head0 + (row0 + r_lo) % group
            for nt in range(NDT):
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq), o[nt * 4] * inv_lo)
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq + 1), o[nt * 4 + 1] * inv_lo)
            if tq == 0:
                if sigmoid:
                    lse[qi + out_shift, h] = math.nan
                else:
                    lse[qi + out_shift, h] = NR.NAN_F32 if bad_lo else (
                        neg_inf if m_lo == neg_inf else m_lo + math.log2(l_lo))
        if ok_hi:
            qi = qo_start + (row0 + r_hi) // group
            h = head0 + (row0 + r_hi) % group
            for nt in range(NDT):
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq), o[nt * 4 + 2] * inv_hi)
                store(out, (qi + out_shift, h, nt * 8 + 2 * tq + 1), o[nt * 4 + 3] * inv_hi)
            if tq == 0:
                if sigmoid:
                    lse[qi + out_shift, h] = math.nan
                else:
                    lse[qi + out_shift, h] = NR.NAN_F32 if bad_hi else (
                        neg_inf if m_hi == neg_inf else m_hi + math.log2(l_hi))

    return write_rows


def mma_tile(spec: P.KernelSpec):
    """mma.sync path without cp.async/ldmatrix (head_dim other than 64/128).  Launch: grid (n_work, num_kv_heads), T_q/16 warps.

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
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)
    positional = spec.mode != "bsr"
    stage = P.tile_rows(spec, positional)
    item = P.tile_item(spec)
    write_rows = _row_writer(spec)
    # Only causal (or nothing) to apply: interior 16-key steps need no per-element work.
    plain = not (window >= 0 or sinks or var.has_alibi or var.has_soft_cap or var.score_mod is not None
                 or var.mask_mod is not None or sigmoid)
    scale_log2 = float32(var.scale(D) * LOG2E)
    vec = P.kv_reader(spec.mode, spec.kv_layout, _mma.load_u32x4)  # 16 B: eight 2-byte elements from d on
    loc = _tile_locator(spec.mode)
    assert T_k <= NT
    bias = float32(var.sigmoid_bias)
    NO_KEY = P.NO_KEY
    mma = _mma.mma_bf16 if spec.kind == "bf16" else _mma.mma_f16
    pack = _mma.pack_bf16x2 if spec.kind == "bf16" else _mma.pack_f16x2
    load_q = _mma.load_u32x4
    q_in_registers = D <= 128          # D=256 would need 64 more registers: read A from shared memory
    frags = _fragment_functions(D, mma, q_in_registers)
    o_zero, q_frags, qk, pv = frags["o_zero"], frags["q_frags"], frags["qk"], frags["pv"]
    neg_inf = float32(-math.inf)
    W = D // 2 + 4              # padded row of packed pairs (Q, K)
    WV = T_k // 2 + 4           # padded row of V^T (pairs along keys)
    lo16 = uint32(0xFFFF)
    hi16 = uint32(0xFFFF0000)
    sh16 = uint32(16)

    score = P.tile_score(spec, positional)
    poison = NR.poison_kv(spec.kind)

    @device_fn
    def tile(wi, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        tq = lane % 4
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, wi)
        head0 = kv_head * group

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
        shift = -1
        if block > 0 and block & (block - 1) == 0:
            shift = 31 - cuda.clz(int32(block))

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
        stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
              s_qpos, s_diag, s_req, s_range)
        cuda.syncthreads()
        lo = s_range[0]
        hi = s_range[1]
        sink_end = s_range[2]

        r_lo = warp * 16 + g
        r_hi = r_lo + 8
        ok_lo = r_lo < n_rows
        ok_hi = r_hi < n_rows
        # smallest diagonal of this warp's rows: keys up to it are visible to all of them
        warp_diag = min(s_diag[warp * 16], s_diag[min(warp * 16 + 15, T_q - 1)])
        for r in range(warp * 16, warp * 16 + 16):
            warp_diag = min(warp_diag, s_diag[r])

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
                if plain and positional and last < hi and ok_hi and (not causal or last <= warp_diag):
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



# ---------------------------------------------------------------------------
# The pipelined kernel (head_dim 64 and 128)
# ---------------------------------------------------------------------------

def fast_path(head_dim: int) -> bool:
    """Head dims the pipelined kernel builds (K fragments come two k-steps per
    ldmatrix.x4; O, Q and a 64-key S must fit in registers)."""
    return head_dim in (64, 128)


def _fast_fragments(D: int, T_k: int, ROW: int, mma, pack, score, sigmoid: bool, bias) -> dict:
    """Straight-line fragment code of the pipelined kernel, generated per
    (head_dim, T_k) as :func:`_fragment_functions` is, for the same reason.

    ``s`` is a warp's 16 x T_k score block: n-tile j (keys 8j..8j+7) holds
    ``s[4j:4j+4]`` in the C layout.  Addresses are the lane's ldmatrix row
    address; the offsets below are compile-time constants.

    - ``q_frags(addr)``: all A fragments of the warp's 16 Q rows (ldmatrix.x4 per k-step);
    - ``qk(qf, addr)``: S = Q K^T (one ldmatrix.x4 = B of two k-steps of one n-tile);
    - ``scaled(s, f)``: every score times f (unmasked tiles);
    - ``masked(s, ..., s_kpos, kbase, ...)``: :func:`score` per element (variant
      and mask), key positions from ``s_kpos[kbase:kbase + T_k]``;
    - ``softmax(s, m_lo, m_hi, l_lo, l_hi)`` -> (P packed as A fragments,
      m_lo, m_hi, l_lo, l_hi, alpha_lo, alpha_hi); base-2 online softmax, or
      sigmoid weights with alpha 1;
    - ``o_finite(o)`` -> (row r_lo's O is finite, row r_hi's is);
    - ``pv(o, p, addr, alpha_lo, alpha_hi)``: O = alpha O + P V (ldmatrix.x4.trans
      = B of two n-tiles of one k-step).
    """
    KS, NTK, NDT = D // 16, T_k // 8, D // 8
    n_s, n_o, n_p = 4 * NTK, 4 * NDT, 2 * NTK
    S = [f"s{i}" for i in range(n_s)]
    O = [f"o{i}" for i in range(n_o)]
    Pn = [f"p{i}" for i in range(n_p)]
    tup = lambda xs: "(" + ", ".join(xs) + ",)"
    L = []
    L.append("def o_zero():")
    L.append("    z = float32(0.0)")
    L.append("    return " + tup(["z"] * n_o))

    L.append("def q_frags(addr):")
    qf = []
    for k in range(KS):
        L.append(f"    a{4 * k}, a{4 * k + 1}, a{4 * k + 2}, a{4 * k + 3} = ldsm(addr + {32 * k})")
        qf += [f"a{4 * k + i}" for i in range(4)]
    L.append("    return " + tup(qf))

    L.append("def qk(qf, addr):")
    L.append("    z = float32(0.0)")
    for j in range(NTK):
        acc = ", ".join(S[4 * j:4 * j + 4])
        L.append(f"    {acc} = z, z, z, z")
        for k2 in range(D // 32):
            L.append(f"    b0, b1, b2, b3 = ldsm(addr + {j * 8 * ROW + 64 * k2})")
            a = ", ".join(f"qf[{8 * k2 + i}]" for i in range(4))
            L.append(f"    {acc} = mma({a}, b0, b1, {acc})")
            a = ", ".join(f"qf[{8 * k2 + 4 + i}]" for i in range(4))
            L.append(f"    {acc} = mma({a}, b2, b3, {acc})")
    L.append("    return " + tup(S))

    L.append("def scaled(s, f):")
    L.append("    " + ", ".join(S) + ", = s")
    L.append("    return " + tup([f"{x} * f + ({x} - {x})" for x in S]))   # NaN rule: inf -> NaN

    L.append("def masked(s, r_lo, r_hi, ok_lo, ok_hi, tq, s_qpos, s_diag, s_req, s_kpos, kbase, head0, row0, "
             "slopes):")
    L.append("    " + ", ".join(S) + ", = s")
    L.append("    kt = kbase + 2 * tq")
    out = []
    for j in range(NTK):
        for c in range(4):
            r, ok = ("r_lo", "ok_lo") if c < 2 else ("r_hi", "ok_hi")
            out.append(f"score(s{4 * j + c}, {r}, {ok}, kt + {8 * j + (c & 1)}, s_qpos, s_diag, s_req, "
                       f"s_kpos, head0, row0, slopes)")
    L.append("    return (" + ",\n            ".join(out) + ",)")

    L.append("def softmax(s, m_lo, m_hi, l_lo, l_hi):")
    L.append("    " + ", ".join(S) + ", = s")
    if sigmoid:
        for x in S:
            L.append(f"    {x} = sigmoid_weight({x}, bias) if {x} != neg_inf else float32(0.0)")
        L.append("    alpha_lo = float32(1.0)")
        L.append("    alpha_hi = float32(1.0)")
    else:
        lo = [S[4 * j + c] for j in range(NTK) for c in (0, 1)]
        hi = [S[4 * j + c] for j in range(NTK) for c in (2, 3)]
        for name, xs in (("lo", lo), ("hi", hi)):
            L.append(f"    mx = {xs[0]}")
            for x in xs[1:]:
                L.append(f"    mx = max_nan(mx, {x})")
            L.append("    mx = max_nan(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))")
            L.append("    mx = max_nan(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))")
            L.append(f"    new = max_nan(m_{name}, mx)")
            L.append("    base = new if new != neg_inf else float32(0.0)")
            L.append(f"    alpha_{name} = math.exp2(m_{name} - base)")
            for x in xs:
                L.append(f"    {x} = math.exp2({x} - base)")
            L.append(f"    l_{name} = l_{name} * alpha_{name} + (" + " + ".join(xs) + ")")
            L.append(f"    m_{name} = new")
    for ks in range(T_k // 16):
        b = 8 * ks
        L.append(f"    p{4 * ks} = pack(s{b}, s{b + 1})")
        L.append(f"    p{4 * ks + 1} = pack(s{b + 2}, s{b + 3})")
        L.append(f"    p{4 * ks + 2} = pack(s{b + 4}, s{b + 5})")
        L.append(f"    p{4 * ks + 3} = pack(s{b + 6}, s{b + 7})")
    L.append("    return " + tup(Pn) + ", m_lo, m_hi, l_lo, l_hi, alpha_lo, alpha_hi")

    L.append("def o_finite(o):")                     # x - x is 0 for finite x, NaN for inf or NaN
    L.append("    " + ", ".join(O) + ", = o")
    for name, cs in (("lo", (0, 1)), ("hi", (2, 3))):
        L.append(f"    {name} = " + " + ".join(f"({O[4 * nt + c]} - {O[4 * nt + c]})" for nt in range(NDT) for c in cs))
    L.append("    return lo == float32(0.0), hi == float32(0.0)")

    L.append("def pv(o, p, addr, alpha_lo, alpha_hi):")
    L.append("    " + ", ".join(O) + ", = o")
    for nt in range(NDT):
        i = 4 * nt
        L.append(f"    o{i} *= alpha_lo; o{i + 1} *= alpha_lo; o{i + 2} *= alpha_hi; o{i + 3} *= alpha_hi")
    for ks in range(T_k // 16):
        a = ", ".join(f"p[{4 * ks + i}]" for i in range(4))
        for n2 in range(D // 16):
            L.append(f"    b0, b1, b2, b3 = ldsm_t(addr + {ks * 16 * ROW + 32 * n2})")
            for half, (x, y) in enumerate((("b0", "b1"), ("b2", "b3"))):
                nt = 2 * n2 + half
                acc = ", ".join(O[4 * nt:4 * nt + 4])
                L.append(f"    {acc} = mma({a}, {x}, {y}, {acc})")
    L.append("    return " + tup(O))

    env = {"float32": float32, "uint32": uint32, "mma": mma, "pack": pack, "ldsm": _mma.ldsm_x4,
           "ldsm_t": _mma.ldsm_x4_t, "score": score, "cuda": cuda, "math": math,
           "sigmoid_weight": sigmoid_weight, "bias": bias, "neg_inf": float32(-math.inf),
           "max_nan": NR.max_nan}
    exec(compile("\n".join(L), f"<nbattn pipelined fragments D={D} T_k={T_k}>", "exec"), env)
    names = ("o_zero", "q_frags", "qk", "scaled", "masked", "softmax", "o_finite", "pv")
    return {name: device_fn(env[name]) for name in names}


def _issue_function(CH: int, NT: int, k_iters: int, ROW: int, no_key: int):
    """``issue(s_dst, s_addr, s_kpos, base, tid)``: cp.async of one K or V tile,
    row j from the global address ``s_addr[base + j]`` (zero-fill where
    ``s_kpos[base + j]`` is NO_KEY).  Generated straight-line code: cp.async is
    volatile asm with a memory clobber, so in a loop each row's shared-memory
    reads would wait behind the previous row's copy; written out, all of them
    are issued before the first copy."""
    JS = NT // CH                       # rows per pass of the block
    L = ["def issue(s_dst, s_addr, s_kpos, base, tid):",
         "    j = base + tid // CH",
         "    c16 = uint64((tid % CH) * 16)",
         "    dst = s_dst + uint32((tid // CH) * ROW + (tid % CH) * 16)"]
    for i in range(k_iters):
        L.append(f"    a{i} = s_addr[j + {i * JS}]")
        L.append(f"    n{i} = int32(16) if s_kpos[j + {i * JS}] != NO_KEY else int32(0)")
    for i in range(k_iters):
        L.append(f"    cp_async16(dst + uint32({i * JS * ROW}), a{i} + c16, n{i})")
    env = {"uint32": uint32, "uint64": uint64, "int32": int32, "CH": CH, "ROW": ROW, "NO_KEY": no_key,
           "cp_async16": _mma.cp_async16}
    exec(compile("\n".join(L), f"<nbattn cp.async issue CH={CH} NT={NT} iters={k_iters}>", "exec"), env)
    return device_fn(env["issue"])


def _tile_locator(mode: str):
    """Device function ``(kv_indices, kv_ptr, kv_base, t, block, n_keys, shift) -> (page, slot, pos)``:
    :func:`nbattn.cuda.prefill.key_locator`'s answer for key ``t >= 0``, with a
    shift and a mask in place of ``t // block`` and ``t % block`` when the block
    (page size, BSR column block) is a power of two (``shift >= 0``)."""
    NO_KEY = P.NO_KEY
    if mode == "contig":
        @device_fn
        def loc(kv_indices, kv_ptr, kv_base, t, block, n_keys, shift):
            return 0, kv_base + t, t
        return loc

    @device_fn
    def split(t, block, shift):
        if shift >= 0:
            return t >> shift, t & (block - 1)
        return t // block, t % block

    if mode == "paged":
        @device_fn
        def loc(kv_indices, kv_ptr, kv_base, t, block, n_keys, shift):
            i, slot = split(t, block, shift)
            return kv_indices[kv_ptr + i], slot, t
    else:
        @device_fn
        def loc(kv_indices, kv_ptr, kv_base, t, block, n_keys, shift):
            i, slot = split(t, block, shift)
            row = kv_indices[kv_ptr + i] * block + slot
            if row >= n_keys:
                return 0, 0, NO_KEY
            return 0, row, row
    return loc


def pipelined_tile(spec: P.KernelSpec):
    """cp.async + ldmatrix path for head_dim 64/128.  Launch as the others:
    grid (n_work, num_kv_heads), T_q/16 warps; static shared memory only (the
    wrappers launch every prefill kernel without a dynamic size).

    Shared memory holds one K tile and one V tile of T_k keys, rows padded by
    16 bytes so the 8 row addresses of an ldmatrix phase fall in distinct
    banks.  The Q tile is staged in that buffer first (T_q <= 2 T_k) and read
    once into registers.  Per KV tile, the two loads overlap
    math the way FlashAttention-2 orders them:

        issue V(t);   S = Q K(t)^T, mask, softmax, P
        wait, barrier (V(t) in, everyone done with K)
        issue K(next); O = alpha O + P V(t)
        wait, barrier (K(next) in, everyone done with V)

    Copies past the key range (or of missing bsr keys) zero-fill instead of
    reading, so the P V product never meets uninitialized memory.

    The NaN rule's V part cannot be applied as V is loaded (it lands after the
    scores are taken), so the tile checks its O at the end and, when a row met
    a non-finite V, walks the keys once more with each V checked as its address
    is taken (:mod:`nbattn.cuda.blocks.nanrule`).

    Where the keys live is worked out once per tile, one tile ahead: at the
    top of iteration t, threads ``tid < T_k`` load the page ids of tile t+1
    (one ``kv_indices`` load each, shift/mask for power-of-two pages); the
    values are only used -- turned into the global row addresses of K and V
    and written to the other half of ``s_kaddr``/``s_vaddr``/``s_kpos`` -- after
    the QK product and softmax, so the loads' latency hides behind the math,
    and the barrier before ``issue K(t+1)`` publishes them.  The copies then
    read their row addresses from shared memory.  (Each 16-byte chunk used to
    redo the page lookup: per thread 16 dependent index loads and 64-bit
    divisions per tile, serialized behind the volatile cp.async asm; page size
    1 ran at a third of the contiguous speed.)
    """
    D, group = spec.head_dim, spec.group
    T_q, T_k, NT = spec.tile_q, spec.tile_k, spec.threads
    assert fast_path(D) and T_q <= 2 * T_k and NT == 2 * T_q
    var = spec.variant
    sigmoid = var.use_sigmoid
    causal = var.causal
    positional = spec.mode != "bsr"
    stage = P.tile_rows(spec, positional)
    item = P.tile_item(spec)
    write_rows = _row_writer(spec)
    plain = not (int(var.window_left) >= 0 or var.sink_size or var.has_alibi or var.has_soft_cap
                 or var.score_mod is not None or var.mask_mod is not None or sigmoid)
    scale_log2 = float32(var.scale(D) * LOG2E)
    addr_of = P.kv_reader(spec.mode, spec.kv_layout, _mma.global_addr)
    gaddr = _mma.global_addr
    loc = _tile_locator(spec.mode)
    NO_KEY = P.NO_KEY
    mma = _mma.mma_bf16 if spec.kind == "bf16" else _mma.mma_f16
    pack = _mma.pack_bf16x2 if spec.kind == "bf16" else _mma.pack_f16x2
    cp_async16, commit, wait_all = _mma.cp_async16, _mma.cp_async_commit, _mma.cp_async_wait_all
    shared_addr = _mma.shared_addr
    neg_inf = float32(-math.inf)
    ROW = 2 * D + 16                 # bytes per smem row (16 B pad)
    CH = D // 8                      # 16-byte chunks per row
    TILE = T_k * ROW
    BUF_WORDS = (2 * TILE + 16) // 4  # K tile, V tile, slack for 16-byte alignment
    K_ITERS = T_k * CH // NT
    Q_ITERS = T_q * CH // NT
    assert NT % CH == 0 and NT % T_k == 0
    LOCS = 2 * T_k                   # key locations of two tiles
    align_mask = uint32(0xFFFFFFF0)

    score = P.tile_score(spec, positional)

    fr = _fast_fragments(D, T_k, ROW, mma, pack, score, sigmoid, float32(var.sigmoid_bias))
    o_zero, q_frags, qk, scaled = fr["o_zero"], fr["q_frags"], fr["qk"], fr["scaled"]
    masked, softmax, o_finite, pv = fr["masked"], fr["softmax"], fr["o_finite"], fr["pv"]

    issue = _issue_function(CH, NT, K_ITERS, ROW, NO_KEY)
    bad_chunk = NR.chunk_bad(spec.kind)
    vec = P.kv_reader(spec.mode, spec.kv_layout, _mma.load_u32x4)
    NAN_AT = P.nan_row_at(spec.num_qo_heads)

    @device_fn
    def v_row_bad(v_src, page, slot, kv_head):
        """Whether the key's V row holds inf or NaN (read from global memory; pass 1 only)."""
        bad = False
        for c in range(CH):
            w0, w1, w2, w3 = vec(v_src, 1, page, slot, kv_head, c * 8)
            if bad_chunk(w0, w1, w2, w3):
                bad = True
        return bad

    @device_fn
    def put(s_kaddr, s_vaddr, s_kpos, s_vpos, k_src, v_src, page, slot, pos, t, hi, kv_head, at, scrub, nan_row):
        """Row addresses and position of one key (a clamped, valid address when it has no key).
        Pass 1 (``scrub``): a key whose V is not finite gets V zero-filled and K read from
        the NaN row, so each row that sees it scores NaN and no other row meets it."""
        p = pos if t < hi else NO_KEY
        ka = addr_of(k_src, 0, page, slot, kv_head, 0)
        vp = p
        if scrub and p != NO_KEY:
            if v_row_bad(v_src, page, slot, kv_head):
                ka = nan_row
                vp = NO_KEY
        s_kaddr[at] = ka
        s_vaddr[at] = addr_of(v_src, 1, page, slot, kv_head, 0)
        s_kpos[at] = p
        s_vpos[at] = vp

    @device_fn
    def next_tile(t, lo, sink_end):
        if t >= sink_end and t + T_k <= lo:
            t += ((lo - t) // T_k) * T_k
        return t

    @device_fn
    def tile(wi, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        tq = lane % 4
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, wi)
        head0 = kv_head * group

        buf = cuda.shared.array(BUF_WORDS, uint32)
        # two tiles' key locations: the current tile's half, the next one's
        s_kaddr = cuda.shared.array(LOCS, uint64)
        s_vaddr = cuda.shared.array(LOCS, uint64)
        s_kpos = cuda.shared.array(LOCS, int32)
        s_vpos = cuda.shared.array(LOCS, int32)       # s_kpos, or NO_KEY: V zero-filled (pass 1)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)
        s_k = (shared_addr(buf) + uint32(15)) & align_mask
        s_v = s_k + uint32(TILE)

        # Q tile staged at the start of the buffer (rows past the tile zero-filled).
        for i in range(Q_ITERS):
            e = tid + i * NT
            r = e // CH
            c = e % CH
            rr = r if r < n_rows else 0
            qi = qo_start + (row0 + rr) // group
            cp_async16(s_k + uint32(r * ROW + c * 16), gaddr(q, (qi, head0 + (row0 + rr) % group, c * 8)),
                       int32(16) if r < n_rows else int32(0))
        commit()
        stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
              s_qpos, s_diag, s_req, s_range)
        wait_all()
        cuda.syncthreads()
        lo = s_range[0]
        hi = s_range[1]
        sink_end = s_range[2]

        row_base = warp * 16
        r_lo = row_base + g
        r_hi = r_lo + 8
        ok_lo = r_lo < n_rows
        ok_hi = r_hi < n_rows
        warp_full = row_base + 16 <= n_rows
        warp_diag = s_diag[row_base]
        for r in range(row_base + 1, row_base + 16):
            warp_diag = min(warp_diag, s_diag[r])
        lr = lane % 8
        lm = lane // 8
        a_off = uint32((lr + 8 * (lm % 2)) * ROW + (lm // 2) * 16)   # Q (A) and V (B, trans) rows
        qf = q_frags(s_k + uint32(row_base * ROW) + a_off)
        k_lane = s_k + uint32(lr * ROW + lm * 16)
        v_lane = s_v + a_off
        cuda.syncthreads()              # Q read: the buffer is K's and V's now

        # t // block as a shift when block is a power of two (page sizes usually are)
        shift = -1
        if block > 0 and block & (block - 1) == 0:
            shift = 31 - cuda.clz(int32(block))
        jk = tid % T_k                  # the key this thread locates (threads >= T_k repeat, unstored)
        nan_row = gaddr(slopes, (NAN_AT,))
        o = o_zero()
        m_lo = neg_inf
        m_hi = neg_inf
        l_lo = float32(0.0)
        l_hi = float32(0.0)
        # Pass 0 is the kernel.  Pass 1 runs only when a row's O came out non-finite
        # with a finite max (a non-finite V met it): the same walk, V checked in put().
        for attempt in range(2):
            scrub = attempt == 1
            t0 = next_tile(kv_begin, lo, sink_end)
            if t0 < hi:
                t = t0 + jk
                page, slot, pos = loc(kv_indices, kv_ptr, kv_base, min(t, hi - 1), block, n_keys, shift)
                if tid < T_k:
                    put(s_kaddr, s_vaddr, s_kpos, s_vpos, k_src, v_src, page, slot, pos, t, hi, kv_head, jk, scrub,
                        nan_row)
            cuda.syncthreads()
            if t0 < hi:
                issue(s_k, s_kaddr, s_kpos, 0, tid)
            commit()
            wait_all()
            cuda.syncthreads()

            o = o_zero()
            m_lo = neg_inf
            m_hi = neg_inf
            l_lo = float32(0.0)
            l_hi = float32(0.0)
            base = 0
            while t0 < hi:
                nbase = T_k - base
                t1 = next_tile(t0 + T_k, lo, sink_end)
                # next tile's page ids: loaded now, used after the math below
                t = t1 + jk
                page, slot, pos = loc(kv_indices, kv_ptr, kv_base, min(t, hi - 1), block, n_keys, shift)
                issue(s_v, s_vaddr, s_vpos, base, tid)
                commit()
                s = qk(qf, k_lane)
                last = t0 + T_k - 1
                if plain and positional and warp_full and last < hi and (not causal or last <= warp_diag):
                    s = scaled(s, scale_log2)
                else:
                    s = masked(s, r_lo, r_hi, ok_lo, ok_hi, tq, s_qpos, s_diag, s_req, s_kpos, base, head0, row0,
                               slopes)
                p, m_lo, m_hi, l_lo, l_hi, alpha_lo, alpha_hi = softmax(s, m_lo, m_hi, l_lo, l_hi)
                if tid < T_k and t1 < hi:
                    put(s_kaddr, s_vaddr, s_kpos, s_vpos, k_src, v_src, page, slot, pos, t, hi, kv_head, nbase + jk,
                        scrub, nan_row)
                wait_all()
                cuda.syncthreads()
                if t1 < hi:
                    issue(s_k, s_kaddr, s_kpos, nbase, tid)
                commit()
                o = pv(o, p, v_lane, alpha_lo, alpha_hi)
                wait_all()
                cuda.syncthreads()
                t0 = t1
                base = nbase
            if scrub:
                break
            fin_lo, fin_hi = o_finite(o)
            again = (ok_lo and m_lo == m_lo and not fin_lo) or (ok_hi and m_hi == m_hi and not fin_hi)
            if cuda.syncthreads_or(int32(1) if again else int32(0)) == 0:
                break

        write_rows(o, m_lo, m_hi, l_lo, l_hi, ok_lo, ok_hi, r_lo, r_hi, tq, qo_start, row0, head0, out_shift,
                   out, lse)

    return tile
