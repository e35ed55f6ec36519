"""Decode on tensor cores (``path="tc"``, GPU only, fp16/bf16): the group's heads
as one ``mma.sync`` operand.

How it differs from the teaching kernel (:mod:`.decode_smem`): same work list,
arguments and results, and the launch of :mod:`.decode_warp` (1-D grid, head
blocks of one item adjacent).  For GQA groups of at least
``DecodeTuning.tc_min_group`` heads the per-head CUDA-core math nears the
FMA/issue limits, so both products run on tensor cores instead: ``S = Q K^T``
with the group's heads as the rows of A, and ``O^T += V^T P^T`` with the
scores' C fragments reused as the B fragments of P^T.  There is no shared
memory in the main loop (K/V go straight from 16-byte loads into fragments);
each warp keeps its own online-softmax state over its tiles, and the warps'
states meet once at the end through the merge rule.

Small batches that split into one wave run the CTA shape
``DecodeTuning.tc_split_shape`` (one CTA an SM), launched programmatically
(``DecodeTuning.programmatic``).  There, when launched with ``prefetch``, a CTA
of at most ``DecodeTuning.prefetch_max_heads`` heads first prefetches the first
``DecodeTuning.prefetch_steps`` steps of K/V of its first work item into L2
before its programmatic dependency wait: while the previous call's merge ends,
HBM would otherwise idle.  The page ids for it are
read before the wait, so they are hints only: read through L2
(``load_i32_cg``), clamped into the page table and the pool, and used for
nothing but prefetches; the loads after the wait read the page table again.
L2 is where every write lands, so a prefetched line is never stale.

An fp8 cache (``cfg.kv_code``) changes only how K/V words arrive: a lane's
16-byte load holds 16 fp8 values, which ``cvt.rn.f16x2.{e4m3,e5m2}x2`` (and,
for bf16 q, on through float32) turns into the eight fp16 / bf16 words the
fragments take (exact: every fp8 value is an fp16 and a bf16 value), so a
token takes half the loads and the math is unchanged.  A conversion waits for its
load, so V (and, one step ahead, K) is kept raw until the step needs it, as the
fp16 words are: V converts after the scores, K-ahead at the end of the step.
Lane ``t``'s load ``jj`` holds dims ``64 jj + 16 t ..+16``, which stand where
the fp16 layout puts chunks ``2 jj`` and ``2 jj + 1``; q is read with the same
permutation, and the accumulator's dims are placed back by it.  ``sm_scale``
carries ``k_scale``, and the accumulators are scaled by ``v_scale`` as they
leave the warp.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32

from ..blocks import mma as MMA
from ..blocks import nanrule as NR
from ..blocks.mma import grid_dependents_launch
from ..blocks.primitives import ELEMS_PER_WORD, device_fn, element_io, load_i32_cg, load_v4, prefetch_l2
from ..blocks.primitives import shfl_idx_f32, shfl_xor_f32
from ..blocks.softmax import online_step
from ..blocks.variants import LOG2E, variant_device_fns
from ..host.driver import jit_kernel
from .decode_common import NEG_INF, head_block, make_kv_addressing, make_state_writer, page_slot, work_item

__all__ = ["build_tc_kernel"]


def build_tc_kernel(cfg, nwarps: int, min_blocks: int = 3):
    """Decode with ``mma.sync.m16n8k16`` for a block of up to 8 query heads of one
    KV head; same work list, arguments and launch as
    :func:`~nbattn.cuda.kernels.decode_warp.build_warp_kernel`.

    Per warp and step a tile of 16 tokens (two halves of 8; lane ``4g + t``
    loads tokens ``g`` and ``8 + g`` of the tile, 16 bytes at a time):

    * ``S = Q K^T`` as heads x tokens (8 heads padded to the 16 rows of A, one
      n-tile of 8 tokens per half).  A lane's 16 bytes ``32j + 8t ..+8`` of a
      K row are the B fragments of two k-steps (words 0,1 and 2,3); Q's A
      fragments are loaded with the same permutation of head_dim, so the dot
      products are unchanged.
    * ``O^T += V^T P^T`` (head_dim x heads, k = the 16 tokens): the C fragment
      of S (head ``g``, tokens ``2t, 2t+1``) *is* the B fragment of P^T, and
      ``movmatrix.trans`` turns each 16-byte word of a lane's V row into an A
      fragment of V^T (row ``g`` of word ``i`` of chunk ``j`` is dim
      ``32j + 8(g >> 1) + 2i + (g & 1)``).  No shared memory in the loop.
    * Online softmax per head row on the C fragments (quad shuffles); the
      accumulator's columns are heads ``2t, 2t+1``, whose rescale factors
      are fetched with two indexed shuffles.

    Each warp keeps its own state over tiles ``warp, warp + NW, ...``; the
    warps' states meet once at the end (merge rule, docs/concepts/state.md), as in the
    CUDA-core kernel.

    With at most 8 warps an SM (the small-batch shapes: registers to spare) K
    runs one step ahead: a step issues its V loads and the next
    step's K loads before its math, so a warp's loads stay in flight while it
    computes.  That shape holds 8 KB per warp in flight, 64 KB per SM."""
    D = cfg.head_dim
    HG = cfg.heads_per_cta
    assert HG <= 8 and D % 32 == 0
    EPW = ELEMS_PER_WORD[cfg.code]
    W = D // EPW                 # words of a q row
    NJ = D // 32                 # 32-dim chunks: one 16-byte load per lane per token (fp16)
    FP8 = cfg.kv_code is not None
    LJ = NJ // 2 if FP8 else NJ  # 16-byte K/V loads per lane per token (fp8: 16 dims each)
    to_pairs = MMA.fp8x4_to_16x2(cfg.kv_code, cfg.code) if FP8 else None    # fp8 -> q's 16-bit type
    QL, HL, AL = 4 * NJ, 4 * NJ, 8 * NJ   # q words, words per token half, accumulator floats
    KL = 2 * HL
    RL = 4 * LJ                  # raw words per token half (fp8: half of HL)
    RW = 2 * RL
    NW = nwarps
    NT = 32 * NW
    STEP = 16 * NW
    ACC_LEN, ML_LEN = NW * 8 * D, NW * 8
    # K one step ahead needs ~30 more registers (ptxas, sm_90: 242 at 8 warps x 1 CTA, i.e.
    # at most 8 warps an SM; 6 x 2 and 4 x 3 would spill)
    AHEAD = NW * min_blocks <= 8
    LEAD = STEP if AHEAD else 0
    tuning = cfg.tuning
    # steps into L2 (module doc); the lines it picks are those of an fp16 row
    PF = tuning.prefetch_steps if AHEAD and HG <= tuning.prefetch_max_heads and not FP8 else 0
    PFL = max(1, 2 * PF)
    NHD = cfg.kv_layout == "NHD"
    var = cfg.variant
    ALIBI = var.has_alibi
    PLAIN = not ALIBI and not var.has_soft_cap and var.score_mod is None
    MASKED = var.window_left >= 0 or var.mask_mod is not None
    _, store_elem, _ = element_io(cfg.code)
    transform, keep = variant_device_fns(var)
    poison = NR.poison_kv(cfg.code)
    write_states = make_state_writer(HG, D, NT, NW, 8, False, store_elem)
    kv_addressing = make_kv_addressing(D // ELEMS_PER_WORD[cfg.kv], NHD)
    mma = MMA.mma_f16 if cfg.code == "f16" else MMA.mma_bf16
    pack = MMA.pack_f16x2 if cfg.code == "f16" else MMA.pack_bf16x2
    movt = MMA.movmatrix_t

    @device_fn
    def page_row(pos, kv_end, page, page_size, ps_shift, page_words, slot_words, my_off):
        """Word offset of my 16-byte chunks of token ``pos``'s K row in ``page``; -1 past the chunk."""
        if pos >= kv_end:
            return int64(-1)
        _, within = page_slot(pos, page_size, ps_shift)
        return int64(page) * page_words + int64(within * slot_words) + my_off

    @device_fn
    def kv_row(pos, kv_end, kv_indices, page_base, page_size, ps_shift, page_words, slot_words, my_off):
        """:func:`page_row` with the page looked up in the page table."""
        if pos >= kv_end:
            return int64(-1)
        pi, _ = page_slot(pos, page_size, ps_shift)
        return page_row(pos, kv_end, kv_indices[page_base + int64(pi)], page_size, ps_shift, page_words,
                        slot_words, my_off)

    @device_fn
    def load_row(kv_w, row, dst, o0):
        """My LJ 16-byte chunks of the row at word ``row`` (zeros for -1) into ``dst[o0:]``
        as words of 16-bit pairs (an fp8 chunk becomes eight)."""
        for j in range(LJ):
            w0 = w1 = w2 = w3 = uint32(0)
            if row >= 0:
                w0, w1, w2, w3 = load_v4(kv_w, row + j * 16)
            if FP8:
                o = o0 + 8 * j
                dst[o], dst[o + 1] = to_pairs(w0)
                dst[o + 2], dst[o + 3] = to_pairs(w1)
                dst[o + 4], dst[o + 5] = to_pairs(w2)
                dst[o + 6], dst[o + 7] = to_pairs(w3)
            else:
                o = o0 + 4 * j
                dst[o] = w0
                dst[o + 1] = w1
                dst[o + 2] = w2
                dst[o + 3] = w3

    @device_fn
    def load_raw(kv_w, row, dst, o0):
        """fp8: my LJ 16-byte chunks of the row at word ``row`` (zeros for -1) into
        ``dst[o0:]`` as they are, converted later by :func:`to_pairs_row` (a conversion
        right after the load would wait for the load there)."""
        for j in range(LJ):
            w0 = w1 = w2 = w3 = uint32(0)
            if row >= 0:
                w0, w1, w2, w3 = load_v4(kv_w, row + j * 16)
            dst[o0 + 4 * j] = w0
            dst[o0 + 4 * j + 1] = w1
            dst[o0 + 4 * j + 2] = w2
            dst[o0 + 4 * j + 3] = w3

    @device_fn
    def to_pairs_row(src, dst):
        """fp8: both halves' raw words of :func:`load_raw` as the 16-bit pairs
        :func:`load_row` gives (``dst`` of ``KL`` words)."""
        for e in range(RW):
            dst[2 * e], dst[2 * e + 1] = to_pairs(src[e])

    @device_fn
    def q_word(j, t):
        """Word of a q row where lane ``t``'s 8 dims of chunk ``j`` start (fp16: dims
        ``32 j + 8 t``; fp8 caches: dims ``64 (j >> 1) + 16 t + 8 (j & 1)``, module doc)."""
        if FP8:
            return 32 * (j >> 1) + 8 * t + 4 * (j & 1)
        return 16 * j + 4 * t

    @device_fn
    def acc_dim(j, g, i):
        """The dim of row ``g`` of word ``i`` of chunk ``j`` of my V row after the transpose."""
        if FP8:
            return 64 * (j >> 1) + 16 * (g >> 1) + 8 * (j & 1) + 2 * i + (g & 1)
        return 32 * j + 8 * (g >> 1) + 2 * i + (g & 1)

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, ps_shift, num_kv_heads,
               num_qo_heads, n_head_blocks, prefetch, cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias, v_scale):
        st_acc = cuda.shared.array(ACC_LEN, np.float32)
        st_m = cuda.shared.array(ML_LEN, np.float32)
        st_l = cuda.shared.array(ML_LEN, np.float32)
        qa = cuda.local.array(QL, np.uint32)
        kw = cuda.local.array(KL, np.uint32)
        kn = cuda.local.array(KL, np.uint32)
        rk = cuda.local.array(2, np.int64)
        vw = cuda.local.array(KL, np.uint32)
        raw_v = cuda.local.array(RW, np.uint32)     # fp8: V (and K one step ahead) before conversion
        raw_k = cuda.local.array(RW, np.uint32)
        acc = cuda.local.array(AL, np.float32)
        sc = cuda.local.array(4, np.float32)
        pg = cuda.local.array(2, np.int64)
        pf_row = cuda.local.array(PFL, np.int64)

        grid_dependents_launch()     # a programmatically launched merge may start its prologue now
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        # h_row: my score row's head (padding rows borrow the last)
        cta, h0, h_row, kvh = head_block(n_head_blocks, HG, num_qo_heads, num_kv_heads, g)
        v_off, page_words, slot_words, my_off = kv_addressing(page_size, num_kv_heads, kvh, t)
        qscale = float32(sm_scale * float32(LOG2E))
        slope = slopes[h_row] if ALIBI else float32(0.0)
        zero = float32(0.0)

        # before the dependency wait: the first PF steps of my first item into L2 (module doc);
        # lanes t = 0, 1 take the two 128-byte lines of a token's K row, t = 2, 3 those of V
        c0 = cta_indptr[cta]
        if PF > 0 and prefetch != 0 and c0 < cta_indptr[cta + 1]:
            ks0, ke0 = w_kv_start[c0], w_kv_end[c0]
            pb = int64(load_i32_cg(kv_indptr, w_request[c0]))
            last_idx = int64(kv_indices.shape[0]) - 1
            last_page = int64(kv_w.shape[0]) // page_words - 1
            line = my_off - t * 4 + (t & 1) * 32 + (v_off if t >= 2 else int64(0))
            for e in range(2 * PF):
                pos = ks0 + (e >> 1) * STEP + warp * 16 + 8 * (e & 1) + g
                pf_row[e] = -1
                if pos < ke0:
                    pi, within = page_slot(pos, page_size, ps_shift)
                    page = int64(load_i32_cg(kv_indices, min(max(pb + int64(pi), int64(0)), last_idx)))
                    pf_row[e] = min(max(page, int64(0)), last_page) * page_words + int64(within * slot_words)
            for e in range(2 * PF):
                if pf_row[e] >= 0:
                    prefetch_l2(kv_w, pf_row[e] + line)

        for item in range(cta_indptr[cta], cta_indptr[cta + 1]):
            r, kv_start, kv_end, slot, page_base, q_idx = work_item(
                item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size)

            for j in range(NJ):
                w0 = w1 = w2 = w3 = uint32(0)
                if g < HG:
                    w0, w1, w2, w3 = load_v4(q_w, (int64(r) * num_qo_heads + h0 + g) * W + q_word(j, t))
                qa[4 * j] = w0
                qa[4 * j + 1] = w1
                qa[4 * j + 2] = w2
                qa[4 * j + 3] = w3
            # the NaN rule (nbattn.cuda.blocks.nanrule, "fast pass, checked result"): the
            # first pass keeps no rule in its loop; when its result shows a non-finite
            # value anywhere in the CTA, the item runs again with the rule kept key by key
            for careful in (False, True):
                for e in range(AL):
                    acc[e] = 0.0
                m_row = NEG_INF
                l_part = float32(0.0)
                raw_sum = float32(0.0)       # every raw score this lane took: non-finite if one was
                first = kv_start + warp * 16
                # AHEAD: K runs one step ahead of V, so the next step's K loads are in flight
                # during this step's math (8 warps a CTA hold too few bytes in flight otherwise)
                if AHEAD:
                    for hf in range(2):
                        rk[hf] = kv_row(first + 8 * hf + g, kv_end, kv_indices, page_base, page_size, ps_shift,
                                        page_words, slot_words, my_off)
                        load_row(kv_w, rk[hf], kw, hf * HL)
                for hf in range(2):
                    pos = first + LEAD + 8 * hf + g
                    pg[hf] = 0
                    if pos < kv_end:
                        pi, _ = page_slot(pos, page_size, ps_shift)
                        pg[hf] = kv_indices[page_base + int64(pi)]

                for base in range(first, kv_end, STEP):      # the same trip count in all lanes of a warp
                    if not AHEAD:
                        for hf in range(2):
                            rk[hf] = page_row(base + 8 * hf + g, kv_end, pg[hf], page_size, ps_shift, page_words,
                                              slot_words, my_off)
                            load_row(kv_w, rk[hf], kw, hf * HL)
                    for hf in range(2):
                        if FP8:      # raw V now, converted after the scores (the fp16 order of waits)
                            load_raw(kv_w, rk[hf] + v_off if rk[hf] >= 0 else rk[hf], raw_v, hf * RL)
                        else:
                            load_row(kv_w, rk[hf] + v_off if rk[hf] >= 0 else rk[hf], vw, hf * HL)
                    if FP8 and careful:
                        to_pairs_row(raw_v, vw)
                    if careful:                          # step 1 of the rule: a bad V chunk poisons its K
                        for o in range(0, KL, 4):
                            (kw[o], kw[o + 1], kw[o + 2], kw[o + 3], vw[o], vw[o + 1], vw[o + 2],
                             vw[o + 3]) = poison(kw[o], kw[o + 1], kw[o + 2], kw[o + 3], vw[o], vw[o + 1],
                                                 vw[o + 2], vw[o + 3])
                    if AHEAD:
                        for hf in range(2):
                            rk[hf] = page_row(base + STEP + 8 * hf + g, kv_end, pg[hf], page_size, ps_shift,
                                              page_words, slot_words, my_off)
                            if FP8:
                                load_raw(kv_w, rk[hf], raw_k, hf * RL)
                            else:
                                load_row(kv_w, rk[hf], kn, hf * HL)
                    for hf in range(2):
                        pos = base + LEAD + STEP + 8 * hf + g
                        if pos < kv_end:
                            pi, _ = page_slot(pos, page_size, ps_shift)
                            pg[hf] = kv_indices[page_base + int64(pi)]

                    # S: heads x 8 tokens per half; two independent chains per half
                    for hf in range(2):
                        xa0 = xa1 = xb0 = xb1 = zero
                        for j in range(NJ):
                            o = hf * HL + 4 * j
                            xa0, xa1, _, _ = mma(qa[4 * j], uint32(0), qa[4 * j + 1], uint32(0),
                                                 kw[o], kw[o + 1], xa0, xa1, zero, zero)
                            xb0, xb1, _, _ = mma(qa[4 * j + 2], uint32(0), qa[4 * j + 3], uint32(0),
                                                 kw[o + 2], kw[o + 3], xb0, xb1, zero, zero)
                        sc[2 * hf] = xa0 + xb0
                        sc[2 * hf + 1] = xa1 + xb1

                    mx = NEG_INF
                    for e in range(4):
                        pos = base + 8 * (e >> 1) + 2 * t + (e & 1)
                        raw = sc[e] * qscale if PLAIN else sc[e] * sm_scale
                        raw_sum += raw
                        s = raw if PLAIN else transform(raw, r, h_row, q_idx, pos, slope) * float32(LOG2E)
                        if careful:
                            s = NR.checked(raw, s)
                        ok = pos < kv_end
                        if MASKED:
                            ok = ok and keep(r, h_row, q_idx, pos)
                        s = s if ok else NEG_INF
                        sc[e] = s
                        mx = NR.max_nan(mx, s) if careful else max(mx, s)
                    if careful:
                        mx = NR.max_nan(mx, shfl_xor_f32(mx, 1))
                        mx = NR.max_nan(mx, shfl_xor_f32(mx, 2))
                        m_new = NR.max_nan(m_row, mx)
                    else:
                        mx = max(mx, shfl_xor_f32(mx, 1))
                        mx = max(mx, shfl_xor_f32(mx, 2))
                        m_new = max(m_row, mx)
                    f, l_part = online_step(sc, 4, m_row, m_new, l_part)
                    m_row = m_new
                    b0 = pack(sc[0], sc[1])
                    b1 = pack(sc[2], sc[3])
                    f0 = shfl_idx_f32(f, 8 * t)          # columns 2t, 2t+1 of O^T are heads 2t, 2t+1
                    f1 = shfl_idx_f32(f, 8 * t + 4)
                    if FP8 and not careful:
                        to_pairs_row(raw_v, vw)
                    # O^T += V^T P^T: 16 dims x 8 heads per mma, k = the tile's 16 tokens
                    for j in range(NJ):
                        for pp in range(2):
                            o = 4 * j + 2 * pp
                            a0 = movt(vw[o])
                            a1 = movt(vw[o + 1])
                            a2 = movt(vw[HL + o])
                            a3 = movt(vw[HL + o + 1])
                            c = 4 * (2 * j + pp)
                            d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[c] * f0, acc[c + 1] * f1,
                                                 acc[c + 2] * f0, acc[c + 3] * f1)
                            acc[c] = d0
                            acc[c + 1] = d1
                            acc[c + 2] = d2
                            acc[c + 3] = d3
                    if AHEAD and FP8:
                        to_pairs_row(raw_k, kw)
                    elif AHEAD:
                        for e in range(KL):
                            kw[e] = kn[e]

                if careful or not cuda.syncthreads_or(NR.state_suspect(acc, AL, m_row, l_part, raw_sum)):
                    break

            # my row's mass, then the warps' states through shared memory
            l_row = l_part + shfl_xor_f32(l_part, 1)
            l_row += shfl_xor_f32(l_row, 2)
            vs = v_scale if FP8 else float32(1.0)      # o is linear in acc: v_scale joins here
            for j in range(NJ):
                for pp in range(2):
                    for c in range(4):
                        head = 2 * t + (c & 1)
                        st_acc[(warp * 8 + head) * D + acc_dim(j, g, 2 * pp + (c >> 1))] = acc[4 * (2 * j + pp) + c] * vs
            if t == 0:
                st_m[warp * 8 + g] = m_row
                st_l[warp * 8 + g] = l_row
            write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o, part_lse)

    return jit_kernel(kernel, launch_bounds=(NT, min_blocks))

