"""Tests of the scheduler simulator, the workload generators and the scheduler plots."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.figure import Figure

from nbattn.plots.sched import gantt, policy_utilization, reduction_map
from nbattn.sched import (
    POLICIES,
    WORKLOADS,
    CostModel,
    SimResult,
    compare_policies,
    make_workload,
    plan,
    simulate,
    simulate_plan,
)

costs = st.builds(
    CostModel,
    alpha=st.sampled_from([0.0, 1.0, 2.0]),
    beta=st.sampled_from([0.5, 1.0]),
    chunk_overhead=st.sampled_from([0.0, 8.0, 32.0]),
    merge_cost=st.sampled_from([0.0, 1.0, 4.0]),
)


def check_schedule(r: SimResult, qo, kv, group, cost: CostModel):
    s = r.schedule
    compute = s.kind == 0
    # Jobs of one CTA never overlap in time.
    for c in range(r.num_ctas):
        mine = np.flatnonzero(s.cta == c)
        order = mine[np.argsort(s.start[mine], kind="stable")]
        assert np.all(s.start[order][1:] >= s.end[order][:-1] - 1e-9)
    # Attention chunks cover every tile's keys exactly once.
    tiles = {}
    for rq, (q, k) in enumerate(zip(qo, kv)):
        for t in range(-(-q * group // r.tile_q)):
            tiles[(rq, t)] = k
    got = {}
    for rq, t, a, b in zip(s.request[compute], s.qo_tile[compute], s.kv_start[compute],
                           s.kv_end[compute]):
        got.setdefault((int(rq), int(t)), []).append((int(a), int(b)))
    assert set(got) == set(tiles)
    for key, chunks in got.items():
        chunks.sort()
        assert chunks[0][0] == 0 and chunks[-1][1] == tiles[key]
        assert all(x[1] == y[0] for x, y in zip(chunks, chunks[1:]))
    # Merges happen after every chunk, one per split tile.
    split = {key for key, chunks in got.items() if len(chunks) > 1}
    merges = list(zip(s.request[~compute].tolist(), s.qo_tile[~compute].tolist()))
    assert sorted(merges) == sorted(split)
    if merges:
        assert s.start[~compute].min() >= s.end[compute].max() - 1e-9
    # Busy time adds up the jobs; makespan and utilization follow from it.
    busy = np.bincount(s.cta, weights=s.end - s.start, minlength=r.num_ctas)
    np.testing.assert_allclose(r.busy, busy, rtol=1e-9, atol=1e-9)
    assert r.makespan == pytest.approx(s.end.max() if s.end.size else 0.0)
    if r.makespan > 0:
        assert r.utilization == pytest.approx(busy.sum() / (r.num_ctas * r.makespan))
    assert 0.0 < r.utilization <= 1.0 + 1e-12
    assert r.makespan >= r.lower_bound - 1e-9
    assert r.num_chunks == int(compute.sum())


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3000)), min_size=1, max_size=12),
    num_ctas=st.integers(1, 40),
    group=st.sampled_from([1, 4]),
    policy=st.sampled_from(POLICIES),
    cost=costs,
    num_splits=st.sampled_from([None, 1, 3, 7]),
)
def test_simulate_invariants(lens, num_ctas, group, policy, cost, num_splits):
    qo = [q for q, _ in lens]
    kv = [k for _, k in lens]
    r = simulate(qo, kv, num_ctas, policy, group=group, cost=cost, num_splits=num_splits)
    assert r.policy == policy
    check_schedule(r, qo, kv, group, cost)


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("seed", [0, 7])
def test_workload_policies_utilization_in_unit_interval(name, seed):
    w = make_workload(name, 64, seed=seed)
    for r in compare_policies([w], 132):
        assert 0.0 < r.utilization <= 1.0
        assert r.makespan >= r.lower_bound
        assert r.makespan_over_bound >= 1.0
        assert r.workload == name
        check_schedule(r, w.qo_lens.tolist(), w.kv_lens.tolist(), w.group, CostModel())


def test_lpt_beats_one_per_cta_on_skewed():
    w = make_workload("skewed", 64)
    res = {r.policy: r for r in compare_policies([w], 132)}
    # One 32k request serialised on one CTA dominates the unsplit schedule.
    assert res["one_per_cta"].makespan >= 32768
    assert res["lpt"].makespan < res["one_per_cta"].makespan / 10
    assert res["lpt"].utilization > 5 * res["one_per_cta"].utilization
    assert res["lpt"].makespan < res["fixed_split"].makespan


def test_lpt_no_worse_than_others_on_paper_workloads():
    for name in WORKLOADS:
        res = {r.policy: r for r in compare_policies([make_workload(name, 64, seed=3)], 132)}
        assert res["lpt"].makespan <= min(res["one_per_cta"].makespan,
                                          res["fixed_split"].makespan), name


def test_one_per_cta_dispatches_in_request_order():
    # 3 CTAs, 5 requests: the first three start at 0; request 3 goes to the CTA
    # that frees first (request 1's), request 4 to the next one (request 2's).
    cost = CostModel(alpha=0, beta=1, chunk_overhead=0, merge_cost=0)
    r = simulate([1] * 5, [50, 10, 20, 5, 5], 3, "one_per_cta", cost=cost)
    s = r.schedule
    assert s.cta.tolist() == [0, 1, 2, 1, 1]
    assert s.start.tolist() == [0, 0, 0, 10, 15]
    assert r.makespan == 50
    assert r.busy.tolist() == [50, 20, 20]
    assert r.utilization == pytest.approx(90 / 150)
    assert r.lower_bound == pytest.approx(90 / 3)


def test_fixed_split_chunks_and_merge_cost():
    cost = CostModel(alpha=0, beta=1, chunk_overhead=2, merge_cost=3)
    r = simulate([1, 1], [10, 2], 8, "fixed_split", cost=cost, num_splits=4)
    s = r.schedule
    compute = s.kind == 0
    # Request 0: 4 chunks of near-equal size; request 1 has only 2 keys -> 2 chunks.
    sizes = sorted((s.kv_end - s.kv_start)[compute & (s.request == 0)].tolist())
    assert sizes == [2, 2, 3, 3]
    assert int((compute & (s.request == 1)).sum()) == 2
    assert r.num_partials == 6
    merge_times = sorted((s.end - s.start)[~compute].tolist())
    assert merge_times == [3 * 1 * 2, 3 * 1 * 4]
    # Default split count fills the grid: ceil(8 / 2 tiles) = 4.
    d = simulate([1, 1], [10, 2], 8, "fixed_split", cost=cost)
    assert d.num_chunks == r.num_chunks


def test_simulate_plan_with_plan_costs_reproduces_plan():
    p = plan([1, 3, 2, 1], [900, 40, 333, 7], 5, 1, group=2, alpha=1.5, beta=1.0)
    r = simulate_plan(p, CostModel(alpha=1.5, beta=1.0, chunk_overhead=0, merge_cost=0))
    np.testing.assert_allclose(r.busy, p.cta_cost)
    assert r.makespan == pytest.approx(p.makespan)
    assert r.chunk_bound == pytest.approx(p.lower_bound)
    assert r.num_partials == p.num_partials


def test_simulate_causal_plan():
    qo, kv = [4, 1, 3], [10, 7, 3]
    p = plan(qo, kv, 3, 2, group=2, causal=True)
    r = simulate_plan(p, CostModel(alpha=p.alpha, beta=p.beta, chunk_overhead=0, merge_cost=0))
    np.testing.assert_allclose(r.busy, p.cta_cost)
    # Bottom-right causal: a tile sees kv - qo + (last position) + 1 keys; the
    # bound sums those keys plus 2 fused rows for each of the 8 tiles.
    visible = {(0, 0): 7, (0, 1): 8, (0, 2): 9, (0, 3): 10, (1, 0): 7, (2, 0): 1, (2, 1): 2,
               (2, 2): 3}
    assert {(int(a), int(b)): int(c) for a, b, c in
            zip(p.request, p.qo_tile, p.kv_end)} == visible
    assert r.lower_bound == pytest.approx((sum(visible.values()) + 2 * 8) / 3)


def test_lpt_policy_passes_overhead_to_planner():
    # The simulator's lpt is the planner with the simulator's own chunk price.
    cost = CostModel(alpha=1, beta=1, chunk_overhead=32, merge_cost=1)
    kv = np.r_[[5000] * 3, [700] * 61]
    r = simulate([1] * 64, kv, 132, "lpt", cost=cost)
    p = plan([1] * 64, kv, 132, 1, alpha=1, beta=1, chunk_overhead=32, chunk_limit="auto")
    assert r.num_chunks == p.num_items > 64
    np.testing.assert_allclose(r.schedule.end[r.schedule.kind == 0].max(), p.makespan)
    np.testing.assert_array_equal(
        np.bincount(r.schedule.cta[r.schedule.kind == 0], minlength=132), np.diff(p.cta_indptr))


def test_unknown_policy_and_workload():
    with pytest.raises(ValueError, match="policy"):
        simulate([1], [10], 4, "round_robin")
    with pytest.raises(ValueError, match="workload"):
        make_workload("bursty")


def test_workload_generators():
    skewed = make_workload("skewed", 64)
    assert sorted(skewed.kv_lens.tolist()) == [512] * 63 + [32768]
    var = make_workload("variable", 1000, seed=5)
    assert var.kv_lens.min() >= 512 and var.kv_lens.max() <= 2048
    assert np.array_equal(var.kv_lens, make_workload("variable", 1000, seed=5).kv_lens)
    assert not np.array_equal(var.kv_lens, make_workload("variable", 1000, seed=6).kv_lens)
    zipf = make_workload("zipf", 2000, seed=1)
    assert zipf.kv_lens.max() <= 32768 and np.median(zipf.kv_lens) < zipf.kv_lens.mean()
    const = make_workload("constant", 8, kv_len=300, qo_len=4, group=2)
    assert const.kv_lens.tolist() == [300] * 8 and const.qo_lens.tolist() == [4] * 8
    assert const.group == 2 and const.batch == 8
    for w in (skewed, var, zipf, const):
        assert w.qo_lens.dtype == np.int32 and w.kv_lens.dtype == np.int32


def test_empty_step():
    r = simulate([0, 0], [5, 7], 4, "lpt")
    assert r.makespan == 0 and r.utilization == 1.0 and r.num_chunks == 0


def test_summary_is_json_ready():
    import json

    r = simulate([1, 1], [100, 2000], 4, "lpt", workload="tiny")
    d = json.loads(json.dumps(r.summary()))
    assert d["policy"] == "lpt" and d["workload"] == "tiny"
    assert d["makespan_over_bound"] == pytest.approx(r.makespan / r.lower_bound)


# --- plots -------------------------------------------------------------------

def test_plots_render(tmp_path):
    p = plan([1, 1, 2, 1, 3], [600, 40, 900, 5, 0], num_ctas=4, group=2)
    assert p.num_partials > 0
    figs = {
        "gantt_plan.png": gantt(p, tmp_path / "gantt_plan.png"),
        "reduction.png": reduction_map(p, tmp_path / "reduction.png"),
    }
    w = make_workload("skewed", 16)
    results = [r for name in WORKLOADS for r in compare_policies([make_workload(name, 16)], 32)]
    figs["gantt_sim.png"] = gantt(results[-1], tmp_path / "gantt_sim.png", title="zipf lpt")
    figs["policies.png"] = policy_utilization(results, tmp_path / "policies.png")
    figs["policies_dicts.png"] = policy_utilization([r.summary() for r in results],
                                                    tmp_path / "policies_dicts.png")
    big = plan(w.qo_lens, w.kv_lens, 32)
    figs["reduction_big.png"] = reduction_map(big, tmp_path / "sub" / "reduction_big.png",
                                              max_outputs=5)
    for name, fig in figs.items():
        assert isinstance(fig, Figure)
        path = tmp_path / name if name != "reduction_big.png" else tmp_path / "sub" / name
        assert path.exists() and path.stat().st_size > 5000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError):
        gantt([1, 2, 3], tmp_path / "bad.png")
