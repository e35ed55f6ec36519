"""Decode on the GPU without block barriers in the main loop (docs/concepts/layouts.md, masks.md, state.md, performance.md).

Same work-list contract as :mod:`nbattn.cuda.decode` (that module's doc): a CTA
runs the items ``cta_indptr[c]:cta_indptr[c+1]`` for a block of ``HG`` query
heads of one KV head and writes the final row (``out_slot == -1``) or a partial
state (normalized fp32 output, base-2 LSE) into its slot.  The shared-memory
kernel there stays the simulator's and the fallback path; this one is picked
on the GPU because decode is a pure stream of K/V bytes, and there every block
barrier per tile is a bubble in that stream.

Why it is shaped like this
--------------------------
* A lane owns one 16-byte chunk (``VEC`` elements) of head_dim, so ``NX = D /
  VEC`` lanes hold one token's K row and a warp covers ``TW = 32 / NX`` tokens
  at a time.  Every load is one ``ld.global.nc.v4`` (~1.0 of copy bandwidth,
  docs/gpu.md), straight into registers: no shared-memory staging.
* Each (warp, token-slot) row walks its own strided subset of the item's
  tokens and keeps its *own* online-softmax state; rows never wait for each
  other.  They meet once, at the end, through the merge rule (docs/concepts/state.md).
* ``U`` tokens per row are loaded before any is used, and the page ids of the
  next step are fetched right after, so a row has ``2U`` 16-byte loads plus the
  index loads of the next step in flight while it does arithmetic.
* A score starts as each lane's ``VEC``-element partial dot for every head.
  Summing over the token's ``NX`` lanes is a reduce-scatter: at each xor level
  a lane keeps half of its heads and trades the other half with its partner,
  so after ``log2(HP)`` levels each lane holds one head (the top bits of its
  chunk index) and a plain butterfly finishes it.  That is ``HP - 1 +
  log2(NX / HP)`` shuffles per token instead of ``HP * log2(NX)``, and the
  variant, mask, exponent and softmax state are computed once per head rather
  than by every lane for every head.  The probabilities (and, once per step,
  the rescale factors) are then fetched by every lane with ``HG`` indexed
  shuffles for its ``p * V`` update.  ``HG`` heads are padded to ``HP``, a
  power of two; dummy heads have q = 0 and are never written.
* Softmax runs in base 2; ``m`` is updated once per step of ``U`` tokens (one
  rescale of the accumulator per step, not per token).  Without a logits
  transform, ``sm_scale * log2(e)`` is folded into q once.

Launch shape: 1-D grid of ``num_ctas * n_head_blocks`` CTAs, head blocks of
one item adjacent in launch order (a group split over two CTAs reads the same
K/V at the same time, so the second read is an L2 hit); ``NW`` warps per CTA.
Shared memory is used only for the final combine: ``R = NW * TW`` rows x
``HG`` heads x ``D`` floats (16 KB for HG = 4) plus their ``m``/``l``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32

from ..blocks.primitives import (ELEMS_PER_WORD, SHARED_ALIGN, SIMULATOR, device_fn, element_io, exp2f, load_i32_cg,
                         load_v4, prefetch_l2, shfl_idx_f32, shfl_xor_f32, st_v4)
from ..host.driver import jit_kernel
from ..blocks.mma import grid_dependency_wait, grid_dependents_launch
from ..blocks.variants import LOG2E, variant_device_fns
from ..blocks import nanrule as NR

__all__ = ["warp_eligible", "warp_heads_per_cta", "build_warp_kernel", "warp_geometry", "tc_eligible",
           "build_tc_kernel"]

NEG_INF = float32(-math.inf)


def warp_eligible(code: str, head_dim: int, aligned: bool) -> bool:
    """A token's row must be a power-of-two number of 16-byte chunks within one warp."""
    nx = head_dim // (4 * ELEMS_PER_WORD[code])
    return aligned and head_dim % (4 * ELEMS_PER_WORD[code]) == 0 and 1 <= nx <= 32 and nx & (nx - 1) == 0


def warp_heads_per_cta(group: int, max_heads: int, lanes: int) -> int:
    """Largest divisor of the group <= max_heads and <= the lanes of a token: q and
    the accumulator of every head live in registers (2 * HG * VEC floats per
    lane), and each head's score ends in its own subset of the token's lanes."""
    for hg in range(min(group, max_heads, lanes), 0, -1):
        if group % hg == 0:
            return hg
    return 1


def warp_geometry(code: str, head_dim: int, heads: int, nwarps: int, unroll: int):
    """``(NX, TW, R, step_tokens)``: lanes per token, tokens per warp, rows per CTA,
    tokens a CTA consumes per step."""
    vec = 4 * ELEMS_PER_WORD[code]
    nx = head_dim // vec
    tw = 32 // nx
    return nx, tw, nwarps * tw, nwarps * tw * unroll


@device_fn
def page_slot(pos, page_size, ps_shift):
    """(page index, slot in the page) of a request's key position; power-of-two
    pages (``ps_shift >= 0``, the common case) avoid an integer division per token."""
    if ps_shift >= 0:
        pi = uint32(pos) >> uint32(ps_shift)
        return pi, uint32(pos) & uint32(page_size - 1)
    pi = uint32(pos) // uint32(page_size)
    return pi, uint32(pos) - pi * uint32(page_size)


@device_fn
def work_item(item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size):
    """Work item ``item`` of a decode work list (module doc of :mod:`nbattn.cuda.decode`):
    ``(request, kv_start, kv_end, out_slot, first page index, query position)``; the
    query sits at its request's last key, whatever chunk the item covers.

    The work list is the launcher's own, uploaded before the kernels that may run
    ahead of this one (``decode.split_runner``): it is read before the programmatic
    dependency wait, everything of the caller's (page table, q, K/V, outputs) after
    it, through the request id the wait's zero is added to."""
    r = w_request[item]
    kv_start, kv_end, slot = w_kv_start[item], w_kv_end[item], w_out_slot[item]
    r += grid_dependency_wait()
    page_base = int64(kv_indptr[r])
    n_pages = kv_indptr[r + 1] - kv_indptr[r]
    kv_len = (n_pages - 1) * page_size + kv_last[r] if n_pages > 0 else 0
    return r, kv_start, kv_end, slot, page_base, kv_len - 1


def make_state_writer(HG: int, D: int, NT: int, ROWS: int, STRIDE: int, sigmoid: bool, store_elem):
    """Device function ``(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse,
    part_o, part_lse)``, the end of both decode kernels: the ``ROWS`` streams of
    a CTA left their states in shared memory (stream ``y``, head ``g`` at
    ``y * STRIDE + g``: accumulator ``st_acc[.. * D + dim]``, max ``st_m``, mass
    ``st_l``); fold them with the merge rule of docs/concepts/state.md (sigmoid states just add) and
    write the final row (``slot < 0``) or the partial state of slot ``slot``."""

    @device_fn
    def write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o, part_lse):
        for i in range(tid, HG * D, NT):
            g = i // D
            dd = i - g * D
            h = h0 + g
            o = float32(0.0)
            row_lse = float32(math.nan)
            if sigmoid:
                for y in range(ROWS):
                    o += st_acc[(y * STRIDE + g) * D + dd]
            else:
                mm = NEG_INF
                for y in range(ROWS):
                    mm = NR.max_nan(mm, st_m[y * STRIDE + g])
                row_lse = NEG_INF
                if mm != NEG_INF:
                    tot = float32(0.0)
                    for y in range(ROWS):
                        wy = exp2f(st_m[y * STRIDE + g] - mm)
                        tot += wy * st_l[y * STRIDE + g]
                        o += wy * st_acc[(y * STRIDE + g) * D + dd]
                    o = o / tot
                    row_lse = mm + math.log2(tot)
            if slot < 0:
                store_elem(out, (int64(r) * num_qo_heads + h) * D + dd, o)
                if dd == 0:
                    lse[int64(r) * num_qo_heads + h] = row_lse
            else:
                part_o[(int64(slot) * num_qo_heads + h) * D + dd] = o
                if dd == 0:
                    part_lse[int64(slot) * num_qo_heads + h] = row_lse
    return write_states


def build_warp_kernel(cfg, nwarps: int, unroll: int, min_blocks: int = 4):
    """Compile the warp-path kernel for a :class:`~nbattn.cuda.decode.DecodeConfig`.

    ``min_blocks`` CTAs per SM become launch bounds: they cap registers per
    thread (65536 / (32 * nwarps * min_blocks)) so that enough warps stay
    resident to keep HBM busy."""
    D = cfg.head_dim
    HG = cfg.heads_per_cta
    HP = 1 << (HG - 1).bit_length()  # heads padded to a power of two (dummies never written)
    EPW = ELEMS_PER_WORD[cfg.code]
    VEC = 4 * EPW
    W = D // EPW                     # 32-bit words per K/V row
    NX, TW, R, S = warp_geometry(cfg.code, D, HG, nwarps, unroll)
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
    _, store_elem, unpack4 = element_io(cfg.code)
    transform, keep = variant_device_fns(var)
    poison = NR.poison_kv(cfg.code)
    write_states = make_state_writer(HG, D, NT, R, HG, SIGMOID, store_elem)

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, ps_shift, num_kv_heads,
               num_qo_heads, n_head_blocks, prefetch, cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias):
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

        grid_dependents_launch()     # a programmatically launched merge may start its prologue now
        tid = cuda.threadIdx.x
        lane = tid % 32
        x = lane % NX                        # my chunk of head_dim
        row = (tid // 32) * TW + lane // NX  # my token stream
        lane0 = lane - x                     # first lane of my token
        mine = x >> HEAD_SHIFT               # the head whose score and softmax state I keep
        writer = (x & ((1 << HEAD_SHIFT) - 1)) == 0 and mine < HG
        cta = cuda.blockIdx.x // n_head_blocks
        h0 = (cuda.blockIdx.x - cta * n_head_blocks) * HG
        h_mine = h0 + min(mine, HG - 1)
        kvh = h0 // (num_qo_heads // num_kv_heads)
        ps = int64(page_size)
        hkv = int64(num_kv_heads)
        # word offset of (page, slot) = page * page_words + slot * slot_words + my_off
        v_off = ps * hkv * W               # V half of a page, both layouts
        page_words = 2 * v_off
        if NHD:
            slot_words = uint32(num_kv_heads * W)
            my_off = int64(kvh) * W + x * 4
        else:
            slot_words = uint32(W)
            my_off = int64(kvh) * ps * W + x * 4
        qscale = float32(sm_scale * float32(LOG2E))
        slope = slopes[h_mine] if ALIBI else float32(0.0)

        for item in range(cta_indptr[cta], cta_indptr[cta + 1]):
            r, kv_start, kv_end, slot, page_base, q_idx = work_item(
                item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size)

            for g in range(HP):
                for e in range(VEC):
                    qv[g * VEC + e] = 0.0
                    acc[g * VEC + e] = 0.0
                if g < HG:
                    w0, w1, w2, w3 = load_v4(q_w, (int64(r) * num_qo_heads + h0 + g) * W + x * 4)
                    unpack4(w0, w1, w2, w3, qv, g * VEC)
                    if PLAIN:
                        for e in range(VEC):
                            qv[g * VEC + e] *= qscale
            m_mine = NEG_INF
            l_mine = float32(0.0)
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
                    if PLAIN:
                        s = NR.checked(dv[0], dv[0])
                    else:
                        s = NR.checked(dv[0] * sm_scale, transform(dv[0] * sm_scale, r, h_mine, q_idx, pos, slope))
                    if SIGMOID:
                        sc[u] = float32(1.0) / (float32(1.0) + math.exp(-(s + sigmoid_bias))) if ok else 0.0
                    elif PLAIN:
                        sc[u] = s if ok else NEG_INF
                    else:
                        sc[u] = s * float32(LOG2E) if ok else NEG_INF

                # my head's online softmax: one running-max update per step
                if not SIGMOID:
                    mx = m_mine
                    for u in range(U):
                        mx = NR.max_nan(mx, sc[u])
                    f = float32(1.0) if mx == NEG_INF else exp2f(m_mine - mx)
                    m_mine = mx
                    l_mine *= f
                    for u in range(U):
                        p = float32(0.0) if sc[u] == NEG_INF else exp2f(sc[u] - mx)
                        sc[u] = p
                        l_mine += p
                    # every lane rescales every head's accumulator: fetch the factors
                    for g in range(HG):
                        fg = shfl_idx_f32(f, lane0 + (g << HEAD_SHIFT))
                        for e in range(VEC):
                            acc[g * VEC + e] *= fg
                for u in range(U):
                    unpack4(vw[4 * u], vw[4 * u + 1], vw[4 * u + 2], vw[4 * u + 3], xf, 0)
                    for g in range(HG):
                        p = shfl_idx_f32(sc[u], lane0 + (g << HEAD_SHIFT))
                        for e in range(VEC):
                            acc[g * VEC + e] += p * xf[e]

            # combine the R rows' states (merge rule, docs/concepts/state.md) and write
            for g in range(HG):
                o_at = (row * HG + g) * D + x * VEC
                for e in range(0, VEC, 4):
                    st_v4(st_acc, o_at + e, acc[g * VEC + e], acc[g * VEC + e + 1],
                          acc[g * VEC + e + 2], acc[g * VEC + e + 3])
            if writer:
                st_m[row * HG + mine] = m_mine
                st_l[row * HG + mine] = l_mine
            cuda.syncthreads()
            write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o,
                         part_lse)
            cuda.syncthreads()   # the next item overwrites st_*

    if SIMULATOR:                 # the simulator refuses launch bounds
        return cuda.jit(kernel)
    return jit_kernel(kernel, launch_bounds=(NT, min_blocks))


# ---------------------------------------------------------------------------
# Tensor-core variant (GPU only, fp16/bf16): the group's heads as one mma operand
# ---------------------------------------------------------------------------

# Steps of K/V (16 tokens a warp each) that the small-batch tensor-core shape prefetches into
# L2 before its programmatic dependency wait, when launched with ``prefetch`` (split_runner's
# programmatic launches): while the previous call's merge ends, HBM would otherwise idle.
# The page ids for it are read before the wait, so they are hints only: read through L2
# (load_i32_cg), clamped into the page table and the pool, and used for nothing but
# prefetches; the loads after the wait read the page table again.  L2 is where every
# write lands, so a prefetched line is never stale.  H200, batch 1 x 32k, same process,
# decode + merge per call (benchmarks/results/experiments/decode_b1_prefetch.json), steps 0/1/2/4/8:
# blocks of 4 heads 39.96 / 38.80 / 38.82 / 40.33 / 44.44 us; blocks of 8 heads (group 8,
# chunks half as long) 25.77 / 26.56 / 26.92 / 27.90 / 30.26 us, so those do not prefetch.
PREFETCH_STEPS = 1
PREFETCH_MAX_HEADS = 4


def tc_eligible(code: str, head_dim: int, aligned: bool, variant) -> bool:
    """fp16/bf16, head_dim 32..128 in steps of 32 (256 spills: ptxas, sm_90), softmax
    (not sigmoid) variants."""
    return (not SIMULATOR and aligned and code in ("f16", "bf16") and head_dim % 32 == 0
            and head_dim <= 128 and not variant.use_sigmoid)


def build_tc_kernel(cfg, nwarps: int, min_blocks: int = 3):
    """Decode with ``mma.sync.m16n8k16`` for a block of up to 8 query heads of one
    KV head; same work list, arguments and launch as :func:`build_warp_kernel`.

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
    computes.

    That shape holds 8 KB per warp in flight, 64 KB per SM.  A bare 16-byte read of
    the same 134 MB with that much in flight takes 40.4 us on the H200, with four
    times as much 35.4 us (``benchmarks/results/decode_read_floor.json``); this
    kernel takes 38-39 us.  What was tried to go further, and dropped, is in
    ``benchmarks/EXPERIMENTS.md``."""
    from ..blocks import mma as MMA

    D = cfg.head_dim
    HG = cfg.heads_per_cta
    assert HG <= 8 and D % 32 == 0
    EPW = ELEMS_PER_WORD[cfg.code]
    W = D // EPW
    NJ = D // 32                 # 32-dim chunks: one 16-byte load per lane per token
    QL, HL, AL = 4 * NJ, 4 * NJ, 8 * NJ   # q words, words per token half, accumulator floats
    KL = 2 * HL
    NW = nwarps
    NT = 32 * NW
    STEP = 16 * NW
    ACC_LEN, ML_LEN = NW * 8 * D, NW * 8
    # K one step ahead needs ~30 more registers (ptxas, sm_90: 242 at 8 warps x 1 CTA, i.e.
    # at most 8 warps an SM; 6 x 2 and 4 x 3 would spill)
    AHEAD = NW * min_blocks <= 8
    LEAD = STEP if AHEAD else 0
    PF = PREFETCH_STEPS if AHEAD and HG <= PREFETCH_MAX_HEADS else 0
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
        """My NJ 16-byte chunks of the row at word ``row`` (zeros for -1) into ``dst[o0:]``."""
        for j in range(NJ):
            w0 = w1 = w2 = w3 = uint32(0)
            if row >= 0:
                w0, w1, w2, w3 = load_v4(kv_w, row + j * 16)
            o = o0 + 4 * j
            dst[o] = w0
            dst[o + 1] = w1
            dst[o + 2] = w2
            dst[o + 3] = w3

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, ps_shift, num_kv_heads,
               num_qo_heads, n_head_blocks, prefetch, cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias):
        st_acc = cuda.shared.array(ACC_LEN, np.float32)
        st_m = cuda.shared.array(ML_LEN, np.float32)
        st_l = cuda.shared.array(ML_LEN, np.float32)
        qa = cuda.local.array(QL, np.uint32)
        kw = cuda.local.array(KL, np.uint32)
        kn = cuda.local.array(KL, np.uint32)
        rk = cuda.local.array(2, np.int64)
        vw = cuda.local.array(KL, np.uint32)
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
        cta = cuda.blockIdx.x // n_head_blocks
        h0 = (cuda.blockIdx.x - cta * n_head_blocks) * HG
        h_row = h0 + min(g, HG - 1)      # my score row's head (padding rows borrow the last)
        kvh = h0 // (num_qo_heads // num_kv_heads)
        ps = int64(page_size)
        hkv = int64(num_kv_heads)
        v_off = ps * hkv * W
        page_words = 2 * v_off
        if NHD:
            slot_words = uint32(num_kv_heads * W)
            my_off = int64(kvh) * W + t * 4
        else:
            slot_words = uint32(W)
            my_off = int64(kvh) * ps * W + t * 4
        qscale = float32(sm_scale * float32(LOG2E))
        slope = slopes[h_row] if ALIBI else float32(0.0)
        zero = float32(0.0)

        # before the dependency wait: the first PF steps of my first item into L2 (PREFETCH_STEPS);
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
                    w0, w1, w2, w3 = load_v4(q_w, (int64(r) * num_qo_heads + h0 + g) * W + j * 16 + t * 4)
                qa[4 * j] = w0
                qa[4 * j + 1] = w1
                qa[4 * j + 2] = w2
                qa[4 * j + 3] = w3
            for e in range(AL):
                acc[e] = 0.0
            m_row = NEG_INF
            l_part = float32(0.0)
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
                    load_row(kv_w, rk[hf] + v_off if rk[hf] >= 0 else rk[hf], vw, hf * HL)
                for o in range(0, KL, 4):        # the NaN rule: a non-finite V chunk poisons its K chunk
                    (kw[o], kw[o + 1], kw[o + 2], kw[o + 3], vw[o], vw[o + 1], vw[o + 2],
                     vw[o + 3]) = poison(kw[o], kw[o + 1], kw[o + 2], kw[o + 3], vw[o], vw[o + 1], vw[o + 2],
                                         vw[o + 3])
                if AHEAD:
                    for hf in range(2):
                        rk[hf] = page_row(base + STEP + 8 * hf + g, kv_end, pg[hf], page_size, ps_shift,
                                          page_words, slot_words, my_off)
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
                    s = sc[e]
                    if PLAIN:
                        s = NR.checked(s * qscale, s * qscale)
                    else:
                        s = NR.checked(s * sm_scale, transform(s * sm_scale, r, h_row, q_idx, pos, slope)
                                       * float32(LOG2E))
                    ok = pos < kv_end
                    if MASKED:
                        ok = ok and keep(r, h_row, q_idx, pos)
                    s = s if ok else NEG_INF
                    sc[e] = s
                    mx = NR.max_nan(mx, s)
                mx = NR.max_nan(mx, shfl_xor_f32(mx, 1))
                mx = NR.max_nan(mx, shfl_xor_f32(mx, 2))
                m_new = NR.max_nan(m_row, mx)
                f = float32(1.0) if m_new == NEG_INF else exp2f(m_row - m_new)
                m_row = m_new
                l_part *= f
                for e in range(4):
                    p = float32(0.0) if sc[e] == NEG_INF else exp2f(sc[e] - m_new)
                    sc[e] = p
                    l_part += p
                b0 = pack(sc[0], sc[1])
                b1 = pack(sc[2], sc[3])
                f0 = shfl_idx_f32(f, 8 * t)          # columns 2t, 2t+1 of O^T are heads 2t, 2t+1
                f1 = shfl_idx_f32(f, 8 * t + 4)
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
                if AHEAD:
                    for e in range(KL):
                        kw[e] = kn[e]

            # my row's mass, then the warps' states through shared memory
            l_row = l_part + shfl_xor_f32(l_part, 1)
            l_row += shfl_xor_f32(l_row, 2)
            for j in range(NJ):
                for pp in range(2):
                    for c in range(4):
                        head = 2 * t + (c & 1)
                        dim = 32 * j + 8 * (g >> 1) + 2 * (2 * pp + (c >> 1)) + (g & 1)
                        st_acc[(warp * 8 + head) * D + dim] = acc[4 * (2 * j + pp) + c]
            if t == 0:
                st_m[warp * 8 + g] = m_row
                st_l[warp * 8 + g] = l_row
            cuda.syncthreads()
            write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o,
                         part_lse)
            cuda.syncthreads()

    return jit_kernel(kernel, launch_bounds=(NT, min_blocks))
