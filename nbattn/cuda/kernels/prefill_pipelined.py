"""The pipelined tensor-core prefill tile (GPU only, fp16/bf16, head_dim 64 and 128).

It computes exactly :func:`nbattn.cuda.kernels.prefill_core.core_tile`, on the
tensor cores as :mod:`nbattn.cuda.kernels.prefill_mma` does (16 fused rows a
warp, ``mma.sync.m16n8k16``, softmax on the accumulator fragments, P from
registers, the same row writer), and differs from the teaching tile further in
how its operands move:

- K/V tiles (T_q = 64, T_k = 64, 4 warps) are fetched with 16-byte ``cp.async``,
  so the next tile's loads overlap this tile's math (FlashAttention-2's order);
- Q/K fragments come by ``ldmatrix.x4`` and V's by ``ldmatrix.x4.trans`` from rows
  padded against bank conflicts; the Q fragments are loaded once into registers;
- scores are scaled by ``scale * log2(e)`` once before ``exp2``, and the
  per-element variant/mask runs only on key tiles that need it (a 64-key tile
  every row of a warp sees whole, with no variant, is only scaled);
- the NaN rule's V check runs as a second pass over the keys, only for a tile
  whose O came out non-finite (:func:`pipelined_tile`);
- RoPE at attention time turns the Q rows and then each K tile in shared memory,
  once they land (:func:`~nbattn.cuda.blocks.rope.word_rotation`; rounded back to
  fp16 / bf16 there), where the teaching tile turns float32 rows.

head_dim 256 stays on the mma tile: O, Q and S of this tile would not fit in
registers.  The fragment code and the copy issue are generated straight-line
source (:func:`pipelined_source`, :func:`issue_source`;
docs/concepts/generated_kernels.md).
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, uint32, uint64

from ..blocks import mma as _mma
from ..blocks import nanrule as NR
from ..blocks.primitives import bf16x2_to_f32, device_fn, f16x2_to_f32
from ..blocks.rope import turns_table, word_rotation
from ..blocks.variants import LOG2E, sigmoid_weight
from ..host.prefill_launch import nan_row_at
from .prefill_common import (NO_KEY, KernelSpec, compile_functions, kv_reader, pow2_shift, scale_only, tile_item,
                             tile_locator, tile_rows, tile_score, tile_skip, tile_thread, tile_transform, tup,
                             warp_unmasked_keys)
from .prefill_mma import fragment_writer

__all__ = ["pipelined_tile", "fast_path", "pipelined_source", "issue_source", "source", "PIPELINED_NAMES"]

PIPELINED_NAMES = ("o_zero", "q_frags", "qk", "scaled", "transformed", "masked", "softmax", "o_finite", "pv")


def fast_path(head_dim: int) -> bool:
    """Head dims the pipelined tile builds (K fragments come two k-steps per
    ldmatrix.x4; O, Q and a 64-key S must fit in registers)."""
    return head_dim in (64, 128)


def pipelined_source(D: int, T_k: int, ROW: int, sigmoid: bool) -> str:
    """Source of the pipelined tile's straight-line fragment code, generated per
    (head_dim, T_k) as :func:`nbattn.cuda.kernels.prefill_mma.fragment_source` is, for
    the same reason (``ROW``: bytes a padded shared row).

    ``s`` is a warp's 16 x T_k score block: n-tile j (keys 8j..8j+7) holds
    ``s[4j:4j+4]`` in the C layout.  Addresses are the lane's ldmatrix row
    address; the offsets below are compile-time constants.

    - ``q_frags(addr)``: all A fragments of the warp's 16 Q rows (ldmatrix.x4 per k-step);
    - ``qk(qf, addr)``: S = Q K^T (one ldmatrix.x4 = B of two k-steps of one n-tile);
    - ``scaled(s, f)``: every score times f (unmasked tiles, plain variants);
    - ``transformed(s, ..., s_kpos, kbase, ...)``: the variant's transform per element,
      no mask (unmasked tiles of ALiBi, soft-cap, ``score_mod``, sigmoid): each row's
      position, request, head and slope read once, each key's position once;
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

    L.append("def transformed(s, r_lo, r_hi, tq, s_qpos, s_diag, s_req, s_kpos, kbase, head0, row0, slopes):")
    L.append("    " + ", ".join(S) + ", = s")
    L.append("    kt = kbase + 2 * tq")
    for name in ("lo", "hi"):
        L.append(f"    q_{name} = s_qpos[r_{name}]")
        L.append(f"    d_{name} = q_{name} - s_diag[r_{name}]")       # key index -> key position
        L.append(f"    h_{name} = head0 + (row0 + r_{name}) % group")
        L.append(f"    a_{name} = slopes[h_{name}]")
        L.append(f"    b_{name} = s_req[r_{name}]")
    for j in range(NTK):
        for e in (0, 1):
            L.append(f"    k{2 * j + e} = s_kpos[kt + {8 * j + e}]")
    out = []
    for j in range(NTK):
        for c in range(4):
            n = "lo" if c < 2 else "hi"
            out.append(f"scored(s{4 * j + c}, b_{n}, h_{n}, q_{n}, k{2 * j + (c & 1)} + d_{n}, a_{n})")
    L.append("    return (" + ",\n            ".join(out) + ",)")

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

    return "\n".join(L) + "\n"
def issue_source(CH: int, NT: int, k_iters: int, ROW: int) -> str:
    """Source of ``issue(s_dst, s_addr, s_kpos, base, tid)``: cp.async of one K or V tile,
    row j from the global address ``s_addr[base + j]`` (zero-fill where
    ``s_kpos[base + j]`` is NO_KEY), ``CH`` 16-byte chunks a row of ``ROW`` bytes, ``NT``
    threads, ``k_iters`` rows a thread.  Generated straight-line code: cp.async is volatile
    asm with a memory clobber, so in a loop each row's shared-memory reads would
    wait behind the previous row's copy; written out, all of them are issued
    before the first copy."""
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
    return "\n".join(L) + "\n"


def pipelined_tile(spec: KernelSpec):
    """The cp.async + ldmatrix tile for head_dim 64/128.  Launch as the others:
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
    read their row addresses from shared memory, so no 16-byte chunk redoes the
    page lookup behind the volatile cp.async asm.
    """
    D, group = spec.head_dim, spec.group
    T_q, T_k, NT = spec.tile_q, spec.tile_k, spec.threads
    assert fast_path(D) and T_q <= 2 * T_k and NT == 2 * T_q
    var = spec.variant
    sigmoid = var.use_sigmoid
    positional = spec.mode != "bsr"
    cp_async16, commit, wait_all = _mma.cp_async16, _mma.cp_async_commit, _mma.cp_async_wait_all
    stage = tile_rows(spec, positional, before_barrier=wait_all)      # the Q copies land before the barrier
    item = tile_item(spec)
    thread = tile_thread(spec, 32, 4)
    write_rows = fragment_writer(spec)
    next_tile = tile_skip(T_k)
    unmasked_keys, inside = warp_unmasked_keys(spec, positional, 16, transforms=True)
    plain_scores = scale_only(var)       # inside the range: the scale alone, else the transform
    scale_log2 = float32(var.scale(D) * LOG2E)
    addr_of = kv_reader(spec.mode, spec.kv_layout, _mma.global_addr)
    gaddr = _mma.global_addr
    loc = tile_locator(spec.mode)
    mma = _mma.mma_bf16 if spec.kind == "bf16" else _mma.mma_f16
    pack = _mma.pack_bf16x2 if spec.kind == "bf16" else _mma.pack_f16x2
    shared_addr = _mma.shared_addr
    neg_inf = float32(-math.inf)
    ROW, CH, K_ITERS = _geometry(spec)    # bytes a smem row (16 B pad), 16-byte chunks a row, rows a thread
    TILE = T_k * ROW
    BUF_WORDS = (2 * TILE + 16) // 4  # K tile, V tile, slack for 16-byte alignment
    Q_ITERS = T_q * CH // NT
    assert NT % CH == 0 and NT % T_k == 0
    LOCS = 2 * T_k                   # key locations of two tiles
    align_mask = uint32(0xFFFFFFF0)
    ROPE = var.has_rope                  # q rows and each K tile turned where they land
    TURNS = turns_table(var, D)
    TURNS_LEN, ROW_WORDS, QUARTER = TURNS.size, ROW // 4, D // 4
    turn_words = word_rotation(D, bf16x2_to_f32 if spec.kind == "bf16" else f16x2_to_f32, pack)

    env = {"float32": float32, "uint32": uint32, "mma": mma, "pack": pack, "ldsm": _mma.ldsm_x4,
           "ldsm_t": _mma.ldsm_x4_t, "score": tile_score(spec, positional), "cuda": cuda, "math": math,
           "scored": tile_transform(spec), "group": group,
           "sigmoid_weight": sigmoid_weight, "bias": float32(var.sigmoid_bias), "neg_inf": float32(-math.inf),
           "max_nan": NR.max_nan}
    fr = compile_functions(pipelined_source(D, T_k, ROW, sigmoid), f"pipelined fragments D={D} T_k={T_k}", env,
                           PIPELINED_NAMES)
    o_zero, q_frags, qk, scaled, transformed = fr["o_zero"], fr["q_frags"], fr["qk"], fr["scaled"], fr["transformed"]
    masked, softmax, o_finite, pv = fr["masked"], fr["softmax"], fr["o_finite"], fr["pv"]

    issue = compile_functions(issue_source(CH, NT, K_ITERS, ROW), f"cp.async issue CH={CH} NT={NT} iters={K_ITERS}",
                              {"uint32": uint32, "uint64": uint64, "int32": int32, "CH": CH, "ROW": ROW,
                               "NO_KEY": NO_KEY, "cp_async16": cp_async16}, ("issue",))["issue"]
    bad_chunk = NR.chunk_bad(spec.kind)
    vec = kv_reader(spec.mode, spec.kv_layout, _mma.load_u32x4)
    NAN_AT = nan_row_at(spec.num_qo_heads)

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
    def turn_rows(buf, first, pos_of, at, n, offset, tid, turns):
        """RoPE: rows 0..n-1 of the tile at word ``first`` of ``buf``, row j turned to
        ``pos_of[at + j] + offset`` (a row at NO_KEY holds zeros and is left alone)."""
        for e in range(tid, n * QUARTER, NT):
            j = e // QUARTER
            pos = pos_of[at + j]
            if pos != NO_KEY:
                turn_words(buf, first + j * ROW_WORDS, e % QUARTER, pos + offset, turns)

    @device_fn
    def tile(wi, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        tid, kv_head, head0, warp, lane, g, tq = thread()
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, wi)
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
        s_turns = cuda.shared.array(TURNS_LEN, uint32)
        k_word = int32((s_k - shared_addr(buf)) >> uint32(2))      # s_k as a word index of buf
        if ROPE:
            for i in range(tid, TURNS_LEN, NT):
                s_turns[i] = TURNS[i]

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
        lo, hi, sink_end = stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
                                 s_qpos, s_diag, s_req, s_range)

        kvoff = 0
        if ROPE:        # q rows turned to their positions; a key's position is kvoff + s_kpos
            cuda.syncthreads()
            turn_rows(buf, k_word, s_qpos, 0, n_rows, 0, tid, s_turns)
            kvoff = s_qpos[0] - s_diag[0]
            cuda.syncthreads()
        row_base = warp * 16
        r_lo = row_base + g
        r_hi = r_lo + 8
        ok_lo = r_lo < n_rows
        ok_hi = r_hi < n_rows
        u_lo, u_hi = unmasked_keys(s_diag, row_base, n_rows)     # keys this warp's rows all see, unmasked
        lr = lane % 8
        lm = lane // 8
        a_off = uint32((lr + 8 * (lm % 2)) * ROW + (lm // 2) * 16)   # Q (A) and V (B, trans) rows
        qf = q_frags(s_k + uint32(row_base * ROW) + a_off)
        k_lane = s_k + uint32(lr * ROW + lm * 16)
        v_lane = s_v + a_off
        cuda.syncthreads()              # Q read: the buffer is K's and V's now

        # t // block as a shift when block is a power of two (page sizes usually are)
        shift = pow2_shift(block)
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
            if ROPE and t0 < hi:
                turn_rows(buf, k_word, s_kpos, 0, T_k, kvoff, tid, s_turns)
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
                if inside(t0, last, hi, u_lo, u_hi):      # every row sees every key of the tile
                    if plain_scores:
                        s = scaled(s, scale_log2)
                    else:
                        s = transformed(s, r_lo, r_hi, tq, s_qpos, s_diag, s_req, s_kpos, base, head0, row0, slopes)
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
                if ROPE and t1 < hi:
                    turn_rows(buf, k_word, s_kpos, nbase, T_k, kvoff, tid, s_turns)
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


def _geometry(spec: KernelSpec) -> tuple[int, int, int]:
    """(ROW bytes a padded shared row, CH 16-byte chunks a row, K_ITERS rows a thread copies)."""
    D = spec.head_dim
    return 2 * D + 16, D // 8, spec.tile_k * (D // 8) // spec.threads


def source(spec: KernelSpec) -> str:
    """The generated source :func:`pipelined_tile` compiles for ``spec``: the fragment
    functions, then ``issue``."""
    ROW, CH, K_ITERS = _geometry(spec)
    return (pipelined_source(spec.head_dim, spec.tile_k, ROW, spec.variant.use_sigmoid)
            + issue_source(CH, spec.threads, K_ITERS, ROW))
