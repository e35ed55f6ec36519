"""The host work of a plain call, compiled: page-table checks and the decode work list.

A plain ``batch_decode_paged`` call validates its page table and builds a work
list on every call.  Written with NumPy that is some thirty array operations,
each costing a few microseconds of Python however small its array; here each is
one loop in a function compiled once by ``numba.njit`` (on the CPU, cached on
disk by :func:`nbattn._jit.njit_cached`), so a call pays one dispatch per step instead.

The readable statements of the same rules stay where they were and remain the
specification these functions are tested against:

* :func:`page_table_ok` is :meth:`nbattn.layout.PagedKV.validate` without the
  messages; :func:`page_table` runs it and, when it answers False, ``validate``,
  which raises the error that names the argument and the rule;
* :func:`decode_work` is :func:`nbattn.cuda.decode.choose_chunk` (the split rule)
  followed by :func:`nbattn.cuda.decode.split_work` (the work list and reduction
  map), written straight into the staging array the call sends to the GPU.
"""
from __future__ import annotations

import numpy as np

from ..._jit import njit_cached

from ... import layout as L

__all__ = ["page_table", "checked_page_table", "page_table_check", "page_table_ok", "decode_work", "DECODE_PARTS", "stage_arrays", "split_plan", "kv_lengths",
           "int32_tables", "decode_call_work", "query_rows", "prefill_rows"]

#: The arrays :func:`decode_work` writes, in order, each at a 16-byte aligned offset.
DECODE_PARTS = ("kv_indptr", "kv_indices", "kv_last", "cta_indptr", "request", "kv_start", "kv_end",
                "out_slot", "merge_indptr", "merge_row", "merge_slots")


_NAMES = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
_INT32_MAX = L.INT32_MAX      # a compile-time constant of the compiled checks


def page_table(indptr, indices, last, page_size: int, num_pages: int) -> L.PagedKV:
    """:meth:`nbattn.layout.PagedKV.validate` with the rules checked by the compiled
    :func:`page_table_check`; only a table that breaks one goes through ``validate``,
    which raises the message naming the argument and the rule."""
    return checked_page_table(indptr, indices, last, page_size, num_pages)[0]


def checked_page_table(indptr, indices, last, page_size: int, num_pages: int) -> tuple:
    """:func:`page_table` and the table's largest page id (-1 without pages)."""
    tables = int32_tables(indptr, indices, last)
    top = page_table_check(*tables, page_size, num_pages)
    if top < -1:
        L.PagedKV.validate(indptr, indices, last, page_size, num_pages)
        raise AssertionError("nbattn: hostwork.page_table_check and PagedKV.validate disagree")
    return L.PagedKV(*tables, int(page_size), int(num_pages)), int(top)


def int32_tables(indptr, indices, last) -> tuple:
    """The three page-table arrays as C-contiguous int32 NumPy arrays (converted only
    where they are not already), each checked by :func:`nbattn.layout.as_int32`."""
    out = []
    for name, x in zip(_NAMES, (indptr, indices, last)):
        if not (type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 1 and x.flags.c_contiguous):
            x = L.as_int32(name, x)
            if not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
        out.append(x)
    return tuple(out)


@njit_cached
def page_table_check(indptr, indices, last, page_size, num_pages):
    """The largest page id of a page table that obeys every rule of
    ``PagedKV.validate`` (-1 when it has no pages), or -2 when it breaks one:
    ``indptr`` starts at 0, never decreases and ends at ``len(indices)``; one
    ``last`` per request; page ids in ``[0, num_pages)``; a request without pages
    has ``last == 0``, one with pages ``1 <= last <= page_size``; every KV length
    ``(pages - 1) * page_size + last`` fits in int32."""
    batch = indptr.shape[0] - 1
    if batch < 0 or indptr[0] != 0 or indptr[batch] != indices.shape[0] or last.shape[0] != batch:
        return -2
    # No early exit in the loops: branch-free bodies and min/max reductions vectorize.
    bad = False
    for r in range(batch):
        n = indptr[r + 1] - indptr[r]
        lr = last[r]
        kv = (np.int64(n) - 1) * page_size + lr
        bad |= (n < 0) | ((n == 0) & (lr != 0)) | ((n > 0) & ((lr < 1) | (lr > page_size) | (kv > _INT32_MAX)))
    if indices.shape[0] == 0:
        return -2 if bad else -1
    lo = indices[0]
    hi = indices[0]
    for i in range(indices.shape[0]):
        lo = min(lo, indices[i])
        hi = max(hi, indices[i])
    return hi if not bad and lo >= 0 and hi < num_pages else -2


@njit_cached
def page_table_ok(indptr, indices, last, page_size, num_pages):
    """Whether a page table obeys every rule of ``PagedKV.validate``
    (:func:`page_table_check`)."""
    return page_table_check(indptr, indices, last, page_size, num_pages) >= -1


@njit_cached
def _aligned(n):
    n = max(n, 1)
    return n + (-n) % 4


@njit_cached
def decode_work(indptr, indices, last, page_size, ctas, slots, grain, floor, edge, buf, copy_indices=True):
    """The work list of a validated page table, packed into ``buf`` (int32).

    Each request's work begins at its first visible key,
    ``(kv_len - 1 - edge) // grain * grain`` (0 when ``edge`` is -1; see
    :func:`nbattn.cuda.decode_problem.first_visible`), and the split rule counts
    the keys from there on.

    Split rule (``choose_chunk``): with ``ctas`` CTAs unsplit and ``slots`` CTA
    slots on the GPU, a batch that fills them is not split; else every request
    longer than ``chunk = roundup(max(floor, ceil(longest / (slots // ctas))), grain)``
    becomes ``ceil(len / chunk)`` items writing consecutive partial slots
    (``split_work``).  No split when that chunk covers the longest request.

    ``buf`` receives the arrays of :data:`DECODE_PARTS` in order, each at an offset
    that is a multiple of 4 words.  Returns ``info`` (int64): ``info[0]`` the words
    needed (nothing is written when ``buf`` is shorter: take a larger one and call
    again), ``info[1]`` the number of items, ``info[2]`` of partial slots,
    ``info[3]`` of merged requests, ``info[4]`` the most partials of one request,
    ``info[5]`` the chunk (0: no split), then the 11 offsets and the 11 lengths.
    ``copy_indices`` False leaves the page ids' place in ``buf`` for the caller to fill
    (``np.copyto`` copies them several times faster than a compiled slice assignment).
    """
    batch = indptr.shape[0] - 1
    nnz = indices.shape[0]
    kv_len = np.empty(batch, np.int64)
    lo = np.zeros(batch, np.int64)
    longest = 0
    for r in range(batch):
        n = indptr[r + 1] - indptr[r]
        kv_len[r] = (n - 1) * page_size + last[r] if n > 0 else 0
        if edge >= 0:
            lo[r] = max(kv_len[r] - 1 - edge, 0) // grain * grain
        longest = max(longest, kv_len[r] - lo[r])
    # -- the split rule --
    chunk = 0
    if ctas < slots and longest > 0:
        splits = max(1, slots // max(ctas, 1))
        c = max(floor, (longest + splits - 1) // splits)
        c = (c + grain - 1) // grain * grain
        if c < longest:
            chunk = c
    # -- sizes --
    n_items = 0
    n_slots = 0
    n_merge = 0
    most = 0
    for r in range(batch):
        seen = kv_len[r] - lo[r]
        k = (seen + chunk - 1) // chunk if chunk > 0 and seen > chunk else 1
        n_items += k
        if k > 1:
            n_slots += k
            n_merge += 1
            most = max(most, k)
    info = np.zeros(6 + 2 * 11, np.int64)
    sizes = (batch + 1, nnz, batch, n_items + 1, n_items, n_items, n_items, n_items,
             n_merge + 1, n_merge, n_slots)
    off = 0
    for j in range(11):
        info[6 + j] = off
        info[17 + j] = sizes[j]
        off += _aligned(sizes[j])
    info[0], info[1], info[2], info[3], info[4], info[5] = off, n_items, n_slots, n_merge, most, chunk
    if off > buf.shape[0]:
        return info
    o = info[6:17]
    buf[o[0]:o[0] + batch + 1] = indptr
    if copy_indices:
        buf[o[1]:o[1] + nnz] = indices
    buf[o[2]:o[2] + batch] = last
    # -- the work list (split_work): items in request order --
    i = 0
    slot = 0
    m = 0
    buf[o[8]] = 0
    for r in range(batch):
        seen = kv_len[r] - lo[r]
        k = (seen + chunk - 1) // chunk if chunk > 0 and seen > chunk else 1
        for j in range(k):
            buf[o[3] + i] = i
            buf[o[4] + i] = r
            if k > 1:
                buf[o[5] + i] = lo[r] + j * chunk
                buf[o[6] + i] = min(kv_len[r], lo[r] + (j + 1) * chunk)
                buf[o[7] + i] = slot
                buf[o[10] + slot] = slot
                slot += 1
            else:
                buf[o[5] + i] = lo[r]
                buf[o[6] + i] = kv_len[r]
                buf[o[7] + i] = -1
            i += 1
        if k > 1:
            buf[o[9] + m] = r
            buf[o[8] + m + 1] = slot
            m += 1
    buf[o[3] + n_items] = n_items
    return info


@njit_cached
def decode_call_work(indptr, indices, last, page_size, num_pages, ctas, slots, grain, floor, edge, buf):
    """A plain call's compiled host work: :func:`page_table_ok`, then, when the table
    obeys every rule, :func:`decode_work` into ``buf`` without the page ids (the caller
    copies ``indices`` to ``info[7]``); ``info[0] = -1`` (and nothing written) when it
    does not."""
    if not page_table_ok(indptr, indices, last, page_size, num_pages):
        info = np.zeros(6 + 2 * 11, np.int64)
        info[0] = -1
        return info
    return decode_work(indptr, indices, last, page_size, ctas, slots, grain, floor, edge, buf, False)


def stage_arrays(host, offsets, arrays, gap):
    """Write ``arrays[i]`` (1-D integer arrays) into ``host`` (int32) at word
    ``offsets[i]`` and return the spans to copy, a list of ``[first, last)`` word
    pairs in increasing order: the written ranges, neighbours closer than ``gap``
    words joined into one so a plan is a few copies.  ``offsets`` must increase.

    Plain Python over NumPy's slice assignment, a memcpy: a compiled element loop was
    an order of magnitude slower on a large page table, and ``np.copyto`` costs more
    per small array (benchmarks/EXPERIMENTS.md, "Writing the plan's staging image
    with ``np.copyto``")."""
    spans = []
    for first, a in zip(offsets, arrays):
        first = int(first)
        last = first + a.shape[0]
        if last == first:
            continue
        host[first:last] = a
        if spans and first - spans[-1][1] <= gap:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    return spans


@njit_cached
def split_plan(kv_lens, splits):
    """The decode wrapper's ``"split"`` plan: request ``r`` cut into ``splits`` chunks of
    ``chunk_r = roundup(max(ceil(len_r / splits), 1), 16)`` keys, chunk ``j`` being keys
    ``[min(j*chunk_r, len_r), min((j+1)*chunk_r, len_r))`` (empty past the end).
    Returns (request, kv_start, kv_end, the largest chunk), item ``r*splits + j``."""
    batch = kv_lens.shape[0]
    n = batch * splits
    request = np.empty(n, np.int32)
    start = np.empty(n, np.int32)
    end = np.empty(n, np.int32)
    largest = 16
    for r in range(batch):
        length = kv_lens[r]
        chunk = max(16, ((length + splits - 1) // splits + 15) // 16 * 16)
        largest = max(largest, chunk)
        for j in range(splits):
            i = r * splits + j
            request[i] = r
            start[i] = min(j * chunk, length)
            end[i] = min(start[i] + chunk, length)
    return request, start, end, largest


@njit_cached
def kv_lengths(indptr, last, page_size):
    """``page_size*(pages-1) + last`` per request, 0 for a request without pages
    (:func:`nbattn.layout.kv_lengths`, compiled)."""
    batch = indptr.shape[0] - 1
    out = np.empty(batch, np.int32)
    for r in range(batch):
        n = indptr[r + 1] - indptr[r]
        out[r] = (n - 1) * page_size + last[r] if n > 0 else 0
    return out


@njit_cached
def query_rows(qo_indptr, kv_lens):
    """Per query row of a ragged batch (``qo_indptr[0] == 0``): its position, bottom-right
    aligned (row ``i`` of a request of ``n`` queries and ``k`` keys sits at ``k - n + i``),
    and its request; int32 arrays of ``qo_indptr[-1]`` rows.  In NumPy::

        req = np.repeat(np.arange(batch), lens)
        pos = kv_lens[req] - lens[req] + (np.arange(total) - qo_indptr[:-1][req])

    six array passes of a few microseconds each; one loop here."""
    batch = qo_indptr.shape[0] - 1
    total = qo_indptr[batch]
    pos = np.empty(total, np.int32)
    req = np.empty(total, np.int32)
    for r in range(batch):
        first, last = qo_indptr[r], qo_indptr[r + 1]
        at = kv_lens[r] - (last - first) - first
        for i in range(first, last):
            pos[i] = at + i
            req[i] = r
    return pos, req


@njit_cached
def prefill_rows(request, qo_tile, kv_start, kv_end, out_slot, cta_indptr, grid_ctas, qo_indptr, kv_indptr,
                 tile_q, group, slot_rows):
    """The prefill wrapper's work rows of a plan (its arrays in CTA-queue order), cut by
    output kind: ``(final, part, final_indptr, part_indptr)``.  A row is 8 int32 columns
    (:func:`nbattn.cuda.host.prefill_launch.build_work`): query start, query length,
    first fused row, first page slot, 0, the chunk's key range, and the first output row:
    the request's own rows for an unsplit tile (``out_slot == -1``), else slot
    ``out_slot`` of ``slot_rows`` rows, moved back by the tile's first position.  CTA
    ``c``'s rows of each kind are ``indptr[c]:indptr[c + 1]``, for ``grid_ctas`` CTAs
    (past the plan's, empty)."""
    n = request.shape[0]
    n_part = 0
    for i in range(n):
        if out_slot[i] != -1:
            n_part += 1
    final = np.empty((n - n_part, 8), np.int32)
    part = np.empty((n_part, 8), np.int32)
    final_indptr = np.zeros(grid_ctas + 1, np.int32)
    part_indptr = np.zeros(grid_ctas + 1, np.int32)
    f = 0
    k = 0
    for c in range(cta_indptr.shape[0] - 1):
        for i in range(cta_indptr[c], cta_indptr[c + 1]):
            r = request[i]
            row0 = qo_tile[i] * tile_q
            if out_slot[i] == -1:
                dst, j, out_row0 = final, f, qo_indptr[r]
                f += 1
            else:
                dst, j, out_row0 = part, k, out_slot[i] * slot_rows - row0 // group
                k += 1
            dst[j, 0] = qo_indptr[r]
            dst[j, 1] = qo_indptr[r + 1] - qo_indptr[r]
            dst[j, 2] = row0
            dst[j, 3] = kv_indptr[r]
            dst[j, 4] = 0
            dst[j, 5] = kv_start[i]
            dst[j, 6] = kv_end[i]
            dst[j, 7] = out_row0
        final_indptr[c + 1] = f
        part_indptr[c + 1] = k
    for c in range(cta_indptr.shape[0] - 1, grid_ctas):
        final_indptr[c + 1] = f
        part_indptr[c + 1] = k
    return final, part, final_indptr, part_indptr

