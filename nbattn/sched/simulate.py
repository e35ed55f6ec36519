"""Scheduler simulator (docs/concepts/scheduler.md, "Simulator").

Given the lengths of one generation step and ``num_ctas`` CTAs, each policy
turns the step into *chunks* (a query tile against a KV range), places the
chunks on CTAs, and the simulator adds up time under a cost model.  No GPU is
involved; the point is to see how much of the machine each policy leaves idle.

Cost model (:class:`nbattn.sched.cost.CostModel`, the planner's too), in abstract
time units by default (one unit ~ the time to stream one KV token of one KV head)::

    chunk time = chunk_overhead + alpha*l_q + beta*l_kv      (in a full wave)
    merge time = l_q * (merge_cost * partials + merge_row)    (per split tile)

``l_q`` is the query tile's fused row count and ``l_kv`` the chunk's key count.
``chunk_overhead`` stands for the fixed price of any work item: reading the
plan entry, the prologue that loads the Q tile and fills the pipeline, the
epilogue.  ``merge_cost * l_q`` is the price of reading one partial state of a
tile (``l_q`` rows) and folding it into the running merge (the merge operator of
docs/concepts/state.md).  A model with ``solo_speedup > 1`` lets the streaming
part run faster once slots fall idle, ``launch`` and ``merge_launch`` add the
fixed price of the two passes (:mod:`nbattn.sched.cost`); the defaults leave
them out.

Execution model:

* Phase 1 (attention): every CTA runs its chunks back to back.
* Phase 2 (merge): after all chunks are done (a kernel boundary), each split
  tile's merge is one job, placed greedily on the least-loaded CTA, in tile
  order.  Unsplit tiles wrote their output in phase 1 and need no merge.
* ``busy[c]`` is the time CTA ``c`` spends working in both phases, and
  ``makespan = launch + max(phase-1 finish) + [merges] (merge_launch + max(phase-2 finish))``.
  ``utilization = sum(busy) / (num_ctas * makespan)``; an empty step (no work)
  has makespan 0 and utilization defined as 1.

Policies:

* ``one_per_cta``: no KV split.  Each query tile of each request is one job over
  its whole KV range (for decode there is one tile per request, so this is
  literally one request per CTA, the paper's baseline).  When there are more
  jobs than CTAs, jobs are dispatched in request order to whichever CTA becomes
  free first, which is what the hardware block scheduler does with a grid
  larger than the resident capacity (greedy list scheduling, no sorting).
* ``fixed_split``: FlashDecoding.  Every tile's KV range is cut into the same
  number of equal chunks, ``num_splits`` (default: just enough that
  ``num_tiles * num_splits >= num_ctas``; never more chunks than keys), or, with
  ``chunk_size``, into chunks of that many keys (the last one shorter), and the
  chunks are dispatched in (request, tile, chunk) order like ``one_per_cta``.
* ``lpt``: the planner of :mod:`nbattn.sched.plan` as the plan/run wrappers
  call it: the simulator's cost model (``plan(cost=...)``) and
  ``chunk_limit="auto"``; CTA queues run in plan order.  Without the overhead
  LPT would treat a 30-key tail chunk as nearly free and pile dozens of them
  onto one CTA.

Two bounds are reported:

* ``lower_bound``: the same for all policies of a step, so makespans can be
  compared.  No policy does less than one chunk per tile, so the total work is
  at least ``sum over tiles (chunk_overhead + alpha*l_q + beta*l_kv)``; divided
  over the CTAs it bounds the makespan.  A tile's work can also not be split
  below one chunk of it, so ``max over tiles (chunk_overhead + alpha*l_q)`` is a
  bound as well; the lower bound is the larger of the two.
* ``chunk_bound``: the bound ``max(sum_j t_j / C, max_j t_j)`` over the
  policy's own chunks (phase 1 only).

Workloads (:func:`make_workload`) are decode steps by default (``l_qo = 1``):
``constant``, ``variable`` (uniform 512..2048), ``skewed`` (one long request
plus many short ones, 1 x 32768 + 63 x 512 by default) and ``zipf``
(heavy-tailed lengths).  Randomness comes from a seeded ``numpy`` Generator.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .._checks import count_arg, int_arg

from .cost import CostModel
from .lpt import query_tiles, work_clock
from .plan import Plan, plan
from .tiles import choose_tile_q

__all__ = [
    "POLICIES",
    "WORKLOADS",
    "CostModel",
    "Workload",
    "Schedule",
    "SimResult",
    "make_workload",
    "simulate",
    "simulate_plan",
    "compare_policies",
]

POLICIES = ("one_per_cta", "fixed_split", "lpt")
WORKLOADS = ("constant", "variable", "skewed", "zipf")


@dataclass(frozen=True, eq=False)
class Workload:
    """One generation step: lengths per request and the GQA group."""

    name: str
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    group: int = 1

    @property
    def batch(self) -> int:
        return int(self.qo_lens.shape[0])


@dataclass(frozen=True, eq=False)
class Schedule:
    """Every job placed in time: parallel arrays, one entry per job.

    ``kind`` is 0 for an attention chunk and 1 for a merge job.  For a merge
    job ``kv_start``/``kv_end`` are 0 and ``qo_tile`` names the merged tile.
    """

    cta: np.ndarray
    start: np.ndarray
    end: np.ndarray
    request: np.ndarray
    qo_tile: np.ndarray
    kv_start: np.ndarray
    kv_end: np.ndarray
    kind: np.ndarray
    num_ctas: int


@dataclass(eq=False)
class SimResult:
    """What one policy does with one step; :meth:`summary` is JSON-ready."""

    policy: str
    workload: str
    num_ctas: int
    tile_q: int
    num_chunks: int
    num_partials: int
    busy: np.ndarray
    makespan: float
    utilization: float
    lower_bound: float
    chunk_bound: float
    schedule: Schedule = field(repr=False)

    @property
    def makespan_over_bound(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    def summary(self) -> dict:
        return {
            "policy": self.policy,
            "workload": self.workload,
            "num_ctas": self.num_ctas,
            "tile_q": self.tile_q,
            "num_chunks": self.num_chunks,
            "num_partials": self.num_partials,
            "makespan": self.makespan,
            "utilization": self.utilization,
            "lower_bound": self.lower_bound,
            "chunk_bound": self.chunk_bound,
            "makespan_over_bound": self.makespan_over_bound,
        }


def make_workload(name: str, batch: int = 64, *, seed: int = 0, qo_len: int = 1, group: int = 1,
                  kv_len: int = 1024, low: int = 512, high: int = 2048, long_len: int = 32768,
                  short_len: int = 512, zipf_a: float = 1.5, zipf_scale: int = 256,
                  max_len: int = 32768, prefill_len: int = 256, prefill_every: int = 8) -> Workload:
    """Build one of :data:`WORKLOADS` with ``batch`` requests of ``qo_len`` queries each.

    * ``constant``: every KV length ``kv_len``.
    * ``variable``: KV lengths uniform in ``[low, high]`` (the paper's "Variable").
    * ``skewed``: one request of ``long_len`` keys, ``batch - 1`` of ``short_len``.
    * ``zipf``: ``zipf_scale * Zipf(zipf_a)`` keys, capped at ``max_len``: most
      requests short, a few very long.
    * ``mixed`` (not one of :data:`WORKLOADS`, the paper's four): a continuous-batching
      step, decode requests with histories uniform in ``[low, high]`` and, every
      ``prefill_every``-th request, a prefill (append) chunk of ``prefill_len``
      queries on top of its history (``qo_len`` is ignored).
    """
    rng = np.random.default_rng(seed)
    count_arg("batch", batch)
    for arg, x in (("qo_len", qo_len), ("group", group), ("zipf_scale", zipf_scale)):
        count_arg(arg, x)
    for arg, x in (("kv_len", kv_len), ("low", low), ("high", high), ("long_len", long_len),
                   ("short_len", short_len), ("max_len", max_len)):
        int_arg(arg, x, minimum=0)
    if high < low:
        raise ValueError(f"high: must be >= low ({low}), got {high}")
    if name == "constant":
        kv = np.full(batch, kv_len, dtype=np.int64)
    elif name == "variable":
        kv = rng.integers(low, high + 1, size=batch)
    elif name == "skewed":
        kv = np.full(batch, short_len, dtype=np.int64)
        kv[0] = long_len
    elif name == "zipf":
        kv = np.minimum(zipf_scale * rng.zipf(zipf_a, size=batch), max_len)
    elif name == "mixed":
        count_arg("prefill_len", prefill_len)
        count_arg("prefill_every", prefill_every)
        qo = np.ones(batch, dtype=np.int32)
        qo[::prefill_every] = prefill_len
        kv = rng.integers(low, high + 1, size=batch) + np.where(qo > 1, qo, 0)
        return Workload(name=name, qo_lens=qo, kv_lens=np.maximum(kv, qo).astype(np.int32), group=group)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS + ('mixed',)}")
    kv = np.maximum(kv, qo_len).astype(np.int32)
    qo = np.full(batch, qo_len, dtype=np.int32)
    return Workload(name=name, qo_lens=qo, kv_lens=kv, group=group)


def _greedy(times, num_ctas, start_loads=None):
    """Place jobs in the given order on the CTA that is free first (lowest id on ties).

    Returns (cta, start) per job and the final load per CTA.
    """
    loads = np.zeros(num_ctas) if start_loads is None else np.array(start_loads, dtype=np.float64)
    heap = [(float(loads[c]), c) for c in range(num_ctas)]
    heapq.heapify(heap)
    cta = np.empty(len(times), dtype=np.int32)
    start = np.empty(len(times), dtype=np.float64)
    for j, t in enumerate(times):
        load, c = heapq.heappop(heap)
        cta[j] = c
        start[j] = load
        heapq.heappush(heap, (load + float(t), c))
    for load, c in heap:
        loads[c] = load
    return cta, start, loads


def _real_times(cta, start, lat, work, num_ctas, cost):
    """Real start and end of every chunk under the cost model's wave speed-up.

    ``start`` is each chunk's start in the additive model (the sum of the full
    times of the chunks before it on its CTA); the latency part of a chunk takes
    its own time, the streaming part runs on the clock ``T`` of
    :func:`nbattn.sched.cost.work_clock`."""
    end_add = start + lat + work
    if cost.solo_speedup <= 1.0 or cta.size == 0:
        return start, end_add
    order = np.lexsort((start, cta))
    lat_before, work_before = _queue_prefix(cta, order, lat)[order], _queue_prefix(cta, order, work)[order]
    slot_work = np.bincount(cta, weights=work, minlength=num_ctas).astype(np.float64)
    levels, times = work_clock(slot_work, float(num_ctas), float(cost.solo_speedup))
    r_start = np.empty(cta.size)
    r_end = np.empty(cta.size)
    r_start[order] = lat_before + np.interp(work_before, levels, times)
    r_end[order] = lat_before + lat[order] + np.interp(work_before + work[order], levels, times)
    return r_start, r_end


def _queue_prefix(cta, order, x):
    """For each chunk, the sum of ``x`` over the chunks before it in its CTA's queue, the
    queues in ``order`` (a permutation sorting chunks by CTA, then queue position)."""
    c, v = cta[order], x[order]
    if c.size == 0:
        return np.zeros(0)
    first = np.r_[True, c[1:] != c[:-1]]
    base = np.maximum.accumulate(np.where(first, np.arange(c.size), 0))
    cum = np.cumsum(v) - v
    out = np.empty(c.size)
    out[order] = cum - cum[base]
    return out


def _finish(policy, workload_name, num_ctas, tile_q, cost, chunks, tiles):
    """Common tail: wave timing, merge phase, busy time, bounds.

    ``chunks``: dict of per-chunk arrays (request, qo_tile, kv_start, kv_end, rows,
    cta, start) for phase 1, ``start`` in the additive model.  ``tiles``:
    (request, tile, rows, kv) of all tiles.
    """
    rows = chunks["rows"]
    kv = chunks["kv_end"] - chunks["kv_start"]
    times = cost.chunk_time(rows, kv)
    work = cost.work_time(rows, kv)
    lat = np.full(kv.shape, float(cost.chunk_overhead))
    # Tiles with more than one chunk need a merge (phase 2, below).
    key = chunks["request"].astype(np.int64) * (1 << 31) + chunks["qo_tile"]
    uniq, first, inverse, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    split = counts > 1
    cta, add_start = np.asarray(chunks["cta"]), np.asarray(chunks["start"], np.float64)
    launch = float(cost.launch)
    if cost.two_pass and split.any():
        # Two launches: the chunks of split tiles, then the unsplit tiles, each CTA's queue in plan order.
        start, end = np.empty(kv.shape), np.empty(kv.shape)
        offset = launch
        for sel in (split[inverse], ~split[inverse]):
            if not sel.any():
                continue
            queue = np.lexsort((add_start[sel], cta[sel]))
            s, e = _real_times(cta[sel], _queue_prefix(cta[sel], queue, times[sel]), lat[sel], work[sel],
                               num_ctas, cost)
            start[sel], end[sel] = s + offset, e + offset
            offset = float(end[sel].max())
    else:
        start, end = _real_times(cta, add_start, lat, work, num_ctas, cost)
        start, end = start + launch, end + launch
    busy = np.bincount(chunks["cta"], weights=end - start, minlength=num_ctas).astype(np.float64)
    phase1 = float(end.max()) if end.size else 0.0

    # One merge job per split tile, in tile order.
    merge_request = chunks["request"][first[split]]
    merge_tile = chunks["qo_tile"][first[split]]
    merge_rows = chunks["rows"][first[split]].astype(np.float64)
    merge_times = cost.merge_time(merge_rows, counts[split])
    order = np.lexsort((merge_tile, merge_request))
    merge_request, merge_tile, merge_times = merge_request[order], merge_tile[order], merge_times[order]
    m_cta, m_start, m_loads = _greedy(merge_times, num_ctas)
    m_base = phase1 + (float(cost.merge_launch) + float(cost.merge_total) * float(counts[split].sum())
                       if merge_times.size else 0.0)
    phase2 = float(m_loads.max()) if merge_times.size else 0.0
    busy += m_loads

    makespan = (m_base + phase2) if merge_times.size else phase1
    utilization = float(busy.sum() / (num_ctas * makespan)) if makespan > 0 else 1.0

    t_request, t_tile, t_rows, t_kv = tiles
    solo = float(cost.solo_speedup)
    tile_work = cost.work_time(t_rows, t_kv)
    head = cost.chunk_overhead + cost.work_time(t_rows, 0) / solo
    lower_bound = launch + max(
        float((cost.chunk_overhead + tile_work / solo).sum()) / num_ctas if t_rows.size else 0.0,
        float(tile_work.sum()) / num_ctas if t_rows.size else 0.0,
        float(head.max()) if t_rows.size else 0.0,
    ) if t_rows.size else 0.0
    chunk_bound = max(float(times.sum()) / num_ctas, float(times.max())) if times.size else 0.0

    n_merge = merge_times.size
    schedule = Schedule(
        cta=np.concatenate([chunks["cta"], m_cta]).astype(np.int32),
        start=np.concatenate([start, m_base + m_start]),
        end=np.concatenate([end, m_base + m_start + merge_times]),
        request=np.concatenate([chunks["request"], merge_request]).astype(np.int32),
        qo_tile=np.concatenate([chunks["qo_tile"], merge_tile]).astype(np.int32),
        kv_start=np.concatenate([chunks["kv_start"], np.zeros(n_merge)]).astype(np.int32),
        kv_end=np.concatenate([chunks["kv_end"], np.zeros(n_merge)]).astype(np.int32),
        kind=np.concatenate([np.zeros(kv.size), np.ones(n_merge)]).astype(np.int8),
        num_ctas=num_ctas,
    )
    return SimResult(
        policy=policy,
        workload=workload_name,
        num_ctas=num_ctas,
        tile_q=tile_q,
        num_chunks=int(kv.size),
        num_partials=int(counts[split].sum()),
        busy=busy,
        makespan=makespan,
        utilization=utilization,
        lower_bound=lower_bound,
        chunk_bound=chunk_bound,
        schedule=schedule,
    )


def simulate_plan(p: Plan, cost: CostModel | None = None, workload: str = "") -> SimResult:
    """Time a :class:`~nbattn.sched.plan.Plan` under ``cost``; each CTA runs its queue in order.

    ``cost`` None: the model the plan was made with (``p.cost_model``), else the
    default model with the plan's ``alpha`` and ``beta``.  Under the plan's own
    model the makespan equals ``p.predicted_makespan``."""
    if cost is None:
        cost = p.cost_model if p.cost_model is not None else CostModel(alpha=p.alpha, beta=p.beta)
    rows = p.item_rows()
    times = cost.chunk_time(rows, p.kv_end - p.kv_start)
    cta = p.item_cta()
    # Start of an item = sum of the times of the items before it in the same queue.
    cumulative = np.cumsum(times)
    queue_first = np.repeat(p.cta_indptr[:-1], np.diff(p.cta_indptr))
    before = np.concatenate([[0.0], cumulative])
    start = cumulative - times - before[queue_first]
    chunks = {
        "request": np.asarray(p.request), "qo_tile": np.asarray(p.qo_tile),
        "kv_start": np.asarray(p.kv_start, dtype=np.int64),
        "kv_end": np.asarray(p.kv_end, dtype=np.int64),
        "rows": rows, "cta": cta, "start": start,
    }
    tiles = query_tiles(p.qo_lens, p.kv_lens, p.group, p.tile_q, p.causal)
    result = _finish("lpt", workload, p.num_ctas, p.tile_q, cost, chunks, tiles)
    assert result.num_partials == p.num_partials
    return result


def _split_chunks(tiles, num_splits, chunk_size=None):
    """Cut every tile's KV range into ``num_splits`` near-equal chunks (at least one key
    each), or with ``chunk_size`` into ``[k*chunk_size, (k+1)*chunk_size)`` pieces."""
    t_request, t_tile, t_rows, t_kv = tiles
    if chunk_size is not None:
        n = np.maximum(1, -(-t_kv // chunk_size))
        request, tile, rows, kv = (np.repeat(x, n) for x in (t_request, t_tile, t_rows, t_kv))
        k = np.arange(request.size) - np.repeat(np.cumsum(n) - n, n)
        return request, tile, rows, np.minimum(k * chunk_size, kv), np.minimum((k + 1) * chunk_size, kv)
    n = np.clip(np.minimum(num_splits, t_kv), 1, None)
    request = np.repeat(t_request, n)
    tile = np.repeat(t_tile, n)
    rows = np.repeat(t_rows, n)
    kv = np.repeat(t_kv, n)
    parts = np.repeat(n, n)
    first = np.repeat(np.cumsum(n) - n, n)
    k = np.arange(request.size) - first
    # Chunk k of n over [0, kv): [floor(k*kv/n), floor((k+1)*kv/n)).
    return request, tile, rows, (k * kv) // parts, ((k + 1) * kv) // parts


def simulate(
    qo_lens,
    kv_lens,
    num_ctas: int,
    policy: str,
    *,
    group: int = 1,
    tile_q: int | None = None,
    cost: CostModel | None = None,
    num_splits: int | None = None,
    chunk_size: int | None = None,
    workload: str = "",
) -> SimResult:
    """Simulate one step under ``policy`` (one of :data:`POLICIES`) on ``num_ctas`` CTA
    slots (one wave).  ``fixed_split`` cuts ``num_splits`` equal chunks per tile or,
    with ``chunk_size``, chunks of that many keys."""
    cost = cost or CostModel()
    num_ctas = count_arg("num_ctas", num_ctas)
    group = count_arg("group", group)
    if tile_q is not None:
        count_arg("tile_q", tile_q)
    if num_splits is not None:
        count_arg("num_splits", num_splits)
    if chunk_size is not None:
        count_arg("chunk_size", chunk_size)
        if policy != "fixed_split":
            raise ValueError(f"chunk_size: only for policy 'fixed_split', got policy {policy!r}")
    qo = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    if qo.shape != kv.shape:
        raise ValueError("qo_lens and kv_lens differ in length")
    for arg, x in (("qo_lens", qo), ("kv_lens", kv)):
        if x.size and int(x.min()) < 0:
            raise ValueError(f"{arg}: lengths must be >= 0, got {int(x.min())}")
    if tile_q is None:
        tile_q = choose_tile_q(qo, group)
    if policy == "lpt":
        # The planner prices a chunk exactly as the simulator does and picks its
        # chunk limit under that price, as the plan/run wrappers ask it to.
        p = plan(qo, kv, num_ctas, tile_q, group=group, cost=cost, chunk_limit="auto")
        return simulate_plan(p, cost, workload)
    tiles = query_tiles(qo, kv, group, tile_q, False)
    if policy == "one_per_cta":
        splits = 1
    elif policy == "fixed_split":
        num_tiles = tiles[0].size
        splits = num_splits if num_splits is not None else max(1, -(-num_ctas // max(num_tiles, 1)))
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    request, tile, rows, kv_start, kv_end = _split_chunks(tiles, splits, chunk_size)
    times = cost.chunk_time(rows, kv_end - kv_start)
    cta, start, _ = _greedy(times, num_ctas)
    chunks = {"request": request, "qo_tile": tile, "kv_start": kv_start, "kv_end": kv_end,
              "rows": rows, "cta": cta, "start": start}
    return _finish(policy, workload, num_ctas, tile_q, cost, chunks, tiles)


def compare_policies(
    workloads,
    num_ctas: int,
    *,
    policies=POLICIES,
    cost: CostModel | None = None,
) -> list[SimResult]:
    """Run every policy on every :class:`Workload`; results in (workload, policy) order."""
    num_ctas = count_arg("num_ctas", num_ctas)
    results = []
    for w in workloads:
        for policy in policies:
            results.append(simulate(w.qo_lens, w.kv_lens, num_ctas, policy, group=w.group,
                                    cost=cost, workload=w.name))
    return results
