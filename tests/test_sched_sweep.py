"""The plan search's pieces of the longest tile (nbattn.sched.lpt.piece_counts) and the
sweep analysis of benchmarks/fit_cost.py (--analyse on a gpu_sched.py sweep file).

References are written here independently: plain-Python candidate sets and
placements, a dense search over every chunk limit, a list scheduler over a sorted
list of free times, and models recovered from times the simulator made.
"""
from __future__ import annotations

import bisect
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from nbattn.sched import CostModel, make_workload, plan, simulate, simulate_plan
from nbattn.sched.cost import load_cost_fit
from nbattn.sched.lpt import LPT_ORDER, REQUEST_ORDER, candidate_limits, piece_counts, plan_span, query_tiles

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import fit_cost  # noqa: E402

SWEEP = REPO / "benchmarks" / "results" / "sched.json"
FIT = REPO / "benchmarks" / "results" / "cost_fit.json"
OLD_LIMITS = 11          # the candidates before the pieces: longest, /2, /3, /4, /8, 2L, L, 4096..512


def ceil_div(a, b):
    return -(-a // b)


def reference_pieces(longest, base):
    """k from ceil(T / 2L) to ceil(T / L), each step at least 6/5 of the last."""
    k, hi = max(1, ceil_div(longest, 2 * base)), ceil_div(longest, base)
    out = []
    while k < hi:
        out.append(k)
        k = max(k + 1, ceil_div(6 * k, 5))
    return out + [max(hi, 1)]


def test_piece_counts_match_the_rule_and_stay_few():
    rng = np.random.default_rng()
    for _ in range(3000):
        longest = int(rng.integers(1, 1 << int(rng.integers(1, 31))))
        base = int(rng.integers(1, max(2, 3 * longest)))
        got = piece_counts(longest, base).tolist()
        assert got == reference_pieces(longest, base), (longest, base)
        assert 1 <= len(got) <= 5 and got == sorted(set(got))
        # every piece is at most two base limits long, the last at most one
        pieces = [ceil_div(longest, k) for k in got]
        assert max(pieces) <= 2 * base and pieces[-1] <= base


def _tiles(rng):
    batch = int(rng.integers(1, 40))
    kv = rng.integers(0, 6000, batch)
    kv[0] = int(rng.integers(1, 40000))          # often one long request among short ones
    return np.ones(batch, np.int64), kv.astype(np.int64)


def _model(rng):
    return CostModel(alpha=float(rng.choice([0.0, 1.0])), beta=1.0, chunk_overhead=float(rng.choice([0, 32, 120])),
                     merge_cost=float(rng.choice([0.0, 2.0, 15.0])), merge_launch=float(rng.choice([0.0, 300.0])),
                     merge_total=float(rng.choice([0.0, 5.0])), launch=float(rng.choice([0.0, 100.0])),
                     solo_speedup=float(rng.choice([1.0, 1.45, 2.5])), search="plans")


def _fits(t_kv, limit, slots):
    k = np.maximum(1, -(-t_kv // limit))
    return int(k[k > 1].sum()) <= 2 * slots and int((k > 1).sum()) <= slots


def _best(t_rows, t_kv, limits, slots, m, request_too=()):
    best = np.inf
    for limit in limits:
        if not _fits(t_kv, int(limit), slots):
            continue
        for mode in (LPT_ORDER, REQUEST_ORDER) if int(limit) in request_too else (LPT_ORDER,):
            best = min(best, plan_span(t_rows, t_kv, int(limit), mode, slots, *m.params()))
    return best


def test_search_never_predicts_worse_than_before_and_nears_the_dense_optimum():
    rng = np.random.default_rng()
    gaps = []
    for _ in range(60):
        qo, kv = _tiles(rng)
        slots, m = int(rng.integers(2, 40)), _model(rng)
        p = plan(qo, kv, slots, tile_q=4, group=4, cost=m, chunk_limit="auto")
        _, _, t_rows, t_kv = query_tiles(qo, kv, 4, 4, False)
        base = max(1, ceil_div(int(t_kv.sum()), slots))
        limits = candidate_limits(t_kv, base)
        longest = int(t_kv.max())
        fixed = {longest, 512, 1024, 2048, 4096}
        old = [x for x in limits if x in {min(max(y, 1), longest) for y in (
            longest, ceil_div(longest, 2), ceil_div(longest, 3), ceil_div(longest, 4), ceil_div(longest, 8),
            2 * base, base, 4096, 2048, 1024, 512)}]
        assert len(old) <= OLD_LIMITS
        before = _best(t_rows, t_kv, old, slots, m, fixed)
        assert p.predicted_makespan <= before * (1 + 1e-12)
        assert p.predicted_makespan == pytest.approx(_best(t_rows, t_kv, limits, slots, m, fixed), rel=1e-12)
        dense = _best(t_rows, t_kv, range(1, longest + 1, max(1, longest // 400)), slots, m)
        gaps.append(p.predicted_makespan / min(dense, p.predicted_makespan) - 1)
    # a dense search over every limit finds little that the candidates miss
    assert np.median(gaps) < 0.02, sorted(gaps)[-5:]


# The H200 fit of 2026-12-04 (decode tensor-core path), pinned here so that the test does
# not move when benchmarks/results/cost_fit.json is measured again on another GPU.
H200_FIT = CostModel(alpha=0.0, beta=0.03182420082508675, chunk_overhead=3.6853419537849654,
                     merge_cost=0.14048800234017642, merge_launch=1.5326961789533906,
                     merge_total=0.24445724799766178, launch=9.602557787462038, solo_speedup=1.45,
                     ctas_per_sm=2, sm_count=132, search="plans", unit="us")


def _old_best(qo, kv, m):
    _, _, t_rows, t_kv = query_tiles(qo, kv, 4, 4, False)
    base = max(1, ceil_div(int(t_kv.sum()), 33))
    longest = int(t_kv.max())
    old = sorted({min(max(y, 1), longest) for y in (longest, ceil_div(longest, 2), ceil_div(longest, 3),
                  ceil_div(longest, 4), ceil_div(longest, 8), 2 * base, base, 4096, 2048, 1024, 512)})
    return _best(t_rows, t_kv, old, 33, m, {longest, 512, 1024, 2048, 4096})


def test_search_on_the_committed_fit_never_predicts_worse():
    """Whatever GPU the committed fit came from, the search keeps the old candidates' best."""
    m = load_cost_fit(FIT).decode_tc
    for name in ("skewed", "constant", "uniform", "zipf", "mixed"):
        for batch in (16, 64, 256):
            qo, kv = fit_cost.sweep_lengths(name, batch)
            p = plan(qo, kv, 33, tile_q=4, group=4, cost=m, chunk_limit="auto")
            assert p.predicted_makespan <= _old_best(qo, kv, m) * (1 + 1e-12), (name, batch)


def test_search_on_the_sweeps_decode_steps():
    """Under the H200 fit the pieces shorten the skewed steps' plans and leave the steps
    without a long request as they were."""
    m = H200_FIT
    for name, batch in (("skewed", 16), ("skewed", 64), ("constant", 64), ("uniform", 16), ("zipf", 256)):
        qo, kv = fit_cost.sweep_lengths(name, batch)
        p = plan(qo, kv, 33, tile_q=4, group=4, cost=m, chunk_limit="auto")
        before = _old_best(qo, kv, m)
        if name == "skewed" and batch < 256:
            assert p.predicted_makespan < 0.97 * before, (name, batch)
        else:
            assert p.predicted_makespan == pytest.approx(before, rel=1e-12), (name, batch)


# ---------------------------------------------------------------------------
# benchmarks/fit_cost.py: the sweep analysis
# ---------------------------------------------------------------------------

def test_every_record_of_the_committed_sweep_rebuilds():
    d = json.loads(SWEEP.read_text())
    rows = fit_cost.rebuild_sweep(d, load_cost_fit(FIT).decode_tc)
    paths = [r["path"] for r in rows]
    assert len(rows) == sum(1 for r in d["records"] if r["metric"] == "latency_us" and "batch" in r["case"])
    assert paths.count("wrapper") == 36 and paths.count("split") == 60 and paths.count("prefill") == 19


def test_prefill_fit_recovers_the_two_launch_model():
    """Times made by a two-launch model (fresh random prices) for the mixed steps' fixed
    policies: fit_prefill_model finds the prices again, and the CostModel it returns
    prices every plan as those times (the planner's and the simulator's view)."""
    rng = np.random.default_rng()
    rate = float(rng.uniform(0.03, 0.06))
    ovh = int(rng.choice(fit_cost.PREFILL_OVERHEAD_GRID))
    launch, m_launch, m_part = float(rng.uniform(20, 60)), float(rng.uniform(10, 100)), float(rng.uniform(0, 0.3))
    rows = []
    for b in (16, 64):
        qo, kv = fit_cost.sweep_lengths("mixed", b)
        for limit in (int(kv.max()), 4096, 2048):
            p = plan(qo, kv, fit_cost.PREFILL_SLOTS, tile_q=fit_cost.PREFILL_TILE, group=fit_cost.SWEEP_GROUP,
                     causal=True, chunk_limit=limit)
            t = launch + rate * fit_cost.prefill_span(p, ovh, None, True)
            if p.num_merges:
                t += m_launch + m_part * p.num_partials
            rows.append(dict(path="prefill", policy="one_per_cta" if limit == int(kv.max()) else f"split_{limit}",
                             batch=b, plan=p, t=t))
    assert sum(r["plan"].num_merges > 0 for r in rows) >= 2
    f, model = fit_cost.fit_prefill_model(rows)
    assert f["rms"] < 1e-9 and f["overhead_tokens"] == ovh
    assert model.two_pass and model.beta == pytest.approx(rate, rel=1e-6)
    assert model.launch == pytest.approx(launch, rel=1e-6) and model.merge_launch == pytest.approx(m_launch, rel=1e-6)
    for r in rows:
        assert simulate_plan(r["plan"], model).makespan == pytest.approx(r["t"], rel=1e-9)


def test_split_items_are_flashdecodings_chunks():
    rng = np.random.default_rng()
    kv = rng.integers(0, 9000, int(rng.integers(1, 30)))
    chunk = int(rng.choice([512, 1000, 4096]))
    items, merges = fit_cost.split_items(kv, chunk)
    want, parts = [], []
    for n in kv:
        pieces = [min(chunk, n - a) for a in range(0, int(n), chunk)] or [0]
        want += pieces
        if len(pieces) > 1:
            parts.append(len(pieces))
    assert items.tolist() == want and merges.tolist() == parts
    assert fit_cost.split_items(kv, None)[0].tolist() == kv.tolist()


@pytest.mark.parametrize("path", ["wrapper", "split"])
def test_decode_refit_recovers_the_model_that_made_the_times(path):
    rng = np.random.default_rng()
    tokens, solo = int(rng.choice([0, 16, 48])), float(rng.choice([1.0, 1.25, 1.5]))
    # beta a multiple of 2**-10: every chunk time is then exact in both units (us and
    # tokens), so CTAs of equal load tie in the simulator's schedule as in the fit's
    beta = int(rng.integers(20, 52)) / 1024
    truth = CostModel(alpha=0.0, beta=beta, chunk_overhead=tokens * beta, launch=float(rng.uniform(2, 20)),
                      merge_launch=float(rng.uniform(1, 20)), merge_total=float(rng.uniform(0.05, 0.5)),
                      merge_cost=float(rng.uniform(0.01, 0.2)), solo_speedup=solo, search="plans", unit="us")
    rows = []
    for k in range(14):
        w = make_workload(("skewed", "variable", "zipf", "constant")[k % 4], int(rng.integers(4, 60)),
                          seed=int(rng.integers(1 << 30)), kv_len=int(rng.integers(300, 5000)), high=6000)
        kv = np.asarray(w.kv_lens, np.int64)
        qo = np.ones(kv.size, np.int64)
        chunk = int(rng.choice([256, 512, 1024, 2048])) if k % 5 else None
        if path == "wrapper":
            p = plan(qo, kv, 33, tile_q=4, group=4, chunk_overhead=0.0, chunk_limit=chunk or int(kv.max()))
            rows.append(dict(path="wrapper", plan=p, merges=np.diff(p.merge_indptr).astype(float),
                             t=simulate_plan(p, truth).makespan, workload=w.name, batch=k))
        else:
            items, merges = fit_cost.split_items(kv, chunk)
            sim = simulate(qo, kv, 33, "fixed_split" if chunk else "one_per_cta", group=4, tile_q=4, cost=truth,
                           **(dict(chunk_size=chunk) if chunk else {}))
            rows.append(dict(path="split", items=items, merges=merges, t=sim.makespan, workload=w.name, batch=k))
    model, rms, _ = fit_cost.fit_decode_records(rows, overheads=(0, 16, 48), solos=(1.0, 1.25, 1.5))
    assert rms < 1e-6
    assert model.solo_speedup == solo and model.beta == pytest.approx(beta, rel=1e-6)
    assert model.chunk_overhead == pytest.approx(truth.chunk_overhead, abs=1e-6)
    assert model.launch == pytest.approx(truth.launch, rel=1e-4)
    for f in ("merge_launch", "merge_total", "merge_cost"):
        assert getattr(model, f) == pytest.approx(getattr(truth, f), rel=1e-4, abs=1e-6), f
    # out of sample: every record predicted from the others; then one record measured
    # 20% slow is predicted from the others, which are the truth
    grids = dict(overheads=(0, 16, 48), solos=(1.0, 1.25, 1.5))
    assert fit_cost.held_out_errors(rows, **grids) == pytest.approx(np.zeros(len(rows)), abs=1e-6)
    odd = int(rng.integers(len(rows)))
    rows[odd] = dict(rows[odd], t=rows[odd]["t"] * 1.2)
    assert fit_cost.held_out_errors(rows, **grids)[odd] == pytest.approx(1 / 1.2 - 1, abs=1e-6)


def _list_schedule_reference(times, resident):
    free = [0.0] * resident                     # kept sorted: a job takes the first free slot
    end = 0.0
    for x in times:
        start = free.pop(0)
        end = max(end, start + x)
        bisect.insort(free, start + x)
    return end


def test_prefill_span_against_plain_schedules():
    rng = np.random.default_rng()
    for _ in range(20):
        batch = int(rng.integers(1, 24))
        qo = rng.choice([1, 1, 1, 64, 256], batch)
        kv = qo + rng.integers(0, 5000, batch)
        ctas, heads = int(rng.integers(2, 40)), int(rng.integers(1, 9))
        p = plan(qo, kv, ctas, tile_q=64, group=4, causal=True, chunk_limit="auto")
        ovh = float(rng.choice([0.0, 64.0]))
        keys = (p.kv_end - p.kv_start) + ovh
        cta = p.item_cta()
        queue = np.bincount(cta, weights=keys, minlength=ctas)
        assert fit_cost.prefill_span(p, ovh, None, False, heads) == pytest.approx(queue.max())
        # with every CTA resident the grid runs as the planner sees it
        assert fit_cost.prefill_span(p, ovh, ctas * heads, False, heads) == pytest.approx(queue.max())
        resident = int(rng.integers(1, ctas * heads + 1))
        split = p.out_slot != -1
        want = 0.0
        for sel in (split, ~split):
            q = np.tile(np.bincount(cta[sel], weights=keys[sel], minlength=ctas), heads)
            want += _list_schedule_reference(q[q > 0].tolist(), resident)
        assert fit_cost.prefill_span(p, ovh, resident, True, heads) == pytest.approx(want)
        if p.num_partials == 0:
            assert fit_cost.prefill_span(p, ovh, resident, True, heads) == \
                pytest.approx(fit_cost.prefill_span(p, ovh, resident, False, heads))
