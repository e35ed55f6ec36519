"""Fit the scheduler's cost model (nbattn.sched.cost) to measured kernel times.

Used by ``benchmarks/gpu_sched.py`` (which measures the probes on the GPU and
calls :func:`fit_decode`), and on its own to re-read a result file::

    PYTHONPATH=$PWD python3 benchmarks/fit_cost.py --analyse benchmarks/results/sched.json
    PYTHONPATH=$PWD python3 benchmarks/fit_cost.py --analyse \
        benchmarks/results/experiments/sched_h200_2026-11-29.json

``--analyse`` on a sweep file (what ``gpu_sched.py`` writes: five workloads at
batch 16, 64 and 256) runs :func:`analyse_sweep`: it rebuilds every plan of
every step from its lengths (and stops if one does not reproduce the recorded
item and partial counts), then

* refits the decode model separately to the wrapper's records and to the fixed
  splits' records (FlashDecoding: another decode launch, another merge kernel)
  and prints each path's errors (in sample, and out: each step left out) and prices;
* asks the planner what it would choose under the wrapper's refit model, and
  under that model with the fixed splits' merge prices;
* fits the mixed prefill + decode records under the planner's own view (all
  planned CTAs at once) and under list scheduling of the whole grid
  (``num_ctas x num_kv_heads`` persistent CTAs on the resident slots), with the
  split chunks and the unsplit tiles as one pass or as the wrapper's two
  launches.

On the older table of the 2026-11-29 file (skewed / constant / long-variable,
batch 64, C = 33) it runs :func:`analyse`, which fits two hypotheses:

* H1: the per-item overhead is streaming work like the keys (it speeds up in
  the tail with everything else); one merge cost for both merge kernels.
* H3: the per-item overhead is latency (it does not speed up in the tail), and
  the wrapper's fixed-grid merge and the split baseline's merge are priced
  separately.

Probes (all through the public decode wrapper, ``gpu_sched.py``):

* *stream*: ``S * n`` equal requests of ``keys / n`` keys on ``S`` planner CTAs,
  unsplit: every slot runs ``n`` items and ``keys`` keys, all slots equal (no
  tail): ``T = launch + beta*keys + chunk_overhead*n``, linear least squares.
* *solo*: ``a <= S`` requests of ``keys`` keys, each alone on its CTA, the
  other slots idle: ``T = launch + chunk_overhead + beta*keys / min(solo, S/a)``;
  ``solo_speedup`` by a grid search given the stream fit.
* *merge*: requests cut into ``P`` chunks (forced limits), so the decode part
  is known from the two fits above; the rest is ``merge_launch + rows *
  merge_cost * P_max + merge_total * P_all`` (the largest merge's partials, and
  all of the plan's), linear least squares.  One request in 2, 8 or 32 pieces
  and ``C`` requests in 2 pieces each tell the two prices apart.

Decode items all have ``group`` query rows, so ``alpha`` (per row) cannot be
told apart from the item overhead: a decode fit sets ``alpha = 0`` and the
rows' price is part of ``chunk_overhead``; likewise ``merge_row = 0`` (every
merge has the same rows).
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

import numpy as np

SOLO_GRID = np.round(np.arange(1.0, 8.01, 0.05), 3)


def _nonneg_lstsq(A, b, weights=None):
    """Least squares with every coefficient >= 0 (drop negative ones and refit)."""
    A = np.asarray(A, np.float64)
    b = np.asarray(b, np.float64)
    w = np.ones(len(b)) if weights is None else np.asarray(weights, np.float64)
    keep = list(range(A.shape[1]))
    while True:
        sol = np.zeros(A.shape[1])
        if keep:
            x, *_ = np.linalg.lstsq(A[:, keep] * w[:, None], b * w, rcond=None)
            sol[keep] = x
        neg = [k for k in keep if sol[k] < 0]
        if not neg:
            return sol
        keep.remove(min(neg, key=lambda k: sol[k]))


def fit_stream(points):
    """``points``: (items per slot, keys per slot, us).  Returns launch, beta (us per key),
    chunk_overhead (us per item), the relative residuals.  Relative errors are weighted
    equally (1/us weights)."""
    pts = np.asarray(points, np.float64)
    A = np.c_[np.ones(len(pts)), pts[:, 1], pts[:, 0]]
    launch, beta, overhead = _nonneg_lstsq(A, pts[:, 2], 1.0 / pts[:, 2])
    pred = A @ np.array([launch, beta, overhead])
    return dict(launch=float(launch), beta=float(beta), chunk_overhead=float(overhead),
                rel_residuals=(pred / pts[:, 2] - 1).tolist())


def solo_predict(active, keys, slots, launch, beta, overhead, solo):
    return launch + overhead + beta * keys / np.minimum(solo, slots / np.asarray(active, np.float64))


def fit_solo(points, slots, launch, beta, overhead):
    """``points``: (active slots, keys, us).  The ``solo_speedup`` with the smallest mean
    squared relative error: the best value of :data:`SOLO_GRID`, then a golden-section
    search within one grid step of it (the merge fit builds on this number, so a grid
    step's error would reach the merge prices)."""
    pts = np.asarray(points, np.float64)

    def rel(solo):
        return solo_predict(pts[:, 0], pts[:, 1], slots, launch, beta, overhead, solo) / pts[:, 2] - 1

    def err(solo):
        return float(np.mean(rel(solo) ** 2))

    best = min(SOLO_GRID, key=lambda s: (err(s), s))
    step = float(SOLO_GRID[1] - SOLO_GRID[0])
    lo, hi = max(float(SOLO_GRID[0]), best - step), min(float(SOLO_GRID[-1]), best + step)
    g = (np.sqrt(5.0) - 1) / 2
    for _ in range(60):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if err(a) <= err(b):
            hi = b
        else:
            lo = a
    solo = min((float(best), (lo + hi) / 2), key=err)
    return dict(solo_speedup=solo, rel_residuals=rel(solo).tolist())


def fit_merge(points):
    """``points``: (rows * partials of the largest merge, partial slots of the plan, measured us,
    predicted decode us).  Returns merge_launch, merge_cost (per partial row of the largest
    merge: merges side by side) and merge_total (per partial slot of the plan: a price the
    merges do not share out); which one the probes support is the fit's answer."""
    pts = np.asarray(points, np.float64)
    rest = pts[:, 2] - pts[:, 3]
    A = np.c_[np.ones(len(pts)), pts[:, 0], pts[:, 1]]
    sol = _nonneg_lstsq(A, rest, 1.0 / pts[:, 2])
    pred = pts[:, 3] + A @ sol
    return dict(merge_launch=float(sol[0]), merge_cost=float(sol[1]), merge_total=float(sol[2]),
                rel_residuals=(pred / pts[:, 2] - 1).tolist())


def fit_decode(stream, solo, merge_of, slots, ctas_per_sm, sm_count):
    """The whole decode fit: ``stream`` and ``solo`` probe points as above; ``merge_of``
    a function of the partial fit (a dict) returning merge points (so the decode part of
    each merge probe is predicted with the fitted numbers).  Returns the model's fields
    and the residuals of each stage."""
    s = fit_stream(stream)
    o = fit_solo(solo, slots, s["launch"], s["beta"], s["chunk_overhead"])
    partial = dict(alpha=0.0, beta=s["beta"], chunk_overhead=s["chunk_overhead"], launch=s["launch"],
                   solo_speedup=o["solo_speedup"])
    m = fit_merge(merge_of(partial)) if merge_of is not None else dict(merge_launch=0.0, merge_cost=0.0,
                                                                        merge_total=0.0, rel_residuals=[])
    model = dict(partial, merge_cost=m["merge_cost"], merge_row=0.0, merge_launch=m["merge_launch"],
                 merge_total=m["merge_total"],
                 ctas_per_sm=int(ctas_per_sm), sm_count=int(sm_count), search="plans", unit="us")
    return model, dict(stream=s["rel_residuals"], solo=o["rel_residuals"], merge=m["rel_residuals"])


# ---------------------------------------------------------------------------
# --analyse on the 2026-11-29 table (skewed / constant / long-variable, batch 64)
# ---------------------------------------------------------------------------

def _greedy(lat, work, slots):
    heap = [(0.0, s) for s in range(slots)]
    L, W = np.zeros(slots), np.zeros(slots)
    for a, b in zip(lat, work):
        t, s = heapq.heappop(heap)
        heapq.heappush(heap, (t + a + b, s))
        L[s] += a
        W[s] += b
    return L, W


def _finish(L, W, slots, solo, latency):
    from nbattn.sched.cost import slot_finish
    if latency:
        return float(slot_finish(L, W, float(slots), float(solo)).max())
    return float(slot_finish(np.zeros_like(L), L + W, float(slots), float(solo)).max())


def analyse(path, slots=33, group=4):
    from nbattn.sched import plan
    d = json.loads(Path(path).read_text())
    rng = np.random.default_rng(2026)     # gpu_sched.py's generator at the time of the table
    lens = {"skewed": np.array([32768] + [512] * 63), "constant": np.full(64, 4096),
            "long_variable": rng.integers(8192, 32769, 64)}
    meas = {(r["case"]["workload"], r["case"]["policy"]): r for r in d["records"] if r["metric"] == "latency_us"}
    configs = {}
    for (w, pol), r in meas.items():
        c = r["case"]
        if int(np.sum(lens[w])) != c["total_kv"]:
            raise SystemExit(f"{w}: lengths do not reproduce total_kv {c['total_kv']}")
        if pol == "one_per_cta" or pol.startswith("split_"):
            chunk = None if pol == "one_per_cta" else int(pol.split("_")[1])
            items = [min(int(n), a + chunk) - a for n in lens[w] for a in range(0, int(n), chunk)] \
                if chunk else [int(n) for n in lens[w]]
            parts = sum(1 for n in lens[w] for _ in range(0, int(n), chunk)) - sum(
                1 for n in lens[w] if n <= chunk) if chunk else 0
            configs[(w, pol)] = ("baseline", [(1, k) for k in items], parts, "partials")
        else:
            p = plan(np.ones(64, np.int64), lens[w], c["num_ctas"], tile_q=group, group=group,
                     chunk_overhead=c["chunk_overhead"], chunk_limit=None if "spec" in pol else "auto")
            if (p.num_items, p.num_partials) != (c["items"], c["partials"]):
                raise SystemExit(f"{w}/{pol}: plan does not reproduce the record")
            cta = p.item_cta()
            keys = (p.kv_end - p.kv_start).astype(float)
            per_cta = [(int((cta == k).sum()), float(keys[cta == k].sum())) for k in range(p.num_ctas)]
            configs[(w, pol)] = ("static", per_cta, p.num_partials, "tiles")
    fc = d["checks"]["item_overhead_fit"]
    probes = [(int(n), t) for n, t in zip(fc["items_per_cta"], fc["kernel_us"])]
    keys = sorted(configs)

    def phase(k, ovh, solo, latency):
        if isinstance(k, int):                       # forced-chunk probe: 64 CTAs x k items of 4096/k
            L, W = _greedy([k * ovh] * 64, [4096.0] * 64, slots)
            return _finish(L, W, slots, solo, latency), 0, None
        mode, jobs, parts, kind = configs[k]
        L, W = _greedy([n * ovh for n, _ in jobs], [kk for _, kk in jobs], slots)
        return _finish(L, W, slots, solo, latency), parts, kind

    points = [(k, meas[k]["value"]) for k in keys] + probes
    out = {}
    for tag, latency, split_merge in (("H1", False, False), ("H3", True, True)):
        best = None
        for solo in (1.0, 1.5, 2.0, 2.6, 3.0, 4.0):
            for ovh in (0, 16, 32, 48, 64, 82, 100, 130, 160):
                A, b = [], []
                for k, t in points:
                    ph, parts, kind = phase(k, ovh, solo, latency)
                    if split_merge:
                        row = [ph, 1, float(bool(parts) and kind == "partials"), parts * (kind == "partials"),
                               float(bool(parts) and kind == "tiles"), parts * (kind == "tiles")]
                    else:
                        row = [ph, 1, float(bool(parts)), parts, 0, 0]
                    A.append(row)
                    b.append(t)
                A, b = np.array(A, float), np.array(b, float)
                sol = _nonneg_lstsq(A, b, 1 / b)
                e = A @ sol / b - 1
                rms = float(np.sqrt(np.mean(e ** 2)))
                if best is None or rms < best[0]:
                    best = (rms, ovh, solo, sol, e)
        rms, ovh, solo, sol, e = best
        out[tag] = dict(rms=rms, overhead_tokens=ovh, solo_speedup=solo, us_per_token=sol[0], launch_us=sol[1],
                        baseline_merge=(sol[2], sol[3]), wrapper_merge=(sol[4], sol[5]),
                        errors={str(k): float(x) for (k, _), x in zip(points, e)})
        print(f"{tag}: rms {rms:.1%}; item overhead {ovh} tokens ({'latency' if latency else 'work'}), "
              f"solo speed-up {solo}, {sol[0]:.4f} us/token, launch {sol[1]:.1f} us; merge (launch us, "
              f"us per partial): baseline {sol[2]:.1f}, {sol[3]:.3f}; wrapper {sol[4]:.1f}, {sol[5]:.3f}")
        for (k, t), x in zip(points, e):
            print(f"   {str(k):40s} measured {t:8.1f} us  predicted {t * (1 + x):8.1f}  error {x:+.1%}")
    return out


# ---------------------------------------------------------------------------
# --analyse on a sweep file (gpu_sched.py: five workloads, batch 16 / 64 / 256)
# ---------------------------------------------------------------------------

SWEEP_SLOTS = 33            # decode planner CTAs per KV head (2 CTAs an SM x 132 SMs / 8 head blocks)
SWEEP_GROUP = 4             # 32 query heads over 8 KV heads
SWEEP_KV_HEADS = 8
PREFILL_CTAS = 132          # the prefill wrapper's num_ctas before plans covered one wave (one per SM, per KV head)
PREFILL_SLOTS = 33          # the prefill wrapper's planned CTAs per KV head now (2 an SM x 132 SMs / 8 KV heads)
PREFILL_TILE = 64           # its kernel's query tile, in fused rows
OVERHEAD_GRID = tuple(range(0, 241, 8))                  # item price, KV tokens
SOLO_SWEEP_GRID = tuple(np.round(np.arange(1.0, 2.001, 0.05), 3))
PREFILL_OVERHEAD_GRID = (0, 64, 128, 256, 512, 1024, 2048)


def sweep_lengths(workload: str, batch: int):
    """(qo_lens, kv_lens) of one step of the sweep, generated as ``gpu_sched.py`` does
    (``decode_lens`` with seed ``100 + batch``, ``mixed_lens`` with ``200 + batch``)."""
    from nbattn.sched import make_workload
    if workload == "mixed":
        w = make_workload("mixed", batch, seed=200 + batch, low=512, high=4096)
        return np.asarray(w.qo_lens, np.int64), np.asarray(w.kv_lens, np.int64)
    kw = dict(kv_len=4096, low=512, high=8192, long_len=32768, short_len=512, zipf_scale=256, max_len=32768)
    w = make_workload("variable" if workload == "uniform" else workload, batch, seed=100 + batch, **kw)
    kv = np.asarray(w.kv_lens, np.int64)
    return np.ones(kv.size, np.int64), kv


def _fixed_chunk(policy: str):
    return None if policy == "one_per_cta" else int(policy.split("_")[1])


def split_items(kv_lens, chunk):
    """FlashDecoding's work (``nbattn.cuda.decode.split_work``): the keys of every item in
    launch order, a request longer than ``chunk`` cut into ``chunk``-key pieces (None: one
    item a request), and the partials of each split request."""
    items, merges = [], []
    for n in np.asarray(kv_lens, np.int64).tolist():
        if chunk is None or n <= chunk:
            items.append(n)
            continue
        items += [min(n, a + chunk) - a for a in range(0, n, chunk)]
        merges.append(-(-n // chunk))
    return np.asarray(items, np.float64), np.asarray(merges, np.float64)


def rebuild_sweep(d: dict, model) -> list:
    """Every ``latency_us`` record of a sweep file with its plan rebuilt from the lengths.

    Returns dicts with ``path`` (``"wrapper"``: the decode wrapper's LPT plans,
    ``"split"``: FlashDecoding's fixed splits and one request per CTA, ``"prefill"``:
    the mixed steps through the prefill wrapper), ``case``, measured ``t`` (us), and
    ``plan`` (a :class:`nbattn.sched.Plan`) or ``items`` (keys of each item in launch
    order) with ``merges`` (partials of each split request).  Raises ``SystemExit`` when
    a rebuilt plan does not reproduce the record."""
    from nbattn.sched import plan
    rows = []
    for r in d["records"]:
        c = r["case"]
        if r["metric"] != "latency_us" or "batch" not in c or "policy" not in c:
            continue
        w, b, pol = c["workload"], int(c["batch"]), c["policy"]
        qo, kv = sweep_lengths(w, b)
        if int(kv.sum()) != c["total_kv"] or int(kv.max()) != c["max_kv"]:
            raise SystemExit(f"{w} b{b}: lengths do not reproduce total_kv / max_kv")
        row = dict(case=c, t=float(r["value"]), workload=w, batch=b, policy=pol)
        if w == "mixed":
            base = pol.removesuffix("_all_ctas")       # the same rule over every CTA (the older plans)
            limit = {"one_per_cta": int(kv.max()), "lpt": "auto", "lpt_spec": None}.get(base)
            if base.startswith("split_"):
                limit = _fixed_chunk(base)
            elif base.startswith("lpt") and c.get("placement", "lpt") == "lpt" and "num_ctas" in c:
                limit = int(c["chunk_limit"])          # the limit it ran with (some were chosen under a fit)
            p = plan(qo, kv, int(c.get("num_ctas", PREFILL_CTAS)), tile_q=PREFILL_TILE, group=SWEEP_GROUP,
                     causal=True, chunk_limit=limit)
            got = (p.num_items, p.num_partials, p.chunk_limit)
            want = (c["items"], c["partials"], c["chunk_limit"])
            row.update(path="prefill", plan=p, merges=np.diff(p.merge_indptr).astype(np.float64))
        elif pol == "one_per_cta" or pol.startswith("split_"):
            items, merges = split_items(kv, _fixed_chunk(pol))
            got, want = (items.size, int(merges.sum())), (c["items"], c["partials"])
            row.update(path="split", items=items, merges=merges)
        else:
            # The plan as it ran: its recorded limit, placed by LPT under the cost it was made with.
            if c["placement"] != "lpt":
                raise SystemExit(f"{w} b{b} {pol}: a {c['placement']!r} placement cannot be rebuilt")
            kw = dict(cost=model) if pol == "lpt" else dict(chunk_overhead=c["chunk_overhead"])
            p = plan(qo, kv, c["num_ctas"], tile_q=SWEEP_GROUP, group=SWEEP_GROUP, chunk_limit=int(c["chunk_limit"]),
                     **kw)
            got = (p.num_items, p.num_partials, p.chunk_limit, p.placement)
            want = (c["items"], c["partials"], c["chunk_limit"], c["placement"])
            row.update(path="wrapper", plan=p, merges=np.diff(p.merge_indptr).astype(np.float64))
        if got != want:
            raise SystemExit(f"{w} b{b} {pol}: rebuilt plan {got} does not reproduce the record {want}")
        rows.append(row)
    return rows


def _slots_of(row, overhead, slots):
    """Latency and streaming work of every slot: the wrapper's queues as planned, the
    fixed splits' items in launch order onto the slot free first (the block scheduler)."""
    if row["path"] == "split":
        return _greedy([overhead] * len(row["items"]), row["items"], slots)
    p = row["plan"]
    cta = p.item_cta()
    keys = (p.kv_end - p.kv_start).astype(np.float64)
    return (np.bincount(cta, minlength=slots) * float(overhead),
            np.bincount(cta, weights=keys, minlength=slots).astype(np.float64))


def decode_features(row, overhead, solo, slots=SWEEP_SLOTS, group=SWEEP_GROUP):
    """Regressors of one decode record: the attention pass in KV-token time (items of
    ``overhead`` tokens of latency, the wave speed-up ``solo``), 1 (launch), 1 if the
    step merges (merge launch), its partial slots (merge_total) and the merge pass's
    busiest CTA in partial rows (merge_cost; :func:`nbattn.sched.lpt.merge_span`)."""
    from nbattn.sched.cost import merge_span
    lat, work = _slots_of(row, overhead, slots)
    m = row["merges"]
    span = merge_span(np.full(m.size, float(group)), m, slots, 1.0, 0.0) if m.size else 0.0
    return [_finish(lat, work, slots, solo, True), 1.0, float(m.size > 0), float(m.sum()), float(span)]


def fit_decode_records(rows, overheads=OVERHEAD_GRID, solos=SOLO_SWEEP_GRID):
    """The cost model that fits measured decode records best (grid over the item price
    and ``solo_speedup``, non-negative least squares for the rest, relative errors):
    ``(CostModel, rms, relative errors)``."""
    from nbattn.sched import CostModel
    t = np.array([r["t"] for r in rows])
    best = None
    for solo in solos:
        for ovh in overheads:
            A = np.array([decode_features(r, ovh, solo) for r in rows])
            sol = _nonneg_lstsq(A, t, 1.0 / t)
            e = A @ sol / t - 1
            rms = float(np.sqrt(np.mean(e ** 2)))
            if best is None or rms < best[0] - 1e-12:
                best = (rms, ovh, solo, sol, e)
    rms, ovh, solo, sol, e = best
    model = CostModel(alpha=0.0, beta=float(sol[0]), chunk_overhead=float(ovh * sol[0]), launch=float(sol[1]),
                      merge_launch=float(sol[2]), merge_total=float(sol[3]), merge_cost=float(sol[4]),
                      solo_speedup=float(solo), search="plans", unit="us")
    return model, rms, e


def held_out_errors(rows, overheads=OVERHEAD_GRID, solos=SOLO_SWEEP_GRID):
    """Relative errors of :func:`fit_decode_records` out of sample: each (workload,
    batch) step's records predicted by the model refitted to all the other steps (in
    the order of ``rows``)."""
    models, errs = {}, []
    for r in rows:
        step = (r["workload"], r["batch"])
        if step not in models:
            models[step] = fit_decode_records([x for x in rows if (x["workload"], x["batch"]) != step],
                                              overheads, solos)[0]
        m = models[step]
        A = decode_features(r, m.chunk_overhead / m.beta, m.solo_speedup)
        errs.append(float(np.dot(A, [m.beta, m.launch, m.merge_launch, m.merge_total, m.merge_cost])) / r["t"] - 1)
    return np.array(errs)


def _list_schedule(times, resident):
    """Makespan of jobs started in the given order on ``resident`` slots, each on the
    slot free first (the block scheduler with a grid larger than one wave)."""
    free = [0.0] * resident
    end = 0.0
    for x in times:
        start = heapq.heappop(free)
        end = max(end, start + x)
        heapq.heappush(free, start + x)
    return end


def prefill_span(p, overhead, resident, two_launches, kv_heads=SWEEP_KV_HEADS):
    """Attention time of a prefill-wrapper plan in KV-token units: each planned CTA's
    queue (keys plus ``overhead`` per item) once per KV head, launched CTA-fastest.
    ``resident`` None: the planner's view (every planned CTA at once); else the grid of
    ``num_ctas * kv_heads`` CTAs list-scheduled on that many slots.  ``two_launches``:
    split chunks and unsplit tiles as two passes (the wrapper), else one."""
    from nbattn.sched.plan import DIRECT
    cta = p.item_cta()
    keys = (p.kv_end - p.kv_start).astype(np.float64) + overhead
    split = p.out_slot != DIRECT
    passes = (split, ~split) if two_launches else (np.ones(split.shape, bool),)
    total = 0.0
    for sel in passes:
        queue = np.bincount(cta[sel], weights=keys[sel], minlength=p.num_ctas)
        if resident is None:
            total += float(queue.max())
        else:
            grid = np.tile(queue, kv_heads)
            total += _list_schedule(grid[grid > 0], resident)
    return total


def fit_prefill_records(rows, resident, two_launches, overheads=PREFILL_OVERHEAD_GRID):
    """Best fit of the mixed records to ``launch + rate * prefill_span + [merges] *
    (merge_launch + merge_total * partials)``: dict of rms, errors and the numbers."""
    t = np.array([r["t"] for r in rows])
    best = None
    for ovh in overheads:
        A = np.array([[1.0, prefill_span(r["plan"], ovh, resident, two_launches), float(r["plan"].num_merges > 0),
                       float(r["plan"].num_partials)] for r in rows])
        sol = _nonneg_lstsq(A, t, 1.0 / t)
        e = A @ sol / t - 1
        rms = float(np.sqrt(np.mean(e ** 2)))
        if best is None or rms < best["rms"] - 1e-12:
            best = dict(rms=rms, errors=e, overhead_tokens=ovh, launch_us=sol[0], us_per_token=sol[1],
                        merge_launch_us=sol[2], us_per_partial=sol[3])
    return best


def prefill_model(fit, resident):
    """The planner's :class:`nbattn.sched.CostModel` (microseconds) of a
    :func:`fit_prefill_records` fit made with ``two_launches``: a key costs the
    fitted rate, an item its overhead in keys, any split ``merge_launch`` plus
    ``merge_total`` a partial; no tail speed-up (prefill tiles are compute-bound)."""
    from nbattn.sched import CostModel
    rate = float(fit["us_per_token"])
    return CostModel(alpha=0.0, beta=rate, chunk_overhead=float(fit["overhead_tokens"]) * rate, merge_cost=0.0,
                     merge_launch=float(fit["merge_launch_us"]), merge_total=float(fit["us_per_partial"]),
                     launch=float(fit["launch_us"]), solo_speedup=1.0, ctas_per_sm=int(resident // 132) or 1,
                     sm_count=132, search="plans", unit="us", two_pass=True)


def fit_prefill_model(rows, resident=2 * PREFILL_CTAS, kv_heads=SWEEP_KV_HEADS):
    """Fit the mixed steps' fixed policies (one request per CTA and the fixed splits,
    planned over at most one wave: ``num_ctas * kv_heads <= resident``) as the
    wrapper runs them (two launches) and return ``(fit, CostModel)``; the LPT
    records stay out of the fit, so they can test it."""
    sel = [r for r in rows if r["path"] == "prefill" and not r["policy"].startswith("lpt")
           and r["plan"].num_ctas * kv_heads <= resident]
    if len(sel) < 5:
        raise ValueError(f"{len(sel)} fixed-policy records planned over one wave; the fit takes 5 or more")
    f = fit_prefill_records(sel, resident, True)
    return f, prefill_model(f, resident)


def analyse_sweep(path, fit_path=None, overheads=OVERHEAD_GRID, solos=SOLO_SWEEP_GRID):
    """Print (and return) the analysis of a sweep file (module docstring)."""
    from nbattn.sched import CostModel, plan, simulate_plan
    from nbattn.sched.cost import load_cost_fit
    d = json.loads(Path(path).read_text())
    if fit_path is not None and Path(fit_path).is_file():
        committed = load_cost_fit(fit_path).decode_tc
    else:
        committed = CostModel(**d["cost_model"])
    rows = rebuild_sweep(d, committed)
    print(f"{len(rows)} records of {path} rebuilt; every plan reproduces its recorded counts")
    out = dict(rows=rows, committed=committed)
    for path_name in ("wrapper", "split"):
        sel = [r for r in rows if r["path"] == path_name]
        pred = np.array([simulate_plan(r["plan"], committed).makespan if "plan" in r else r["case"]["predicted_us"]
                         for r in sel])
        err = pred / np.array([r["t"] for r in sel]) - 1
        model, rms, e = fit_decode_records(sel, overheads, solos)
        out[path_name] = dict(model=model, rms=rms, errors=e, committed_errors=err)
        print(f"\n{path_name}: {len(sel)} records; the committed model's error: rms {np.sqrt(np.mean(err ** 2)):.1%}, "
              f"largest {err[np.argmax(np.abs(err))]:+.1%}")
        print(f"  refit: rms {rms:.1%}, largest {e[np.argmax(np.abs(e))]:+.1%}; item {model.chunk_overhead:.2f} us "
              f"({model.chunk_overhead / model.beta:.0f} keys), {model.beta * 1e3:.1f} ns a key, solo speed-up "
              f"{model.solo_speedup:.2f}, launch {model.launch:.1f} us; merge: {model.merge_launch:.1f} us when "
              f"there is one, {model.merge_total:.3f} us a partial, {model.merge_cost * SWEEP_GROUP:.3f} us a "
              f"partial of the busiest merge CTA")
        h = out[path_name]["held_out"] = held_out_errors(sel, overheads, solos)
        print(f"  out of sample (each step predicted by the refit to the other steps): rms "
              f"{np.sqrt(np.mean(h ** 2)):.1%}, largest {h[np.argmax(np.abs(h))]:+.1%}")
    wrapper, split = out["wrapper"]["model"], out["split"]["model"]
    cheap_merge = wrapper.replace(merge_launch=split.merge_launch, merge_total=split.merge_total,
                                  merge_cost=split.merge_cost)
    print("\ndecode steps (us): best fixed policy | LPT measured | plan() now under the committed model (its "
          "prediction, the refit's) | plan() under the wrapper's refit | the same with the fixed splits' merge prices")
    lat = {}
    for r in rows:
        lat.setdefault((r["workload"], r["batch"]), {})[r["policy"]] = r["t"]
    whatif = {}
    for (w, b), t in lat.items():
        if w == "mixed":
            continue
        fixed = {k: v for k, v in t.items() if k == "one_per_cta" or k.startswith("split_")}
        best = min(fixed, key=fixed.get)
        qo, kv = sweep_lengths(w, b)
        kw = dict(tile_q=SWEEP_GROUP, group=SWEEP_GROUP, chunk_limit="auto")
        p_now = plan(qo, kv, SWEEP_SLOTS, cost=committed, **kw)
        p_w = plan(qo, kv, SWEEP_SLOTS, cost=wrapper, **kw)
        p_c = plan(qo, kv, SWEEP_SLOTS, cost=cheap_merge, **kw)
        now_refit = simulate_plan(p_now, wrapper).makespan
        whatif[(w, b)] = dict(best=best, best_us=fixed[best], lpt_us=t.get("lpt"), now=p_now, now_refit=now_refit,
                              refit=p_w, cheap_merge=p_c)
        print(f"  {w:9s} b{b:<4d} {best:11s} {fixed[best]:7.1f} | {t.get('lpt', np.nan):7.1f} "
              f"({t.get('lpt', np.nan) / fixed[best]:.3f}) | L={p_now.chunk_limit:<6d} {p_now.predicted_makespan:7.1f} "
              f"{now_refit:7.1f} | L={p_w.chunk_limit:<6d} {p_w.predicted_makespan:7.1f} "
              f"({p_w.predicted_makespan / fixed[best]:.3f}) | L={p_c.chunk_limit:<6d} partials {p_c.num_partials:3d} "
              f"{p_c.predicted_makespan:7.1f} ({p_c.predicted_makespan / fixed[best]:.3f})")
    out["whatif"] = whatif
    mixed = [r for r in rows if r["path"] == "prefill"]
    out["prefill"] = {}
    if mixed:
        print(f"\nmixed prefill + decode: {len(mixed)} records")
        for resident in (None, PREFILL_CTAS, 2 * PREFILL_CTAS):
            for two in (False, True):
                f = fit_prefill_records(mixed, resident, two)
                out["prefill"][(resident, two)] = f
                view = "planned CTAs at once" if resident is None else f"grid on {resident} slots"
                print(f"  {view:21s} {'two launches' if two else 'one pass    '}: rms {f['rms']:5.1%}, largest "
                      f"{f['errors'][np.argmax(np.abs(f['errors']))]:+.1%}; item {f['overhead_tokens']} keys, "
                      f"launch {f['launch_us']:.1f} us; any split: {f['merge_launch_us']:.1f} us + "
                      f"{f['us_per_partial']:.2f} us a partial")
        try:
            f, model = fit_prefill_model(mixed)
        except ValueError as exc:
            print(f"  no prefill model: {exc}")
            return out
        out["prefill_model"] = model
        print(f"  fixed policies over one wave, two launches: rms {f['rms']:.1%} over {len(f['errors'])} records; "
              f"plan() under that model:")
        from nbattn.sched import plan as lpt_plan
        for b in sorted({r["batch"] for r in mixed}):
            t = {r["policy"]: r["t"] for r in mixed if r["batch"] == b}
            fixed = {k: v for k, v in t.items() if k == "one_per_cta" or k.startswith("split_")}
            best = min(fixed, key=fixed.get)
            qo, kv = sweep_lengths("mixed", b)
            p = lpt_plan(qo, kv, PREFILL_SLOTS, tile_q=PREFILL_TILE, group=SWEEP_GROUP, causal=True,
                         chunk_limit="auto", cost=model)
            print(f"    b{b:<4d} best fixed {best} {fixed[best]:.1f} us | LPT measured {t.get('lpt', np.nan):.1f} | "
                  f"under the fit: L={p.chunk_limit} partials {p.num_partials} predicted {p.predicted_makespan:.1f}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--analyse", metavar="SCHED_JSON", help="rebuild, refit and explain a sched.json")
    ap.add_argument("--fit", metavar="COST_FIT_JSON", default=None,
                    help="the committed fit (default: cost_fit.json beside SCHED_JSON, else its cost_model)")
    args = ap.parse_args(argv)
    if args.analyse:
        d = json.loads(Path(args.analyse).read_text())
        if "item_overhead_fit" in d.get("checks", {}):
            analyse(args.analyse)
        else:
            analyse_sweep(args.analyse, args.fit or Path(args.analyse).parent / "cost_fit.json")
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
