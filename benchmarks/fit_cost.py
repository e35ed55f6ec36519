"""Fit the scheduler's cost model (nbattn.sched.cost) to measured kernel times.

Used by ``benchmarks/gpu_sched.py`` (which measures the probes on the GPU and
calls :func:`fit_decode`), and on its own to re-read a result file::

    PYTHONPATH=$PWD python3 benchmarks/fit_cost.py --analyse benchmarks/results/sched.json

``--analyse`` reconstructs every plan of an old-schema ``sched.json`` (the
H200 table of issue 21: skewed / constant / long-variable, batch 64, C = 33)
from its lengths and recorded plan settings, fits the model under two
hypotheses, and prints each policy's predicted against measured time:

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
    """``points``: (active slots, keys, us).  The grid value of ``solo_speedup`` with the
    smallest squared relative error."""
    pts = np.asarray(points, np.float64)
    best = None
    for solo in SOLO_GRID:
        pred = solo_predict(pts[:, 0], pts[:, 1], slots, launch, beta, overhead, solo)
        err = float(np.mean((pred / pts[:, 2] - 1) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, float(solo), (pred / pts[:, 2] - 1).tolist())
    return dict(solo_speedup=best[1], rel_residuals=best[2])


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
# --analyse: the old-schema sched.json (issue 21's table)
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--analyse", metavar="SCHED_JSON", help="fit an old-schema sched.json and print errors")
    args = ap.parse_args(argv)
    if args.analyse:
        analyse(args.analyse)
        return 0
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
