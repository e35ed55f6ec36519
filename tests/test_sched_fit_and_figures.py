"""The cost fit (benchmarks/fit_cost.py) recovers known parameters, and the measured
scheduler figures draw what a result file has and say "not measured" otherwise."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure

from nbattn.perf import results
from nbattn.plots import sched as plots
from nbattn.plots import style
from nbattn.sched import CostModel, plan, simulate_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fit_cost  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _truth(rng):
    return dict(launch=float(rng.uniform(5, 30)), beta=float(rng.uniform(0.02, 0.05)),
                chunk_overhead=float(rng.uniform(0.5, 4)), solo=float(np.round(rng.uniform(1.2, 4.0), 2)),
                merge_launch=float(rng.uniform(1, 10)), merge_cost=float(rng.uniform(0.01, 0.2)),
                merge_total=float(rng.choice([0.0, rng.uniform(0.05, 0.5)])))


def test_fit_recovers_synthetic_parameters():
    rng = np.random.default_rng()
    t = _truth(rng)
    slots = 33
    stream = [(n, k, t["launch"] + t["beta"] * k + t["chunk_overhead"] * n)
              for k in (4096, 16384) for n in (1, 4, 16)]
    solo = [(a, 16384, fit_cost.solo_predict(a, 16384, slots, t["launch"], t["beta"], t["chunk_overhead"],
                                              t["solo"])) for a in (1, 4, 11, 33)]
    # merge probes: plans whose decode part the fitted numbers predict, plus the true merge
    plans = [plan(np.ones(n_req, np.int64), np.full(n_req, parts * 512), slots, tile_q=4, group=4,
                  chunk_limit=512) for n_req, parts in ((1, 2), (1, 8), (1, 32), (slots, 2))]
    true = CostModel(alpha=0.0, beta=t["beta"], chunk_overhead=t["chunk_overhead"], launch=t["launch"],
                     solo_speedup=t["solo"], merge_cost=t["merge_cost"], merge_launch=t["merge_launch"],
                     merge_total=t["merge_total"], search="plans", unit="us")
    measured = [simulate_plan(p, true).makespan for p in plans]

    def merge_of(partial):
        m = CostModel(**partial, merge_cost=0.0, merge_launch=0.0, search="plans", unit="us")
        return [(4 * int(np.diff(p.merge_indptr).max()), p.num_partials, us, simulate_plan(p, m).makespan)
                for p, us in zip(plans, measured)]

    model, resid = fit_cost.fit_decode(stream, solo, merge_of, slots, 2, 132)
    assert model["beta"] == pytest.approx(t["beta"], rel=1e-6)
    assert model["chunk_overhead"] == pytest.approx(t["chunk_overhead"], rel=1e-6)
    assert model["launch"] == pytest.approx(t["launch"], rel=1e-6)
    assert model["solo_speedup"] == pytest.approx(t["solo"], abs=0.026)
    assert model["merge_launch"] == pytest.approx(t["merge_launch"], rel=0.05, abs=0.2)
    assert model["merge_cost"] == pytest.approx(t["merge_cost"], rel=0.05, abs=2e-3)
    assert model["merge_total"] == pytest.approx(t["merge_total"], rel=0.05, abs=2e-3)
    assert max(abs(x) for x in resid["stream"]) < 1e-9
    CostModel(**model)                      # a valid model


def test_nonnegative_least_squares_drops_negative_terms():
    A = np.c_[np.ones(5), np.arange(5.0)]
    b = 10 - 2 * np.arange(5.0)             # the unconstrained slope is -2
    sol = fit_cost._nonneg_lstsq(A, b)
    assert sol[1] == 0 and sol[0] == pytest.approx(b.mean())


def _suite(records):
    return results.parse_suite(dict(suite="sched", gpu="TestGPU", date="2026-01-01", command="x", versions={},
                                    records=records))


def _new_schema_records(rng):
    recs = []
    for batch in (16, 64):
        for w in ("skewed", "constant"):
            times = {p: float(rng.uniform(50, 200)) for p in ("one_per_cta", "split_1024", "lpt")}
            for p, us in times.items():
                recs.append(dict(case=dict(workload=w, batch=batch, policy=p), metric="latency_us", value=us,
                                 unit="us", peers={"sdpa_flash_padded": 300.0}))
                recs.append(dict(case=dict(workload=w, batch=batch, policy=p), metric="bw_fraction",
                                 value=float(rng.uniform(0.1, 1)), unit="", peers={"sdpa_flash_padded": 0.2}))
                recs.append(dict(case=dict(workload=w, batch=batch, policy=p), metric="predicted_us",
                                 value=us * float(rng.uniform(0.8, 1.2)), unit="us", peers={"measured": us}))
    return recs


@pytest.mark.parametrize("make", [plots.measured_utilization, plots.ablation_table, plots.prediction_vs_measured])
def test_measured_figures_draw_the_file_or_say_not_measured(make, tmp_path):
    rng = np.random.default_rng()
    assert style.has_no_data_note(make(None, tmp_path / "none.png"))
    assert style.has_no_data_note(make(_suite([]), tmp_path / "empty.png"))
    fig = make(_suite(_new_schema_records(rng)), tmp_path / "new.png")
    assert isinstance(fig, Figure) and not style.has_no_data_note(fig)
    assert (tmp_path / "new.png").read_bytes()[:4] == b"\x89PNG"


def test_measured_figures_read_the_committed_h200_file(tmp_path):
    suite = results.load_suite("sched", REPO / "benchmarks" / "results")
    fig = plots.measured_utilization(suite, tmp_path / "u.png")
    assert not style.has_no_data_note(fig)
    # bar heights are the file's bw_fraction / tflops values and its SDPA peers, nothing else
    recs = [r for r in suite.records if r.metric in ("bw_fraction", "tflops")]
    peers = {(r.metric, r.case["batch"], r.case["workload"], k): v for r in recs for k, v in r.peers.items()
             if k.startswith("sdpa") and v is not None}
    want = sorted([round(r.value, 6) for r in recs] + [round(v, 6) for v in peers.values()])
    got = sorted(round(p.get_height(), 6) for ax in fig.axes for p in ax.patches if np.isfinite(p.get_height()))
    assert got == want
    tab = plots.ablation_table(suite, tmp_path / "a.png")
    cells = [t.get_text() for ax in tab.axes for t in ax.texts] + [c.get_text().get_text() for ax in tab.axes
                                                                   for tb in ax.tables
                                                                   for c in tb.get_celld().values()]
    lat = {(r.case["workload"], r.case["batch"], r.case["policy"]): r.value for r in suite.records
           if r.metric == "latency_us" and "batch" in r.case}
    for batch in (16, 64, 256):
        ratio = lat[("skewed", batch, "split_1024")] / lat[("skewed", batch, "lpt")]
        assert f"{ratio:.2f}x" in cells
    # the file carries the simulator's predictions: the figure draws them, its title names the worst error
    pred = plots.prediction_vs_measured(suite, tmp_path / "p.png")
    assert not style.has_no_data_note(pred)
    err = [r.value / r.peers["measured"] - 1 for r in suite.records if r.metric == "predicted_us"]
    assert f"{100 * max(abs(e) for e in err):.0f}%" in pred._suptitle.get_text()


def test_prediction_figure_says_not_measured_for_the_2026_11_29_sweep(tmp_path):
    path = REPO / "benchmarks" / "results" / "experiments" / "sched_h200_2026-11-29.json"
    suite = results.parse_suite(json.loads(path.read_text()), path=path)
    assert not style.has_no_data_note(plots.measured_utilization(suite, tmp_path / "u.png"))
    # that sweep has no simulator prediction: the figure says so
    assert style.has_no_data_note(plots.prediction_vs_measured(suite, tmp_path / "p.png"))
