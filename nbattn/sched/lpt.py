"""LPT placement and the choice of the chunk limit (docs/concepts/scheduler.md).

The pieces of :func:`nbattn.sched.plan.plan` that place work, compiled with
numba (``njit``), and shared with the simulator (:mod:`nbattn.sched.simulate`):

* :func:`query_tiles` cuts every request's fused query rows into tiles;
* :func:`lpt_assign` hands items, in a given order, to the least-loaded CTA
  (longest processing time first when the order is by decreasing cost);
* :func:`chunk_costs` and :func:`lpt_makespan` price a chunk limit;
* :func:`auto_limit` picks the limit of ``chunk_limit="auto"``.

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
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["query_tiles", "lpt_assign", "lpt_makespan", "chunk_costs", "auto_limit"]


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
def lpt_makespan(cost, num_ctas):
    """Makespan of LPT over ``cost`` (largest first, stable on ties)."""
    if num_ctas < 1 or cost.shape[0] == 0:
        return 0.0
    _, cta_load = lpt_assign(cost, np.argsort(-cost, kind="mergesort"), num_ctas)
    return cta_load.max()


@njit(cache=True)
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


@njit(cache=True)
def auto_limit(tile_rows, tile_kv, num_ctas, alpha, beta, overhead, spec_limit):
    """The candidate chunk limit with the smallest LPT makespan (module doc)."""
    longest = 0
    for t in range(tile_kv.shape[0]):
        longest = max(longest, tile_kv[t])
    best_limit = spec_limit
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
