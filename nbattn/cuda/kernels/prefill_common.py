"""What every prefill tile shares: its specification, the key walk, the row stage, the score, the entries.

A prefill kernel build is a per-row body ``tile(wi, ...)`` (a device function
that runs work item ``wi`` of a work list, see
:func:`nbattn.cuda.host.prefill_launch.build_work`) under one of two
``__global__`` entries (:func:`prefill_entry`, :func:`persistent_entry`).  The
tiles (:mod:`~nbattn.cuda.kernels.prefill_core`, the teaching tile;
:mod:`~nbattn.cuda.kernels.prefill_cc`, :mod:`~nbattn.cuda.kernels.prefill_mma`,
:mod:`~nbattn.cuda.kernels.prefill_pipelined`, the fast paths) are built from the
pieces here, so a work item's rows, key range, masks and variant mean the same on
every path:

- :class:`KernelSpec`: what a build is for (its cache key, tuning included);
- the key walk: :func:`key_locator` / :func:`tile_locator` (where key ``t`` lives),
  :func:`kv_reader` (one element or 16 bytes of K or V there);
- the row stage: :func:`tile_thread`, :func:`tile_item`, :func:`tile_rows` (each
  fused row's position and the keys the tile can see, :func:`tile_key_range`),
  :func:`tile_skip` (the next key tile worth loading);
- the score: :func:`tile_visible` (masks), :func:`tile_score` (variant), and
  :func:`plain_variant` (a variant whose whole tiles need neither);
- the generated straight-line device functions' plumbing: :func:`tup`,
  :func:`compile_functions`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from numba import cuda, float32, int32

from ..blocks import nanrule as NR
from ..blocks.primitives import device_fn
from ..blocks.variants import LOG2E, variant_device_fns
from ..host.driver import jit_kernel
from ..tuning import PREFILL, PrefillTuning
from ...variants import Variant

__all__ = ["NO_KEY", "KernelSpec", "plain_variant", "scale_only", "kv_reader", "key_locator", "tile_locator",
           "pow2_shift", "tile_key_range", "tile_thread", "tile_item", "tile_rows", "tile_skip", "warp_unmasked_keys",
           "tile_transform", "tile_visible", "tile_score",
           "prefill_entry", "persistent_entry", "tup", "compile_functions"]

NO_KEY = -(2 ** 30)        # kv position of a tile slot that holds no key


@dataclass(frozen=True)
class KernelSpec:
    """One prefill kernel build: the kernel caches are keyed by it (a Variant with
    user functions hashes by identity; the tuning by its fields)."""
    mode: str           # "paged" | "contig" | "bsr"
    kv_layout: str      # "NHD" | "HND" (for "contig"/"bsr": layout of k, v)
    kind: str           # element type of q/k/v: "f16" | "bf16" | "f32"
    out_kind: str       # element type of out (cascade partial states are "f32")
    head_dim: int
    group: int
    num_qo_heads: int
    variant: Variant
    tensor_cores: bool
    tile_q: int
    tile_k: int
    threads: int
    tuning: PrefillTuning = field(default=PREFILL)
    custom_mask: bool = False   # a runtime mask of bits read per score (the teaching tile only)


def plain_variant(var: Variant) -> bool:
    """Whether the variant applies nothing per score but (maybe) the causal mask: no
    window, sinks, ALiBi, soft-cap, score_mod, mask_mod or sigmoid.  Such a tile
    only scales its scores wherever every row sees every key."""
    return not (int(var.window_left) >= 0 or var.sink_size or var.has_alibi or var.has_soft_cap
                or var.score_mod is not None or var.mask_mod is not None or var.use_sigmoid)


def scale_only(var: Variant) -> bool:
    """Whether a score every mask keeps needs nothing but the scale: no ALiBi, soft-cap,
    ``score_mod``, ``mask_mod`` or sigmoid (a window and sink keys only mask)."""
    return plain_variant(var.with_(window_left=-1, sink_size=0))


def kv_reader(mode: str, kv_layout: str, load: Callable) -> Callable:
    """Device function ``(src, which, page, slot, head, d)`` reading K (which=0)
    or V (which=1) at element d of a row; ``src`` is the paged cache, or k / v.
    ``load(array, index)`` decides what comes back: one float (``element_io``'s
    ``load_elem``, the teaching tile), 4 x uint32 (16 bytes, the fast tiles) or an
    address (``mma.global_addr``, the pipelined tile's copies)."""
    if mode == "paged":
        if kv_layout == "NHD":
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return load(src, (page, which, slot, h, d))
        else:
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return load(src, (page, which, h, slot, d))
    elif kv_layout == "NHD":
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return load(src, (slot, h, d))
    else:
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return load(src, (h, slot, d))
    return kv


def key_locator(mode: str) -> Callable:
    """Device function ``(kv_indices, kv_ptr, kv_base, t, block, n_keys) -> (page, slot, pos)``:
    where key t of a work item lives and its position (NO_KEY when it does not exist).

    - ``"paged"``: page ``kv_indices[kv_ptr + t // page_size]``, slot ``t % page_size``;
    - ``"contig"``: row ``kv_base + t`` of a contiguous ``k``/``v``;
    - ``"bsr"``: column block ``kv_indices[kv_ptr + t // B_c]``, row
      ``block*B_c + t % B_c`` (keys past ``n_keys`` do not exist)."""
    if mode == "paged":
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            return kv_indices[kv_ptr + t // block], t % block, t
    elif mode == "contig":
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            return 0, kv_base + t, t
    else:
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            row = kv_indices[kv_ptr + t // block] * block + t % block
            if row >= n_keys:
                return 0, 0, NO_KEY
            return 0, row, row
    return locate


def tile_locator(mode: str) -> Callable:
    """Device function ``(kv_indices, kv_ptr, kv_base, t, block, n_keys, shift) -> (page, slot, pos)``:
    :func:`key_locator`'s answer for key ``t >= 0``, with a shift and a mask in place
    of ``t // block`` and ``t % block`` when the block (page size, BSR column block)
    is a power of two (``shift >= 0``).  The tensor-core tiles locate each key once
    per tile with it."""
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


@device_fn
def pow2_shift(block):
    """``log2(block)`` when ``block`` is a power of two, else -1 (:func:`tile_locator`'s ``shift``)."""
    shift = -1
    if block > 0 and block & (block - 1) == 0:
        shift = 31 - cuda.clz(int32(block))
    return shift


def tile_key_range(var: Variant, positional: bool):
    """Device function ``(s_diag, s_qpos, n_rows, kv_begin, kv_end) -> (lo, hi, sink_end)``:
    the keys ``[lo, hi)`` a query tile can see, so tiles wholly above the causal
    diagonal or left of the window are skipped, not masked; plus the end of the
    always-visible sink keys.  Causal ends at the last row's diagonal, a window
    starts at the first row's; ``positional`` is False for block-sparse views,
    whose key positions do not grow with t."""
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)

    @cuda.jit(device=True, inline=True)
    def key_range(s_diag, s_qpos, n_rows, kv_begin, kv_end):
        lo = kv_begin
        hi = kv_end
        sink_end = 0
        if positional and (causal or window >= 0):
            d_min = s_diag[0]
            d_max = s_diag[0]
            for r in range(1, n_rows):
                d_min = min(d_min, s_diag[r])
                d_max = max(d_max, s_diag[r])
            if causal:
                hi = min(hi, d_max + 1)
            if window >= 0:
                lo = max(lo, d_min - window)
                # sinks: keys with kv_idx < sink_size, i.e. t < sink_size - kvoff of some row
                for r in range(n_rows if sinks > 0 else 0):
                    sink_end = max(sink_end, sinks - (s_qpos[r] - s_diag[r]))
        return lo, hi, sink_end
    return key_range


def tile_thread(spec: KernelSpec, warp_size: int, cols: int):
    """Device function ``() -> (tid, kv_head, head0, warp, lane, row_lane, col_lane)``:
    this thread, its CTA's KV head and first query head, and its place in a warp of
    ``warp_size`` lanes laid out as rows of ``cols`` lanes."""
    group = spec.group

    @device_fn
    def thread():
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // warp_size
        lane = tid % warp_size
        return tid, kv_head, kv_head * group, warp, lane, lane // cols, lane % cols
    return thread


def tile_item(spec: KernelSpec):
    """Device function ``(work, wi) -> (qo_start, row0, n_rows, kv_ptr, kv_base,
    kv_begin, kv_end, out_shift)``: row ``wi`` of a work list (``build_work``'s
    columns) as every prefill tile reads it; ``n_rows`` counts the tile's real
    fused rows (at most ``T_q``), ``out_shift`` moves a split tile's rows to its
    partial-state slot."""
    T_q, group = spec.tile_q, spec.group

    @cuda.jit(device=True, inline=True)
    def item(work, wi):
        qo_start, qo_len, row0 = work[wi, 0], work[wi, 1], work[wi, 2]
        n_rows = min(T_q, qo_len * group - row0)
        return qo_start, row0, n_rows, work[wi, 3], work[wi, 4], work[wi, 5], work[wi, 6], work[wi, 7] - qo_start
    return item


def tile_rows(spec: KernelSpec, positional: bool, before_barrier: Callable | None = None):
    """Device function ``(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req,
    kv_begin, kv_end, s_qpos, s_diag, s_req, s_range) -> (lo, hi, sink_end)`` every
    prefill tile starts with: each fused row's query position, diagonal (``q_idx -
    kvoff``: the last key t a causal row sees) and request go to shared memory --
    rows past the tile get a diagonal no key reaches -- then thread 0 publishes the
    tile's key range (:func:`tile_key_range`) in ``s_range``, and after a block
    barrier every thread reads it.  ``before_barrier`` (a device function of no
    arguments) runs just before that barrier (the pipelined tile waits for its Q
    copies there)."""
    T_q, NT, group = spec.tile_q, spec.threads, spec.group
    key_range = tile_key_range(spec.variant, positional)
    wait = before_barrier is not None
    pre = before_barrier if wait else _nothing

    @cuda.jit(device=True, inline=True)
    def stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
              s_qpos, s_diag, s_req, s_range):
        for r in range(tid, T_q, NT):
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                s_qpos[r] = row_pos[qi]
                s_diag[r] = row_pos[qi] - row_kvoff[qi]
                s_req[r] = row_req[qi]
            else:
                s_qpos[r] = 0
                s_diag[r] = 2 ** 30
                s_req[r] = 0
        cuda.syncthreads()
        if tid == 0:
            lo, hi, sink_end = key_range(s_diag, s_qpos, n_rows, kv_begin, kv_end)
            s_range[0] = lo
            s_range[1] = hi
            s_range[2] = sink_end
        if wait:
            pre()
        cuda.syncthreads()
        return s_range[0], s_range[1], s_range[2]
    return stage


@device_fn
def _nothing():
    pass


def warp_unmasked_keys(spec: KernelSpec, positional: bool, rows: int, transforms: bool = False):
    """Device functions ``unmasked(s_diag, row_base, n_rows) -> (u_lo, u_hi)`` and
    ``inside(first, last, hi, u_lo, u_hi) -> bool``.  ``[u_lo, u_hi)`` are the keys
    that each of the ``rows`` fused rows from ``row_base`` sees with no mask
    applied -- the blocks that need no mask, as data; ``inside``
    says whether the key tile ``[first, last]`` (keys below ``hi`` exist) lies in
    it.  Such a tile takes the scale-only step; any other takes the per-score
    mask and variant.  ``inside`` compares the window's start only where the
    variant has a window.

    The range is empty when a score needs more than the masks (ALiBi, soft-cap,
    ``score_mod``, ``mask_mod``, sigmoid, a runtime mask), for block-sparse views
    (key positions do not grow with t) and when the rows run past the tile's
    real rows.  With ``transforms`` the caller applies the variant's transform on
    the keys of the range itself (:func:`tile_transform`, where :func:`scale_only`
    is false), so only what masks keys (``mask_mod``, a runtime mask) empties it.
    Otherwise a causal row sees keys up to its diagonal, so
    ``u_hi = min diag + 1``, and a window of ``w`` keys starts at ``diag - w``, so
    ``u_lo = max diag - w``; a key tile of the window's interior needs no mask,
    StreamingLLM sink keys or not (they are visible anyway)."""
    var = spec.variant
    scores_ok = var.mask_mod is None if transforms else scale_only(var)
    masks_only = scores_ok and positional and not spec.custom_mask
    causal, window = var.causal, int32(var.window_left)
    below, above, one = int32(-(2 ** 30)), int32(2 ** 30), int32(1)    # int32 throughout, as s_diag

    @cuda.jit(device=True, inline=True)
    def unmasked(s_diag, row_base, n_rows):
        if not masks_only or row_base + rows > n_rows:
            return above, below                      # empty
        d_min = s_diag[row_base]
        d_max = d_min
        for r in range(row_base + 1, row_base + rows):
            d_min = min(d_min, s_diag[r])
            d_max = max(d_max, s_diag[r])
        # causal: t <= diag for every row;  window: t >= diag - window for every row
        u_hi = d_min + one if causal else above
        u_lo = d_max - window if window >= 0 else below
        return u_lo, u_hi

    @cuda.jit(device=True, inline=True)
    def inside(first, last, hi, u_lo, u_hi):
        # an empty range has u_hi below every key, so last < u_hi fails
        return masks_only and last < hi and last < u_hi and (window < 0 or first >= u_lo)
    return unmasked, inside


def tile_skip(T_k: int):
    """Device function ``(t, lo, sink_end) -> t'``: the first key tile at or after ``t``
    worth loading -- whole tiles left of the window (``lo``) that hold no sink are
    stepped over."""
    @device_fn
    def next_tile(t, lo, sink_end):
        if t >= sink_end and t + T_k <= lo:
            t += ((lo - t) // T_k) * T_k
        return t
    return next_tile


def tile_visible(spec: KernelSpec, positional: bool):
    """Device function ``(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0)
    -> bool``: whether fused row ``r`` of the tile sees key ``t_local`` (the key
    exists, the row is not padding and every mask keeps it) -- the mask half of
    :func:`tile_score`."""
    group = spec.group
    _, keep = variant_device_fns(spec.variant)

    @cuda.jit(device=True, inline=True)
    def visible(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0):
        pos = s_kpos[t_local]
        if not row_ok or pos == NO_KEY:
            return False
        q_idx = s_qpos[r]
        kv_idx = pos + (q_idx - s_diag[r] if positional else 0)
        return keep(s_req[r], head0 + (row0 + r) % group, q_idx, kv_idx)
    return visible


def tile_transform(spec: KernelSpec):
    """Device function ``(x, req, h, q_idx, kv_idx, slope)``: the raw dot product ``x``
    of a query and a key it sees, as a base-2 logit (natural for sigmoid) with the
    variant's transform applied and the NaN rule's check (the score of
    :func:`tile_score` once the masks have kept the key)."""
    var = spec.variant
    sigmoid = var.use_sigmoid
    scale = float32(var.scale(spec.head_dim))
    log2e = float32(LOG2E)
    transform, _ = variant_device_fns(var)

    @cuda.jit(device=True, inline=True)
    def scored(x, req, h, q_idx, kv_idx, slope):
        s = NR.checked(x * scale, transform(x * scale, req, h, q_idx, kv_idx, slope))
        if sigmoid:
            return s
        return s * log2e
    return scored


def tile_score(spec: KernelSpec, positional: bool):
    """Device function ``(x, r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0,
    row0, slopes)``: the raw dot product ``x`` of the tile's fused row ``r`` and key
    ``t_local`` as a base-2 logit (natural for sigmoid) with the variant applied,
    or -inf where the row does not see the key (:func:`tile_visible`).  The row's
    query head is ``head0 + (row0 + r) % group``: a tile starts at fused row
    ``row0`` of its request, which need not be a multiple of the group.  The
    fast tiles use it on the keys a whole tile does not cover."""
    group = spec.group
    neg_inf = float32(-math.inf)
    scored = tile_transform(spec)
    visible = tile_visible(spec, positional)

    @cuda.jit(device=True, inline=True)
    def score(x, r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes):
        if not visible(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0):
            return neg_inf
        q_idx = s_qpos[r]
        kv_idx = s_kpos[t_local] + (q_idx - s_diag[r] if positional else 0)
        h = head0 + (row0 + r) % group
        return scored(x, s_req[r], h, q_idx, kv_idx, slopes[h])
    return score


# ---------------------------------------------------------------------------
# Entries
# ---------------------------------------------------------------------------

def _jit_entry(kernel, bounds):
    return jit_kernel(kernel) if bounds is None else jit_kernel(kernel, launch_bounds=bounds)


def prefill_entry(tile, bounds=None):
    """The ``__global__`` function around a kernel build's per-row body
    ``tile(w, ...)``: one work row per CTA, ``grid = (rows, num_kv_heads)``;
    ``bounds`` = (threads, CTAs per SM) launch bounds, or None."""
    def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
               block, n_keys, out, lse):
        tile(cuda.blockIdx.x, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req,
             slopes, block, n_keys, out, lse)
    return _jit_entry(kernel, bounds)


def masked_entry(tile, bounds=None):
    """:func:`prefill_entry` for a tile that reads a runtime custom mask: two more
    arguments, ``mask_bits`` (uint8, each request's row-major ``[qo_len, kv_len]``
    block packed little-endian on its own) and ``mask_rows`` (int64 ``[batch, 2]``:
    the bit of request r's key ``kv_idx`` for the row at position ``q_idx`` is
    ``mask_rows[r, 0] + q_idx * mask_rows[r, 1] + kv_idx``)."""
    def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
               block, n_keys, out, lse, mask_bits, mask_rows):
        tile(cuda.blockIdx.x, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req,
             slopes, block, n_keys, out, lse, mask_bits, mask_rows)
    return _jit_entry(kernel, bounds)


def masked_persistent_entry(tile, bounds=None):
    """:func:`persistent_entry` for a tile that reads a runtime custom mask (the two
    arrays of :func:`masked_entry`, after ``lse``)."""
    def kernel(q, k_src, v_src, kv_indices, work, cta_indptr, row_pos, row_kvoff, row_req,
               slopes, block, n_keys, out, lse, mask_bits, mask_rows):
        c = cuda.blockIdx.x
        for w in range(cta_indptr[c], cta_indptr[c + 1]):
            tile(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
                 block, n_keys, out, lse, mask_bits, mask_rows)
            cuda.syncthreads()          # the next row overwrites the shared tiles
    return _jit_entry(kernel, bounds)


def persistent_entry(tile, bounds=None):
    """A fixed grid of C CTAs per KV head walking work queues (docs/concepts/scheduler.md).

    ``grid = (C, num_kv_heads)``; CTA ``c`` runs rows ``cta_indptr[c] :
    cta_indptr[c+1]`` of ``work`` in order, so the launch does not depend on
    the plan.  (The body's static shared memory is allocated once per kernel;
    a second body for the other output kind would double it past 48 KB, so the
    plan/run wrapper launches this once per output kind.)"""
    def kernel(q, k_src, v_src, kv_indices, work, cta_indptr, row_pos, row_kvoff, row_req,
               slopes, block, n_keys, out, lse):
        c = cuda.blockIdx.x
        for w in range(cta_indptr[c], cta_indptr[c + 1]):
            tile(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
                 block, n_keys, out, lse)
            cuda.syncthreads()          # the next row overwrites the shared tiles
    return _jit_entry(kernel, bounds)


# ---------------------------------------------------------------------------
# Generated straight-line device functions
# ---------------------------------------------------------------------------

def tup(xs) -> str:
    """Source of a tuple of the names ``xs`` (one element gets its comma)."""
    return "(" + ", ".join(xs) + ",)"


def compile_functions(source: str, label: str, env: dict, names) -> dict:
    """The device functions ``names`` defined by generated ``source`` (globals ``env``),
    force-inlined: ``{name: device function}``.  ``label`` names the source in
    tracebacks (``<nbattn LABEL>``)."""
    env = dict(env)
    exec(compile(source, f"<nbattn {label}>", "exec"), env)
    return {n: device_fn(env[n]) for n in names}
