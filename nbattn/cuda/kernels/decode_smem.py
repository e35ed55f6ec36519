"""The decode kernel to read: one query row per request over a paged KV cache,
through shared memory (``path="smem"``; docs/concepts/layouts.md, masks.md, state.md).

This is *the* kernel of the decode idea.  Read it beside the golden model,
:func:`nbattn.reference.batch_decode_paged` (one request at a time through
:func:`nbattn.reference.attend`): the same numbers, computed a tile of keys
at a time with an online softmax instead of one softmax over all keys.  The
fast paths (:mod:`.decode_warp`, :mod:`.decode_tc`) run the same work list
and say only how they differ from this one.  It is the simulator's path and
the fallback wherever a fast path is not eligible.

Decode is memory-bound, so the design is about reading each K/V byte once: a
CTA owns one (work item, KV head) pair, gathers each KV tile from its
scattered pages into shared memory with 16-byte loads, and uses it for every
query head of the GQA group (``HG`` heads fused).

Launch shape: grid ``(num_ctas, num_qo_heads // HG)``; ``blockIdx.x`` picks the
CTA's run of work items (:mod:`nbattn.cuda.decode`), ``blockIdx.y`` a block of
``HG`` query heads of one KV head.  Block ``NT = NX * NY`` threads: lane ``tx``
of a row owns one 16-byte chunk of head_dim (``VEC`` elements), ``ty`` picks
tokens ``ty, ty + NY, ...`` of a tile of ``T = NY * TPT`` tokens.

The math, per query head, in base 2 (``log2(e)`` folded into the score)::

    s_j   = transform(q . k_j * sm_scale) * log2(e)        visible keys; -inf otherwise
    m'    = max(m, max_j s_j)                                running max
    alpha = 2^(m - m')                                       rescale of what was summed
    p_j   = 2^(s_j - m')
    l'    = alpha * l + sum_j p_j                            running mass
    acc'  = alpha * acc + sum_j p_j * v_j                    running output
    o     = acc / l,   lse = m + log2(l)                     after the last tile

Sigmoid attention has no max: ``p_j = sigmoid(s_j + bias)``, ``o = sum_j p_j v_j``.

An fp8 cache (``cfg.kv_code``): the tiles hold raw fp8 bytes, a lane's chunk is
16 values (``VEC = 16``, its q chunk two 16-byte loads), the bytes become float32
when a chunk is unpacked (:mod:`nbattn.cuda.blocks.fp8`), ``sm_scale`` arrives with
``k_scale`` folded in, and ``o = v_scale * acc / l``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64

from ..blocks import nanrule as NR
from ..blocks.fp8 import fp8_unpack4
from ..blocks.primitives import ELEMS_PER_WORD, SHARED_ALIGN, device_fn, element_io, exp2f, ld_v4, load_v4, st_v4
from ..blocks.rope import chunk_rotation, partner_chunk
from ..blocks.softmax import rescale
from ..blocks.variants import LOG2E, sigmoid_weight, variant_device_fns
from ..host.driver import jit_kernel
from .decode_common import NEG_INF, work_item

__all__ = ["build_smem_kernel"]


def build_smem_kernel(cfg):
    """Compile the shared-memory decode kernel for a
    :class:`~nbattn.cuda.kernels.decode_common.DecodeConfig` (see module doc)."""
    D = cfg.head_dim
    HG = cfg.heads_per_cta
    W = cfg.words_per_row
    NX = cfg.lanes
    NT = cfg.nthreads
    NY = NT // NX
    T = cfg.tile_tokens
    TPT = T // NY
    VEC = 4 * ELEMS_PER_WORD[cfg.kv]      # elements of one 16-byte K/V chunk (16 for fp8)
    QW = cfg.q_words_per_row
    QL = VEC // (4 * ELEMS_PER_WORD[cfg.code])   # 16-byte q loads per chunk (2 for fp16 q, fp8 K/V)
    QE = VEC // QL
    RED = max(HG * T * NX, NY * D)
    TILE_WORDS, P_LEN, HG_VEC = T * W, HG * T, HG * VEC   # shared/local array sizes
    NHD = cfg.kv_layout == "NHD"
    SIGMOID = cfg.variant.use_sigmoid
    ALIGNED = cfg.aligned
    _, store_elem, q_unpack4 = element_io(cfg.code)
    # K/V: the cache's own unpack (fp8 bytes dequantized in registers, blocks/fp8.py)
    unpack4 = fp8_unpack4(cfg.kv_code) if cfg.kv_code else q_unpack4
    SCALE_V = cfg.kv_code is not None    # fp8: o = v_scale * acc / l (k_scale is in sm_scale)
    transform, keep = variant_device_fns(cfg.variant)
    poison = NR.poison_kv(cfg.kv)
    # RoPE at attention time (blocks/rope.py): q turns by its position, each key by its own
    ROPE = cfg.variant.has_rope
    rotate = chunk_rotation(D, VEC, cfg.variant.rope_scale, cfg.variant.rope_theta)
    partner = partner_chunk(D, VEC)

    @device_fn
    def read4(arr, i):   # 16-byte global load when the base pointers allow it
        if ALIGNED:
            return load_v4(arr, i)
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, num_kv_heads, num_qo_heads,
               cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias, v_scale):
        k_s = cuda.shared.array(TILE_WORDS, np.uint32, alignment=SHARED_ALIGN)   # the tile's K rows
        v_s = cuda.shared.array(TILE_WORDS, np.uint32, alignment=SHARED_ALIGN)   # and V rows (raw words)
        red = cuda.shared.array(RED, np.float32)      # partial dots, then partial accumulators
        p_s = cuda.shared.array(P_LEN, np.float32)    # s_j, then p_j, of every head and token
        m_s = cuda.shared.array(HG, np.float32)       # m of every head
        f_s = cuda.shared.array(HG, np.float32)       # alpha of every head
        qv = cuda.local.array(HG_VEC, np.float32)     # my chunk of every head's q
        acc = cuda.local.array(HG_VEC, np.float32)    # my chunk of every head's acc (my tokens only)
        lacc = cuda.local.array(HG, np.float32)       # l of my tokens only
        xf = cuda.local.array(VEC, np.float32)
        xp = cuda.local.array(VEC, np.float32)       # RoPE: the partner chunk (elements +- D/2)
        xr = cuda.local.array(VEC, np.float32)       # RoPE: my chunk, turned

        tid = cuda.threadIdx.x
        tx = tid % NX
        ty = tid // NX
        h0 = cuda.blockIdx.y * HG
        group = num_qo_heads // num_kv_heads
        kvh = h0 // group
        ps = int64(page_size)
        hkv = int64(num_kv_heads)

        for item in range(cta_indptr[cuda.blockIdx.x], cta_indptr[cuda.blockIdx.x + 1]):
            r, kv_start, kv_end, slot, page_base, q_idx = work_item(
                item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size)

            # q chunk of every head of the block, in registers; m = -inf, l = 0, acc = 0
            for g in range(HG):
                q_row = (int64(r) * num_qo_heads + h0 + g) * QW
                if ROPE:        # q turned to its position q_idx (the request's last key)
                    for c in range(QL):
                        w0, w1, w2, w3 = read4(q_w, q_row + (tx * QL + c) * 4)
                        q_unpack4(w0, w1, w2, w3, xf, c * QE)
                        w0, w1, w2, w3 = read4(q_w, q_row + (partner(tx) * QL + c) * 4)
                        q_unpack4(w0, w1, w2, w3, xp, c * QE)
                    rotate(xf, xp, qv, g * VEC, tx * VEC, q_idx)
                else:
                    for c in range(QL):
                        w0, w1, w2, w3 = read4(q_w, q_row + (tx * QL + c) * 4)
                        q_unpack4(w0, w1, w2, w3, qv, g * VEC + c * QE)
                lacc[g] = 0.0
                for e in range(VEC):
                    acc[g * VEC + e] = 0.0
            for g in range(tid, HG, NT):
                m_s[g] = NEG_INF

            for tile in range(kv_start, kv_end, T):
                # -- load: gather this tile's K and V rows from their pages ------------
                for i in range(TPT):
                    t = ty + i * NY
                    pos = tile + t
                    k0 = k1 = k2 = k3 = v0 = v1 = v2 = v3 = np.uint32(0)
                    if pos < kv_end:
                        # unsigned 32-bit division: far cheaper than numba's int64 floor division
                        page_idx = np.uint32(pos) // np.uint32(page_size)
                        within = int64(np.uint32(pos) - page_idx * np.uint32(page_size))
                        page = int64(kv_indices[page_base + int64(page_idx)])
                        if NHD:
                            row_k = ((page * 2 * ps + within) * hkv + kvh) * W
                            row_v = (((page * 2 + 1) * ps + within) * hkv + kvh) * W
                        else:
                            row_k = ((page * 2 * hkv + kvh) * ps + within) * W
                            row_v = (((page * 2 + 1) * hkv + kvh) * ps + within) * W
                        k0, k1, k2, k3 = read4(kv_w, row_k + tx * 4)
                        v0, v1, v2, v3 = read4(kv_w, row_v + tx * 4)
                        # the NaN rule: a non-finite V chunk poisons its K chunk
                        k0, k1, k2, k3, v0, v1, v2, v3 = poison(k0, k1, k2, k3, v0, v1, v2, v3)
                    st_v4(k_s, t * W + tx * 4, k0, k1, k2, k3)
                    st_v4(v_s, t * W + tx * 4, v0, v1, v2, v3)
                cuda.syncthreads()

                # -- compute qk: s_j = transform(q . k_j * sm_scale) * log2(e) ---------
                # each thread dots its chunk of every head's q with its tokens' K chunk
                for i in range(TPT):
                    t = ty + i * NY
                    w0, w1, w2, w3 = ld_v4(k_s, t * W + tx * 4)
                    unpack4(w0, w1, w2, w3, xf, 0)
                    if ROPE:    # the key turned to its position tile + t
                        w0, w1, w2, w3 = ld_v4(k_s, t * W + partner(tx) * 4)
                        unpack4(w0, w1, w2, w3, xp, 0)
                        rotate(xf, xp, xr, 0, tx * VEC, tile + t)
                        for e in range(VEC):
                            xf[e] = xr[e]
                    for g in range(HG):
                        dot = float32(0.0)
                        for e in range(VEC):
                            dot += qv[g * VEC + e] * xf[e]
                        red[(g * T + t) * NX + tx] = dot
                cuda.syncthreads()
                # one thread per (head, token) adds the NX partial dots, applies the scale,
                # the variant's transform and its mask (a hidden key scores -inf)
                for j in range(tid, HG * T, NT):
                    g = j // T
                    t = j - g * T
                    s = float32(0.0)
                    for x in range(NX):
                        s += red[j * NX + x]
                    pos = tile + t
                    h = h0 + g
                    raw = s * sm_scale
                    s = NR.checked(raw, transform(raw, r, h, q_idx, pos, slopes[h]))
                    ok = pos < kv_end and keep(r, h, q_idx, pos)
                    if SIGMOID:
                        p_s[j] = sigmoid_weight(s, sigmoid_bias) if ok else 0.0
                    else:
                        p_s[j] = s * float32(LOG2E) if ok else NEG_INF
                cuda.syncthreads()

                # -- update m and l: m' = max(m, max_j s_j), alpha = 2^(m - m'),
                #    p_j = 2^(s_j - m'), l' = alpha * l + sum_j p_j ----------------------
                if not SIGMOID:
                    for g in range(tid, HG, NT):
                        m_old = m_s[g]
                        m_new = m_old
                        for t in range(T):
                            m_new = NR.max_nan(m_new, p_s[g * T + t])   # NaN-sticky: a NaN row stays NaN
                        f_s[g] = rescale(m_old, m_new)
                        m_s[g] = m_new
                    cuda.syncthreads()
                    for j in range(tid, HG * T, NT):
                        m = m_s[j // T]
                        p_s[j] = float32(0.0) if m == NEG_INF else exp2f(p_s[j] - m)   # no key seen yet: 0
                    cuda.syncthreads()
                    for g in range(HG):
                        f = f_s[g]
                        lacc[g] *= f                 # alpha * l (the sum of p joins it below)
                        for e in range(VEC):
                            acc[g * VEC + e] *= f    # alpha * acc

                # -- update acc: acc' = alpha * acc + sum_j p_j * v_j (and l += p_j) -----
                # each thread for its tokens and its chunk of head_dim
                for i in range(TPT):
                    t = ty + i * NY
                    w0, w1, w2, w3 = ld_v4(v_s, t * W + tx * 4)
                    unpack4(w0, w1, w2, w3, xf, 0)
                    for g in range(HG):
                        p = p_s[g * T + t]
                        lacc[g] += p
                        for e in range(VEC):
                            acc[g * VEC + e] += p * xf[e]
                cuda.syncthreads()   # the next tile overwrites k_s, v_s, p_s

            # -- the state: add the NY partial accumulators of each head, then
            #    o = acc / l, lse = m + log2(l), written to the row or to a partial slot
            for g in range(HG):
                for e in range(VEC):
                    red[ty * D + tx * VEC + e] = acc[g * VEC + e]
                if tx == 0:
                    p_s[ty] = lacc[g]
                cuda.syncthreads()
                h = h0 + g
                l = float32(0.0)
                for y in range(NY):
                    l += p_s[y]
                if SIGMOID:
                    inv_l = v_scale if SCALE_V else float32(1.0)
                    row_lse = float32(math.nan)
                elif m_s[g] != m_s[g] or l != l:     # a visible key was non-finite
                    inv_l = NR.NAN_F32
                    row_lse = NR.NAN_F32
                elif m_s[g] == NEG_INF:              # no visible key (a flag, not l > 0)
                    inv_l = float32(0.0)
                    row_lse = NEG_INF
                else:
                    inv_l = float32(1.0) / l
                    if SCALE_V:
                        inv_l *= v_scale
                    row_lse = m_s[g] + math.log2(l)
                for d in range(tid, D, NT):
                    o = float32(0.0)
                    for y in range(NY):
                        o += red[y * D + d]
                    o *= inv_l
                    if slot < 0:
                        store_elem(out, (int64(r) * num_qo_heads + h) * D + d, o)
                    else:
                        part_o[(int64(slot) * num_qo_heads + h) * D + d] = o
                if tid == 0:
                    if slot < 0:
                        lse[int64(r) * num_qo_heads + h] = row_lse
                    else:
                        part_lse[int64(slot) * num_qo_heads + h] = row_lse
                cuda.syncthreads()

    return jit_kernel(kernel)
