"""Decode on the GPU without block barriers in the main loop (``path="warp"``).

How it differs from the teaching kernel (:mod:`.decode_smem`), which it
replaces on a GPU wherever head_dim maps onto a warp (16-byte chunks, a
power-of-two number of lanes per token) and the arrays are 16-byte aligned:
same work list, same arguments but a 1-D grid, same results.  Decode is a
pure stream of K/V bytes, and there every block barrier per tile is a bubble
in that stream, so:

* No shared-memory staging: a lane owns one 16-byte chunk (``VEC`` elements)
  of head_dim, so ``NX = D / VEC`` lanes hold one token's K row and a warp
  covers ``TW = 32 / NX`` tokens at a time.  Every load is one
  ``ld.global.nc.v4`` (~1.0 of copy bandwidth, docs/gpu.md), straight into
  registers.
* Each (warp, token-slot) row walks its own strided subset of the item's
  tokens and keeps its *own* online-softmax state; rows never wait for each
  other.  They meet once, at the end, through the merge rule
  (docs/concepts/state.md, :func:`~.decode_common.make_state_writer`).
* ``U`` tokens per row are loaded before any is used, and the page ids of the
  next step are fetched right after, so a row has ``2U`` 16-byte loads plus
  the index loads of the next step in flight while it does arithmetic.
* The teaching kernel adds a score's partial dots through shared memory; here
  summing over the token's ``NX`` lanes is a reduce-scatter of shuffles: at
  each xor level a lane keeps half of its heads and trades the other half
  with its partner, so after ``log2(HP)`` levels each lane holds one head
  (the top bits of its chunk index) and a plain butterfly finishes it.  That
  is ``HP - 1 + log2(NX / HP)`` shuffles per token instead of ``HP *
  log2(NX)``, and the variant, mask, exponent and softmax state are computed
  once per head rather than by every lane for every head.  The probabilities
  (and, once per step, the rescale factors) are then fetched by every lane
  with ``HG`` indexed shuffles for its ``p * V`` update.  ``HG`` heads are
  padded to ``HP``, a power of two; dummy heads have q = 0 and are never
  written.
* ``m`` is updated once per step of ``U`` tokens (one rescale of the
  accumulator per step, not per tile of the CTA).  Without a logits
  transform, ``sm_scale * log2(e)`` is folded into q once.

Launch shape: 1-D grid of ``num_ctas * n_head_blocks`` CTAs, head blocks of
one item adjacent in launch order (a group split over two CTAs reads the same
K/V at the same time, so the second read is an L2 hit); ``NW`` warps per CTA
(``DecodeTuning.warp_warps``).  Shared memory is used only for the final
combine: ``R = NW * TW`` rows x ``HG`` heads x ``D`` floats (16 KB for HG = 4)
plus their ``m``/``l``.  Under the simulator the shuffles are emulated
block-wide (tests force this path there with ``DECODE.replace(path="warp")``).

An fp8 cache (``cfg.kv_code``) changes the widths only: a lane's 16-byte load holds
16 fp8 values (``VEC = 16``, ``NX = D / 16`` lanes a token, q read with two loads),
unpacked to float32 by :mod:`nbattn.cuda.blocks.fp8`; ``sm_scale`` carries
``k_scale`` and the accumulators are scaled by ``v_scale`` before the rows meet.

RoPE at attention time (``pos_encoding_mode="ROPE_LLAMA"``) turns q once per item
and every key as it arrives: a chunk's partner elements (``± D/2``) sit ``NX / 2``
lanes away, one shuffle each, and the turn is
:func:`~nbattn.cuda.blocks.rope.fast_rotation`.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32

from ..blocks import nanrule as NR
from ..blocks.fp8 import fp8_unpack4
from ..blocks.mma import grid_dependents_launch
from ..blocks.primitives import (ELEMS_PER_WORD, SHARED_ALIGN, device_fn, element_io, load_v4, shfl_idx_f32,
                                 shfl_xor_f32, st_v4)
from ..blocks.rope import fast_rotation, turns_table
from ..blocks.softmax import online_step
from ..blocks.variants import LOG2E, sigmoid_weight, variant_device_fns
from ..host.driver import jit_kernel
from .decode_common import (NEG_INF, head_block, make_kv_addressing, make_state_writer, page_slot, warp_geometry,
                            work_item)

__all__ = ["build_warp_kernel"]


def build_warp_kernel(cfg, nwarps: int, unroll: int, min_blocks: int = 4):
    """Compile the warp-path kernel for a :class:`~nbattn.cuda.kernels.decode_common.DecodeConfig`.

    ``min_blocks`` CTAs per SM become launch bounds: they cap registers per
    thread (65536 / (32 * nwarps * min_blocks)) so that enough warps stay
    resident to keep HBM busy."""
    D = cfg.head_dim
    HG = cfg.heads_per_cta
    HP = 1 << (HG - 1).bit_length()  # heads padded to a power of two (dummies never written)
    EPW = ELEMS_PER_WORD[cfg.kv]
    VEC = 4 * EPW                    # dims of a lane: one 16-byte K/V chunk (16 for fp8)
    W = D // EPW                     # 32-bit words per K/V row
    QW = cfg.q_words_per_row         # 32-bit words per q row
    QL = VEC // (4 * ELEMS_PER_WORD[cfg.code])   # 16-byte q loads per lane (2: fp16 q, fp8 K/V)
    QE = VEC // QL
    NX, TW, R, S = warp_geometry(cfg.kv, D, HG, nwarps, unroll)
    assert HP <= NX, "heads per CTA must fit the lanes of a token"
    U = unroll
    NT = 32 * nwarps
    LOG_NX = NX.bit_length() - 1
    LOG_HP = HP.bit_length() - 1
    HEAD_SHIFT = LOG_NX - LOG_HP     # a lane's head is the top LOG_HP bits of its chunk index
    HALF = NX // 2
    HPV, U4 = HP * VEC, 4 * U                        # local array sizes
    ACC_LEN, ML_LEN = R * HG * D, R * HG             # shared array sizes
    NHD = cfg.kv_layout == "NHD"
    var = cfg.variant
    SIGMOID = var.use_sigmoid
    ALIBI = var.has_alibi
    # no logits transform: the score needs no natural-scale value, fold the scale into q
    PLAIN = not SIGMOID and not ALIBI and not var.has_soft_cap and var.score_mod is None
    _, store_elem, q_unpack4 = element_io(cfg.code)
    unpack4 = fp8_unpack4(cfg.kv_code) if cfg.kv_code else q_unpack4   # K/V words -> VEC floats
    SCALE_V = cfg.kv_code is not None    # fp8: the accumulators are scaled by v_scale before they meet
    transform, keep = variant_device_fns(var)
    ROPE = var.has_rope
    WHOLE = NX == 1                  # RoPE: one chunk holds the row, partners included
    TURNS = turns_table(var, D)
    TURNS_LEN = TURNS.size
    turn = fast_rotation(D, VEC)
    poison = NR.poison_kv(cfg.kv)

    @device_fn
    def turn_chunk(x, xo, xp, xr, d0, pos, turns):
        """x[xo:xo + VEC] turned to ``pos`` in place; the partner chunk comes from lane x ^ NX/2."""
        for e in range(VEC):
            xp[e] = x[xo + e] if WHOLE else shfl_xor_f32(x[xo + e], HALF)
        turn(x, xo, xp, xr, d0, pos, turns)
        for e in range(VEC):
            x[xo + e] = xr[e]

    write_states = make_state_writer(HG, D, NT, R, HG, SIGMOID, store_elem)
    kv_addressing = make_kv_addressing(W, NHD)

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, ps_shift, num_kv_heads,
               num_qo_heads, n_head_blocks, prefetch, cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias, v_scale):
        st_acc = cuda.shared.array(ACC_LEN, np.float32, alignment=SHARED_ALIGN)
        st_m = cuda.shared.array(ML_LEN, np.float32)
        st_l = cuda.shared.array(ML_LEN, np.float32)
        qv = cuda.local.array(HPV, np.float32)
        acc = cuda.local.array(HPV, np.float32)
        dv = cuda.local.array(HP, np.float32)
        kw = cuda.local.array(U4, np.uint32)
        vw = cuda.local.array(U4, np.uint32)
        pg = cuda.local.array(U, np.int64)
        sc = cuda.local.array(U, np.float32)
        xf = cuda.local.array(VEC, np.float32)
        xp = cuda.local.array(VEC, np.float32)      # RoPE: the partner chunk
        xr = cuda.local.array(VEC, np.float32)      # RoPE: my chunk, turned
        st_turns = cuda.shared.array(TURNS_LEN, uint32)

        grid_dependents_launch()     # a programmatically launched merge may start its prologue now
        tid = cuda.threadIdx.x
        lane = tid % 32
        x = lane % NX                        # my chunk of head_dim
        row = (tid // 32) * TW + lane // NX  # my token stream
        lane0 = lane - x                     # first lane of my token
        mine = x >> HEAD_SHIFT               # the head whose score and softmax state I keep
        writer = (x & ((1 << HEAD_SHIFT) - 1)) == 0 and mine < HG
        cta, h0, h_mine, kvh = head_block(n_head_blocks, HG, num_qo_heads, num_kv_heads, mine)
        # word offset of (page, slot) = page * page_words + slot * slot_words + my_off
        v_off, page_words, slot_words, my_off = kv_addressing(page_size, num_kv_heads, kvh, x)
        qscale = float32(sm_scale * float32(LOG2E))
        slope = slopes[h_mine] if ALIBI else float32(0.0)
        if ROPE:
            for i in range(tid, TURNS_LEN, NT):
                st_turns[i] = TURNS[i]
            cuda.syncthreads()

        for item in range(cta_indptr[cta], cta_indptr[cta + 1]):
            r, kv_start, kv_end, slot, page_base, q_idx = work_item(
                item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size)

            for g in range(HP):
                for e in range(VEC):
                    qv[g * VEC + e] = 0.0
                if g < HG:
                    for c in range(QL):
                        w0, w1, w2, w3 = load_v4(q_w, (int64(r) * num_qo_heads + h0 + g) * QW + (x * QL + c) * 4)
                        q_unpack4(w0, w1, w2, w3, qv, g * VEC + c * QE)
                    if PLAIN and not ROPE:
                        for e in range(VEC):
                            qv[g * VEC + e] *= qscale
            if ROPE:        # q turned to its position q_idx, then scaled
                for g in range(HG):
                    turn_chunk(qv, g * VEC, xp, xr, x * VEC, q_idx, st_turns)
                    if PLAIN:
                        for e in range(VEC):
                            qv[g * VEC + e] *= qscale

            # the NaN rule (nbattn.cuda.blocks.nanrule, "fast pass, checked result"): the
            # first pass keeps no rule in its loop; when its result shows a non-finite
            # value anywhere in the CTA, the item runs again with the rule kept key by key
            for careful in (False, True):
                for e in range(HPV):
                    acc[e] = 0.0
                m_mine = NEG_INF
                l_mine = float32(0.0)
                raw_sum = float32(0.0)       # every raw score this lane took: non-finite if one was
                for u in range(U):
                    pos = kv_start + u * R + row
                    pg[u] = 0
                    if pos < kv_end:
                        pi, _ = page_slot(pos, page_size, ps_shift)
                        pg[u] = kv_indices[page_base + int64(pi)]

                # the trip count is the same for every thread of the CTA (the
                # simulator's emulated shuffle is block-wide and relies on it)
                for base in range(kv_start, kv_end, S):
                    # this step's K and V rows, all in flight together
                    for u in range(U):
                        pos = base + u * R + row
                        k0 = k1 = k2 = k3 = v0 = v1 = v2 = v3 = uint32(0)
                        if pos < kv_end:
                            _, within = page_slot(pos, page_size, ps_shift)
                            row_k = pg[u] * page_words + int64(within * slot_words) + my_off
                            k0, k1, k2, k3 = load_v4(kv_w, row_k)
                            v0, v1, v2, v3 = load_v4(kv_w, row_k + v_off)
                            if careful:
                                k0, k1, k2, k3, v0, v1, v2, v3 = poison(k0, k1, k2, k3, v0, v1, v2, v3)
                        kw[4 * u] = k0
                        kw[4 * u + 1] = k1
                        kw[4 * u + 2] = k2
                        kw[4 * u + 3] = k3
                        vw[4 * u] = v0
                        vw[4 * u + 1] = v1
                        vw[4 * u + 2] = v2
                        vw[4 * u + 3] = v3
                    # next step's page ids: their latency hides behind this step's math
                    for u in range(U):
                        pos = base + S + u * R + row
                        if pos < kv_end:
                            pi, _ = page_slot(pos, page_size, ps_shift)
                            pg[u] = kv_indices[page_base + int64(pi)]

                    # scores: partial dots for every head, then a reduce-scatter over
                    # the token's lanes (each level halves the heads a lane carries)
                    # and a plain butterfly once one head is left: HP-1+log2(NX/HP)
                    # shuffles per token instead of HP*log2(NX)
                    for u in range(U):
                        unpack4(kw[4 * u], kw[4 * u + 1], kw[4 * u + 2], kw[4 * u + 3], xf, 0)
                        if ROPE:    # the key turned to its position
                            turn_chunk(xf, 0, xp, xr, x * VEC, base + u * R + row, st_turns)
                        for g in range(HP):
                            d = float32(0.0)
                            for e in range(VEC):
                                d += qv[g * VEC + e] * xf[e]
                            dv[g] = d
                        for i in range(LOG_HP):
                            off = HALF >> i
                            half = HP >> (i + 1)
                            upper = (x & off) != 0
                            for k in range(half):
                                a = dv[k]
                                b = dv[k + half]
                                dv[k] = (b if upper else a) + shfl_xor_f32(a if upper else b, off)
                        for i in range(LOG_HP, LOG_NX):
                            dv[0] += shfl_xor_f32(dv[0], HALF >> i)
                        pos = base + u * R + row
                        ok = pos < kv_end and mine < HG and keep(r, h_mine, q_idx, pos)
                        raw = dv[0] if PLAIN else dv[0] * sm_scale
                        raw_sum += raw
                        s = raw if PLAIN else transform(raw, r, h_mine, q_idx, pos, slope)
                        if careful:
                            s = NR.checked(raw, s)
                        if SIGMOID:
                            sc[u] = sigmoid_weight(s, sigmoid_bias) if ok else 0.0
                        elif PLAIN:
                            sc[u] = s if ok else NEG_INF
                        else:
                            sc[u] = s * float32(LOG2E) if ok else NEG_INF

                    # my head's online softmax, once per step: m' = max(m, max_u s_u),
                    # alpha = 2^(m - m'), p_u = 2^(s_u - m'), l' = alpha * l + sum_u p_u
                    if not SIGMOID:
                        mx = m_mine
                        for u in range(U):
                            mx = NR.max_nan(mx, sc[u]) if careful else max(mx, sc[u])
                        f, l_mine = online_step(sc, U, m_mine, mx, l_mine)
                        m_mine = mx
                        # every lane rescales every head's accumulator: fetch the factors
                        for g in range(HG):
                            fg = shfl_idx_f32(f, lane0 + (g << HEAD_SHIFT))
                            for e in range(VEC):
                                acc[g * VEC + e] *= fg
                    # acc' = alpha * acc + sum_u p_u * v_u, every head's p fetched from its lane
                    for u in range(U):
                        unpack4(vw[4 * u], vw[4 * u + 1], vw[4 * u + 2], vw[4 * u + 3], xf, 0)
                        for g in range(HG):
                            p = shfl_idx_f32(sc[u], lane0 + (g << HEAD_SHIFT))
                            for e in range(VEC):
                                acc[g * VEC + e] += p * xf[e]

                if careful or not cuda.syncthreads_or(NR.state_suspect(acc, HPV, m_mine, l_mine, raw_sum)):
                    break

            # combine the R rows' states (merge rule, docs/concepts/state.md) and write;
            # o is linear in acc, so v_scale may join here: o = v_scale * acc / l
            for g in range(HG):
                if SCALE_V:
                    for e in range(VEC):
                        acc[g * VEC + e] *= v_scale
                o_at = (row * HG + g) * D + x * VEC
                for e in range(0, VEC, 4):
                    st_v4(st_acc, o_at + e, acc[g * VEC + e], acc[g * VEC + e + 1],
                          acc[g * VEC + e + 2], acc[g * VEC + e + 3])
            if writer:
                st_m[row * HG + mine] = m_mine
                st_l[row * HG + mine] = l_mine
            write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o, part_lse)

    return jit_kernel(kernel, launch_bounds=(NT, min_blocks))     # (the simulator takes no bounds)

