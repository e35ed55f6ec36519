"""LPT placement and the choice of the chunk limit (docs/concepts/scheduler.md).

The pieces of :func:`nbattn.sched.plan.plan` that place work, compiled with
numba (``njit``), and shared with the simulator (:mod:`nbattn.sched.simulate`):

* :func:`query_tiles` cuts every request's fused query rows into tiles;
* :func:`lpt_assign` hands items, in a given order, to the least-loaded CTA
  (longest processing time first when the order is by decreasing cost);
* :func:`chunk_costs` and :func:`lpt_makespan` price a chunk limit;
* :func:`auto_limit` picks the limit of ``chunk_limit="auto"``;
* :func:`plan_span` and :func:`choose_plan` price whole plans under a
  :class:`nbattn.sched.cost.CostModel` (merge and wave included) and pick one.

Choosing the chunk limit
------------------------
The base rule fixes ``L = ceil(W / C)``, which balances perfectly when chunks
cost nothing beyond their keys.  With a per-item overhead it can lose to not
splitting at all: 64 requests of 4096 keys on C = 66 CTAs give ``L = 3972``,
so each request becomes a 3972-key chunk plus a 124-key tail, and the two CTAs
left over run 32 tails each.  ``chunk_limit="auto"`` therefore evaluates a few
candidate limits -- the base rule's, no split (the longest tile), and the longest
tile cut in 2, 3 or 4 -- by the LPT makespan they produce under the full cost,
and keeps the best (on ties, the largest limit, i.e. the fewest partial
states).  ``chunk_limit=<int>`` forces a limit; ``None`` (default) is the base
rule.

Choosing the plan (``search="plans"`` cost models)
--------------------------------------------------
With a cost model whose ``search`` is ``"plans"``, ``chunk_limit="auto"`` ranks
whole plans by their predicted makespan, merge pass included
(:mod:`nbattn.sched.cost`), instead of chunk limits by LPT makespan alone.  A
candidate is a chunk limit and a placement:

* limits: the base rule's ``ceil(W/C)`` and twice it, the longest tile and the
  longest cut in 2, 3, 4 or 8, the fixed-split chunk sizes 512, 1024, 2048
  and 4096, and the longest tile cut into ``k`` pieces one to two base limits
  long (:func:`piece_counts`: ``k`` from ``ceil(T/(2 ceil(W/C)))`` to
  ``ceil(T/ceil(W/C))`` in steps of at least 6/5; :func:`candidate_limits`);
* placements: LPT (largest first onto the least-loaded CTA) at every limit and,
  at the fixed-split sizes and the longest tile, also *request order* onto the
  least-loaded CTA, which is what a FlashDecoding-style grid of one CTA per chunk
  does when the hardware hands chunks to free slots in launch order.

The pieces of the longest tile are there for steps with one long request among
short ones: its chunks then set the makespan, and when a merge has a price the
best limit trades a longer chunk against fewer partials somewhere between one and
two base limits, which the fixed sizes and the cuts in 2 to 8 straddle
(docs/concepts/scheduler.md, "What the sweep showed").

So every fixed-split policy with one of those chunk sizes, and one request per
CTA (the longest tile as the limit), is itself a candidate: under the model, the
chosen plan is never predicted slower than any of them.  (Request order is left
out at the other limits to keep the search within its time budget: each
candidate is a whole LPT placement.)  Candidates whose partial slots
or merges exceed the workspace bound (``2*C`` slots, ``C`` merges) are skipped;
the unsplit candidate always fits.  A candidate whose lower bound (streaming at
the full wave's aggregate rate, or its largest chunk alone at ``solo_speedup``)
already loses is not placed.  Ties keep the larger limit (fewer partial
states), then LPT.
"""
from __future__ import annotations

import numpy as np

from .._jit import njit_cached

__all__ = ["query_tiles", "lpt_assign", "lpt_makespan", "chunk_costs", "auto_limit", "plan_span",
           "choose_plan", "candidate_limits", "piece_counts", "slot_finish", "work_clock", "merge_span",
           "LPT_ORDER", "REQUEST_ORDER"]

LPT_ORDER = 0
"""Placement: items largest first onto the least-loaded CTA."""
REQUEST_ORDER = 1
"""Placement: items in (request, tile, chunk) order onto the least-loaded CTA."""


@njit_cached
def query_tiles(qo_lens, kv_lens, group, tile_q, causal):
    """Query tiles over fused rows in (request, tile) order: request, tile index,
    fused rows and KV length of each (with ``causal``, trimmed to the keys the
    tile's last row can see).  The planner and the simulator both cut tiles here."""
    batch = qo_lens.shape[0]
    num_tiles = 0
    for r in range(batch):
        num_tiles += (qo_lens[r] * group + tile_q - 1) // tile_q
    tile_request = np.empty(num_tiles, np.int32)
    tile_index = np.empty(num_tiles, np.int32)
    tile_rows = np.empty(num_tiles, np.int64)
    tile_kv = np.empty(num_tiles, np.int64)
    t = 0
    for r in range(batch):
        rows = qo_lens[r] * group
        n = (rows + tile_q - 1) // tile_q
        for k in range(n):
            start = k * tile_q
            end = min(start + tile_q, rows)
            kv = kv_lens[r]
            if causal and kv > 0:
                last_position = (end - 1) // group
                kv = min(kv, kv - qo_lens[r] + last_position + 1)
            tile_request[t] = r
            tile_index[t] = k
            tile_rows[t] = end - start
            tile_kv[t] = kv
            t += 1
    return tile_request, tile_index, tile_rows, tile_kv


@njit_cached
def lpt_assign(cost, order, num_ctas):
    """LPT placement: items in ``order`` go one by one to the least-loaded CTA,
    the lowest id among equals (a binary min-heap keyed by (load, id)).
    Returns the CTA of each position of ``order`` and every CTA's load."""
    # All loads start equal and ids ascend, so the initial array is already a heap.
    heap_load = np.zeros(num_ctas, np.float64)
    heap_id = np.arange(num_ctas).astype(np.int64)
    assigned = np.empty(order.shape[0], np.int64)
    cta_load = np.zeros(num_ctas, np.float64)
    for j in range(order.shape[0]):
        cta = heap_id[0]
        assigned[j] = cta
        heap_load[0] += cost[order[j]]
        cta_load[cta] = heap_load[0]
        # Sift the root down to restore the heap.
        pos = 0
        while True:
            left = 2 * pos + 1
            if left >= num_ctas:
                break
            best = left
            right = left + 1
            if right < num_ctas and (
                heap_load[right] < heap_load[left]
                or (heap_load[right] == heap_load[left] and heap_id[right] < heap_id[left])
            ):
                best = right
            if heap_load[best] < heap_load[pos] or (
                heap_load[best] == heap_load[pos] and heap_id[best] < heap_id[pos]
            ):
                tmp_load = heap_load[pos]
                heap_load[pos] = heap_load[best]
                heap_load[best] = tmp_load
                tmp_id = heap_id[pos]
                heap_id[pos] = heap_id[best]
                heap_id[best] = tmp_id
                pos = best
            else:
                break
    return assigned, cta_load


@njit_cached
def lpt_makespan(cost, num_ctas):
    """Makespan of LPT over ``cost`` (largest first, stable on ties)."""
    if num_ctas < 1 or cost.shape[0] == 0:
        return 0.0
    _, cta_load = lpt_assign(cost, np.argsort(-cost, kind="mergesort"), num_ctas)
    return cta_load.max()


@njit_cached
def chunk_costs(tile_rows, tile_kv, limit, alpha, beta, overhead):
    n = 0
    for t in range(tile_kv.shape[0]):
        n += max(1, (tile_kv[t] + limit - 1) // limit)
    cost = np.empty(n, np.float64)
    i = 0
    for t in range(tile_kv.shape[0]):
        k = max(1, (tile_kv[t] + limit - 1) // limit)
        for c in range(k):
            length = min(limit, tile_kv[t] - c * limit)
            cost[i] = overhead + alpha * tile_rows[t] + beta * max(length, 0)
            i += 1
    return cost


@njit_cached
def auto_limit(tile_rows, tile_kv, num_ctas, alpha, beta, overhead, spec_limit):
    """The candidate chunk limit with the smallest LPT makespan (module doc)."""
    longest = 0
    for t in range(tile_kv.shape[0]):
        longest = max(longest, tile_kv[t])
    best_limit = spec_limit
    if longest <= spec_limit:        # no candidate above the base limit: nothing to compare
        return best_limit
    best = lpt_makespan(chunk_costs(tile_rows, tile_kv, spec_limit, alpha, beta, overhead), num_ctas)
    for k in range(1, 5):
        cand = (longest + k - 1) // k
        if cand <= spec_limit:
            break
        # No plan beats its largest chunk: skip the LPT pass when that alone loses.
        largest = 0.0
        for t in range(tile_kv.shape[0]):
            largest = max(largest, overhead + alpha * tile_rows[t] + beta * min(cand, tile_kv[t]))
        if largest > best:
            continue
        span = lpt_makespan(chunk_costs(tile_rows, tile_kv, cand, alpha, beta, overhead), num_ctas)
        # Candidates come largest first, so on a tie the larger limit (fewer partials) stays.
        if span < best or (span == best and cand > best_limit):
            best, best_limit = span, cand
    return best_limit


# ---------------------------------------------------------------------------

@njit_cached
def work_clock(work, slots, solo):
    """Breakpoints of ``T``, the time at which a slot that streamed ``w`` units is done:
    sorted work levels and the time each is reached (:mod:`nbattn.sched.cost`).  ``work``:
    each used slot's total streaming work."""
    n = work.shape[0]
    order = np.argsort(work)
    levels = np.empty(n + 1, np.float64)
    times = np.empty(n + 1, np.float64)
    levels[0] = 0.0
    times[0] = 0.0
    active = 0
    for s in range(n):
        if work[s] > 0.0:
            active += 1
    t = 0.0
    prev = 0.0
    for k in range(n):
        w = work[order[k]]
        if w > prev:
            rate = min(solo, slots / max(active, 1))
            if rate < 1.0:
                rate = 1.0
            t += (w - prev) / rate
            prev = w
        levels[k + 1] = w
        times[k + 1] = t
        if w > 0.0:
            active -= 1
    return levels, times


@njit_cached
def slot_finish(lat, work, slots, solo):
    """Finish time of each slot with latency ``lat[s]`` and streaming work ``work[s]``
    when ``slots`` slots make a full wave (``lat + T(work)``)."""
    n = lat.shape[0]
    fin = np.empty(n, np.float64)
    if solo <= 1.0:
        for s in range(n):
            fin[s] = lat[s] + work[s]
        return fin
    levels, times = work_clock(work, slots, solo)
    fin[:] = lat + np.interp(work, levels, times)
    return fin


@njit_cached
def merge_span(rows, partials, num_ctas, merge_cost, merge_row):
    """Merge-pass time (without its launch): split tiles' jobs ``rows*(merge_cost*partials
    + merge_row)`` in tile order on the least-loaded of ``num_ctas`` CTAs."""
    m = rows.shape[0]
    if m == 0:
        return 0.0
    cost = np.empty(m, np.float64)
    for i in range(m):
        cost[i] = rows[i] * (merge_cost * partials[i] + merge_row)
    _, load = lpt_assign(cost, np.arange(m), num_ctas)
    return load.max()


@njit_cached
def _chunk_items(tile_rows, tile_kv, limit):
    """Rows, keys and tile of every chunk at ``limit``, in (tile, chunk) order, and the
    chunk count of each tile (a tile with no keys still has one, empty, chunk)."""
    n = 0
    for t in range(tile_kv.shape[0]):
        n += max(1, (tile_kv[t] + limit - 1) // limit)
    rows = np.empty(n, np.float64)
    keys = np.empty(n, np.float64)
    count = np.empty(tile_kv.shape[0], np.int64)
    i = 0
    for t in range(tile_kv.shape[0]):
        k = max(1, (tile_kv[t] + limit - 1) // limit)
        count[t] = k
        for c in range(k):
            rows[i] = tile_rows[t]
            keys[i] = max(0, min(limit, tile_kv[t] - c * limit))
            i += 1
    return rows, keys, count


@njit_cached
def plan_span(tile_rows, tile_kv, limit, mode, num_ctas, alpha, beta, overhead, merge_cost, merge_row,
              merge_launch, merge_total, launch, solo, two_pass=0.0):
    """Predicted makespan of the plan with chunk ``limit`` and placement ``mode``
    (:data:`LPT_ORDER` or :data:`REQUEST_ORDER`) under the cost model of
    :mod:`nbattn.sched.cost`, merge pass included.  ``two_pass``: the chunks of
    split tiles run as one pass and the unsplit tiles as a second, each CTA's
    queue cut in two (the prefill wrapper's two launches)."""
    rows, keys, count = _chunk_items(tile_rows, tile_kv, limit)
    work = alpha * rows + beta * keys
    total = work + overhead
    if mode == LPT_ORDER:
        order = np.argsort(-total, kind="mergesort")
    else:
        order = np.arange(total.shape[0])
    assigned, _ = lpt_assign(total, order, num_ctas)
    # pass 0: every item, or (two_pass) the unsplit tiles; pass 1: chunks of split tiles
    is_split = np.empty(total.shape[0], np.bool_)
    i = 0
    for t in range(count.shape[0]):
        for _c in range(count[t]):
            is_split[i] = two_pass > 0.0 and count[t] > 1
            i += 1
    lat = np.zeros((2, num_ctas), np.float64)
    cta_work = np.zeros((2, num_ctas), np.float64)
    for j in range(order.shape[0]):
        k = 1 if is_split[order[j]] else 0
        lat[k, assigned[j]] += overhead
        cta_work[k, assigned[j]] += work[order[j]]
    span = 0.0
    if total.shape[0]:
        span = launch
        for k in range(2):
            if lat[k].max() > 0.0 or cta_work[k].max() > 0.0:
                span += slot_finish(lat[k], cta_work[k], num_ctas, solo).max()
    m = 0
    for t in range(count.shape[0]):
        if count[t] > 1:
            m += 1
    if m:
        m_rows = np.empty(m, np.float64)
        m_parts = np.empty(m, np.float64)
        i = 0
        for t in range(count.shape[0]):
            if count[t] > 1:
                m_rows[i] = tile_rows[t]
                m_parts[i] = count[t]
                i += 1
        span += merge_launch + merge_total * m_parts.sum() + merge_span(m_rows, m_parts, num_ctas, merge_cost,
                                                                         merge_row)
    return span


@njit_cached
def piece_counts(longest, spec_limit):
    """Piece counts ``k`` of the longest tile whose pieces, ``ceil(longest / k)`` keys,
    are one to two base limits long: ``k`` from ``ceil(longest / (2*spec_limit))`` to
    ``ceil(longest / spec_limit)``, each at least 6/5 of the one before, the last
    always included (module doc).  At most five counts."""
    lo = max(1, (longest + 2 * spec_limit - 1) // (2 * spec_limit))
    hi = max(lo, (longest + spec_limit - 1) // spec_limit)
    out = np.empty(16, np.int64)
    n = 0
    k = lo
    while k < hi and n < 15:
        out[n] = k
        n += 1
        k = max(k + 1, (6 * k + 4) // 5)
    out[n] = hi
    return out[:n + 1]


@njit_cached
def candidate_limits(tile_kv, spec_limit):
    """The chunk limits ``choose_plan`` tries (module doc), largest first, without repeats."""
    longest = 1
    for t in range(tile_kv.shape[0]):
        longest = max(longest, tile_kv[t])
    ks = piece_counts(longest, spec_limit)
    raw = np.empty(11 + ks.shape[0], np.int64)
    raw[:11] = np.array([longest, (longest + 1) // 2, (longest + 2) // 3, (longest + 3) // 4, (longest + 7) // 8,
                         2 * spec_limit, spec_limit, 4096, 2048, 1024, 512], np.int64)
    for i in range(ks.shape[0]):
        raw[11 + i] = (longest + ks[i] - 1) // ks[i]
    raw = np.maximum(np.minimum(raw, longest), 1)
    raw = np.sort(raw)[::-1]
    out = np.empty(raw.shape[0], np.int64)
    n = 0
    for x in raw:
        if n == 0 or out[n - 1] != x:
            out[n] = x
            n += 1
    return out[:n]


@njit_cached
def choose_plan(tile_rows, tile_kv, num_ctas, alpha, beta, overhead, merge_cost, merge_row, merge_launch,
                merge_total, launch, solo, spec_limit, two_pass=0.0):
    """(limit, placement, predicted makespan) of the best candidate plan (module doc)."""
    limits = candidate_limits(tile_kv, spec_limit)
    best = np.inf
    best_limit = limits[0]
    best_mode = LPT_ORDER
    for li in range(limits.shape[0]):
        limit = limits[li]
        # Partial slots and merges this limit makes, and a lower bound on its makespan.
        partials = 0
        merges = 0
        sum_work = 0.0
        largest = 0.0
        merge_floor = 0.0
        for t in range(tile_kv.shape[0]):
            k = max(1, (tile_kv[t] + limit - 1) // limit)
            if k > 1:
                partials += k
                merges += 1
                merge_floor = max(merge_floor, tile_rows[t] * (merge_cost * k + merge_row))
            w = alpha * tile_rows[t] * k + beta * tile_kv[t]
            sum_work += w
            largest = max(largest, overhead + (alpha * tile_rows[t] + beta * min(limit, tile_kv[t])) / solo)
        if partials > 2 * num_ctas or merges > num_ctas:
            continue
        floor = launch + max(sum_work / num_ctas, largest)
        if merges:
            floor += merge_launch + merge_total * partials + merge_floor
        if floor > best:
            continue
        fixed = limit == limits[0] or limit == 512 or limit == 1024 or limit == 2048 or limit == 4096
        for mode in (LPT_ORDER, REQUEST_ORDER):
            if mode == REQUEST_ORDER and not fixed:
                continue
            span = plan_span(tile_rows, tile_kv, limit, mode, num_ctas, alpha, beta, overhead, merge_cost,
                             merge_row, merge_launch, merge_total, launch, solo, two_pass)
            # Limits come largest first and LPT before request order: a tie keeps the earlier.
            if span < best * (1.0 - 1e-12):
                best, best_limit, best_mode = span, limit, mode
    return best_limit, best_mode, best
