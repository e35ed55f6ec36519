"""The teaching prefill tile: the one kernel to read for prefill attention.

Read it beside the golden model, :func:`nbattn.reference.attend` (what
:func:`nbattn.reference.single_prefill`, ``batch_prefill_ragged`` and
``batch_prefill_paged`` call per request): the same scores, variant, masks, NaN
rule and state, computed one tile of ``T_q`` fused query rows at a time over key
tiles of ``T_k`` with the online softmax of FlashAttention.  Every thread of the
CTA strides over the (row, key) and (row, dim) grids of the tile in shared memory;
there is nothing else to know about the GPU to follow it.

The fast paths compute exactly this and differ only in how they are laid out on
the machine: :mod:`nbattn.cuda.kernels.prefill_cc` (register micro-tiles on CUDA
cores), :mod:`nbattn.cuda.kernels.prefill_mma` and
:mod:`nbattn.cuda.kernels.prefill_pipelined` (tensor cores).  Their common
pieces -- a work item's rows and key range, where a key lives, the masks and the
variant -- are in :mod:`nbattn.cuda.kernels.prefill_common`.

The math, for one query row ``q`` over keys ``k_j`` and values ``v_j`` (the tile
keeps ``m``, ``l`` and ``acc`` for each of its rows)::

    compute qk:        s_j = variant(q . k_j * sm_scale)   (-inf where a mask drops key j)
    update m and l:    m'  = max(m, max_j s_j)
                       alpha = exp(m - m'),   p_j = exp(s_j - m')
                       l'  = alpha * l + sum_j p_j
    update acc:        acc' = alpha * acc + sum_j p_j v_j
    at the end:        o = acc / l,   lse = (m + ln l) / ln 2   (base 2, as the package's states)

A row that kept no key ends with ``m = -inf``: ``o = 0`` and ``lse = -inf``.
Sigmoid attention has no normalizer: ``acc += sigmoid(s_j + bias) v_j`` and the
LSE is NaN.  The NaN rule (docs/bad_input.md): a visible key whose score or V is
not finite makes its row NaN.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from ..blocks import nanrule as NR
from ..blocks.primitives import device_fn, element_io
from ..blocks.rope import row_rotation
from ..blocks.variants import LOG2E, sigmoid_weight, variant_device_fns
from .prefill_common import NO_KEY, KernelSpec, key_locator, kv_reader, tile_item, tile_rows

__all__ = ["core_tile"]


def core_tile(spec: KernelSpec):
    """*The* prefill kernel to read: the teaching tile's per-row body ``tile(w, ...)``,
    the online-softmax form of :func:`nbattn.reference.attend` (see the module doc for
    the math; its three steps are the headings in the loop below).  Launch: grid
    (n_work, num_kv_heads), ``spec.threads`` threads."""
    D, T_q, T_k, NT, group = spec.head_dim, spec.tile_q, spec.tile_k, spec.threads, spec.group
    var = spec.variant
    sigmoid = var.use_sigmoid
    positional = spec.mode != "bsr"       # key positions grow with t: tile ranges can be cut
    stage = tile_rows(spec, positional)
    item = tile_item(spec)
    scale = float32(var.scale(D))
    load, _, _ = element_io(spec.kind)
    _, store, _ = element_io(spec.out_kind)
    kv = kv_reader(spec.mode, spec.kv_layout, load)
    locate = key_locator(spec.mode)
    transform, keep = variant_device_fns(var)
    bias = float32(var.sigmoid_bias)
    neg_inf = float32(-math.inf)
    inv_ln2 = float32(LOG2E)
    store_dtype = float32
    ROPE = var.has_rope                    # RoPE at attention time (blocks/rope.py)
    MASKED = spec.custom_mask               # a runtime custom mask (masked_entry's two arrays)
    HALF = D // 2
    rotate_pair = row_rotation(D, var.rope_scale, var.rope_theta)

    @device_fn
    def mask_keeps(mask_bits, mask_rows, b, q_idx, kv_idx):
        """Bit (b, q_idx, kv_idx) of the custom mask: True keeps the key."""
        bit = mask_rows[b, 0] + int64(q_idx) * mask_rows[b, 1] + int64(kv_idx)
        return (mask_bits[bit >> 3] >> (bit & 7)) & 1 != 0

    @device_fn
    def body(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse, mask_bits, mask_rows):
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, w)

        s_q = cuda.shared.array((T_q, D), store_dtype)
        s_o = cuda.shared.array((T_q, D), float32)     # acc of each row
        s_k = cuda.shared.array((T_k, D), store_dtype)
        s_v = cuda.shared.array((T_k, D), store_dtype)
        s_p = cuda.shared.array((T_q, T_k), float32)   # s, then p, of the tile
        s_kpos = cuda.shared.array(T_k, int32)
        s_m = cuda.shared.array(T_q, float32)
        s_l = cuda.shared.array(T_q, float32)
        s_alpha = cuda.shared.array(T_q, float32)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)      # q_idx - kvoff: last key t a causal row sees
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)

        # Query tile (fused rows: row r is query qi, head h), acc = 0, m = -inf, l = 0.
        for e in range(tid, T_q * D, NT):
            r = e // D
            d = e % D
            s_o[r, d] = 0.0
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                h = kv_head * group + (row0 + r) % group
                s_q[r, d] = load(q, (qi, h, d))
            else:
                s_q[r, d] = 0.0
        for r in range(tid, T_q, NT):
            s_m[r] = neg_inf
            s_l[r] = 0.0
        # rows' positions, then the keys [lo, hi) this tile can see (and the sinks below sink_end)
        lo, hi, sink_end = stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
                                 s_qpos, s_diag, s_req, s_range)
        if ROPE:        # each q row turned to its position q_idx, pair by pair
            cuda.syncthreads()
            for e in range(tid, n_rows * HALF, NT):
                rotate_pair(s_q, e // HALF, e % HALF, s_qpos[e // HALF])
            cuda.syncthreads()

        for t0 in range(kv_begin, hi, T_k):
            if t0 + T_k <= lo and t0 >= sink_end:
                continue   # entirely left of the window and holds no sink
            # Gather the KV tile once for all T_q rows.
            for e in range(tid, T_k * D, NT):
                j = e // D
                d = e % D
                t = t0 + j
                if t < hi:
                    page, slot, pos = locate(kv_indices, kv_ptr, kv_base, t, block, n_keys)
                    if pos != NO_KEY:
                        xv = kv(v_src, 1, page, slot, kv_head, d)
                        if math.isfinite(xv):
                            s_k[j, d] = kv(k_src, 0, page, slot, kv_head, d)
                            s_v[j, d] = xv
                        else:       # the NaN rule: a non-finite V poisons the key's score instead
                            s_k[j, d] = math.nan
                            s_v[j, d] = 0.0
                    else:
                        s_k[j, d] = 0.0
                        s_v[j, d] = 0.0
                    if d == 0:
                        s_kpos[j] = pos
                else:
                    s_k[j, d] = 0.0
                    s_v[j, d] = 0.0
                    if d == 0:
                        s_kpos[j] = NO_KEY
            cuda.syncthreads()
            if ROPE:    # each key turned to its position kv_idx = kvoff + t (one request a tile; "bsr": its row)
                kvoff = s_qpos[0] - s_diag[0] if positional else 0
                for e in range(tid, T_k * HALF, NT):
                    j = e // HALF
                    if s_kpos[j] != NO_KEY:
                        rotate_pair(s_k, j, e % HALF, s_kpos[j] + kvoff)
                cuda.syncthreads()

            # -- compute qk: s[r, j] = variant(q_r . k_j * scale), -inf where a mask drops key j
            for e in range(tid, T_q * T_k, NT):
                r = e // T_k
                j = e % T_k
                s = neg_inf
                if r < n_rows and s_kpos[j] != NO_KEY:
                    q_idx = s_qpos[r]
                    kv_idx = s_kpos[j] + (q_idx - s_diag[r] if positional else 0)
                    h = kv_head * group + (row0 + r) % group
                    b = s_req[r]
                    seen = keep(b, h, q_idx, kv_idx)
                    if MASKED:
                        seen = seen and mask_keeps(mask_bits, mask_rows, b, q_idx, kv_idx)
                    if seen:
                        acc = float32(0.0)
                        for d in range(D):
                            acc += float32(s_q[r, d]) * float32(s_k[j, d])
                        s = NR.checked(acc * scale, transform(acc * scale, b, h, q_idx, kv_idx, slopes[h]))
                s_p[r, j] = s
            cuda.syncthreads()

            # -- update m and l, one thread per row:
            #    m' = max(m, max_j s_j);  alpha = exp(m - m');  p_j = exp(s_j - m');  l' = alpha l + sum_j p_j
            #    (sigmoid: p_j = sigmoid(s_j + bias), alpha = 1, no m or l)
            for r in range(tid, T_q, NT):
                if sigmoid:
                    for j in range(T_k):
                        s = s_p[r, j]
                        s_p[r, j] = sigmoid_weight(s, bias) if s != neg_inf else float32(0.0)
                    s_alpha[r] = 1.0
                else:
                    m_old = s_m[r]
                    m_new = m_old
                    for j in range(T_k):
                        m_new = NR.max_nan(m_new, s_p[r, j])
                    if m_new == neg_inf:        # no visible key yet: nothing to add, nothing to rescale
                        alpha = float32(1.0)
                        for j in range(T_k):
                            s_p[r, j] = 0.0
                    else:
                        alpha = math.exp(m_old - m_new)
                        total = float32(0.0)
                        for j in range(T_k):
                            p = math.exp(s_p[r, j] - m_new)
                            s_p[r, j] = p
                            total += p
                        s_l[r] = s_l[r] * alpha + total
                        s_m[r] = m_new
                    s_alpha[r] = alpha
            cuda.syncthreads()

            # -- update acc: acc' = alpha acc + sum_j p_j v_j
            for e in range(tid, T_q * D, NT):
                r = e // D
                d = e % D
                acc = s_o[r, d] * s_alpha[r]
                for j in range(T_k):
                    acc += s_p[r, j] * float32(s_v[j, d])
                s_o[r, d] = acc
            cuda.syncthreads()

        # o = acc / l and lse = (m + ln l) / ln 2; a row that kept no key writes 0 and -inf.
        for e in range(tid, n_rows * D, NT):
            r = e // D
            d = e % D
            qi = qo_start + (row0 + r) // group
            h = kv_head * group + (row0 + r) % group
            o = s_o[r, d]
            if not sigmoid:
                l_r = s_l[r]
                if s_m[r] != s_m[r] or l_r != l_r:      # a visible key was non-finite
                    o = math.nan
                elif s_m[r] == neg_inf:                 # no visible key (a flag, not l > 0)
                    o = float32(0.0)
                else:
                    o = o / l_r
            store(out, (qi + out_shift, h, d), o)
        for r in range(tid, n_rows, NT):
            qi = qo_start + (row0 + r) // group
            h = kv_head * group + (row0 + r) % group
            if sigmoid:
                lse[qi + out_shift, h] = math.nan
            elif s_m[r] != s_m[r] or s_l[r] != s_l[r]:
                lse[qi + out_shift, h] = math.nan
            elif s_m[r] == neg_inf:
                lse[qi + out_shift, h] = neg_inf
            else:
                lse[qi + out_shift, h] = (s_m[r] + math.log(s_l[r])) * inv_ln2

    if MASKED:
        return body

    @device_fn
    def tile(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        body(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes, block, n_keys,
             out, lse, slopes, row_req)      # no mask: two arrays that are never read

    return tile
