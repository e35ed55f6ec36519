"""Tests of the LPT planner and the tile heuristic (docs/concepts/scheduler.md)."""
from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from nbattn.sched import (
    DIRECT,
    Plan,
    check_partial_capacity,
    choose_tile_kv,
    choose_tile_q,
    choose_tiles,
    partial_buffer_bound,
    plan,
    plan_from_indptr,
    plan_lengths,
    resident_ctas,
    smem_bytes,
)

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def batches(draw, max_batch=10, max_qo=40, max_kv=400):
    batch = draw(st.integers(0, max_batch))
    qo = draw(st.lists(st.integers(0, max_qo), min_size=batch, max_size=batch))
    kv = draw(st.lists(st.integers(0, max_kv), min_size=batch, max_size=batch))
    return qo, kv


plan_args = dict(
    num_ctas=st.integers(1, 24),
    tile_q=st.sampled_from([None, 1, 2, 3, 16, 32, 64, 128]),
    group=st.sampled_from([1, 2, 4, 8]),
    alpha=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    beta=st.sampled_from([0.25, 1.0, 2.0]),
)


def expected_tiles(qo, kv, group, tile_q):
    """(request, tile) -> (fused rows, kv length) for every query tile."""
    tiles = {}
    for r, (q, k) in enumerate(zip(qo, kv)):
        rows = q * group
        for t in range(-(-rows // tile_q)):
            tiles[(r, t)] = (min(tile_q, rows - t * tile_q), k)
    return tiles


def reference_lpt(qo, kv, group, tile_q, num_ctas, alpha, beta, overhead=0.0, limit=None):
    """The LPT algorithm written plainly with Python objects
    (``limit``: force a chunk limit instead of the base rule's ceil(W/C))."""
    tiles = expected_tiles(qo, kv, group, tile_q)
    work = sum(k for _, k in tiles.values())
    if limit is None:
        limit = max(1, -(-work // num_ctas))
    chunks = []
    for (r, t), (rows, k) in sorted(tiles.items()):
        n = max(1, -(-k // limit))
        for c in range(n):
            start, end = c * limit, min((c + 1) * limit, k)
            chunks.append((overhead + alpha * rows + beta * (end - start), r, t, c, start, end))
    chunks.sort(key=lambda ch: (-ch[0], ch[1], ch[2], ch[3]))
    heap = [(0.0, c) for c in range(num_ctas)]
    queues = [[] for _ in range(num_ctas)]
    for cost, r, t, _, start, end in chunks:
        load, c = heapq.heappop(heap)
        queues[c].append((r, t, start, end))
        heapq.heappush(heap, (load + cost, c))
    makespan = max(load for load, _ in heap)
    return limit, queues, makespan


def reference_auto_limit(qo, kv, group, tile_q, num_ctas, alpha, beta, overhead):
    """chunk_limit="auto" written plainly: the base rule's limit, no split, and the longest
    tile cut in 2..4, judged by LPT makespan; ties go to the larger limit."""
    spec, _, _ = reference_lpt(qo, kv, group, tile_q, num_ctas, alpha, beta, overhead)
    longest = max([k for _, k in expected_tiles(qo, kv, group, tile_q).values()], default=0)
    cands = sorted({-(-longest // n) for n in range(1, 5)} - {spec}, reverse=True)
    cands = [c for c in cands if c > spec] + [spec]
    spans = [reference_lpt(qo, kv, group, tile_q, num_ctas, alpha, beta, overhead, c)[2]
             for c in cands]
    return cands[int(np.argmin(spans))], min(spans)


def items_of(p: Plan):
    return list(zip(p.request.tolist(), p.qo_tile.tolist(), p.kv_start.tolist(),
                    p.kv_end.tolist(), p.out_slot.tolist()))


def check_plan_invariants(p: Plan, qo, kv, group):
    n = p.num_items
    # CSR over CTAs.
    assert p.cta_indptr.dtype == np.int32 and p.cta_indptr.shape == (p.num_ctas + 1,)
    assert p.cta_indptr[0] == 0 and p.cta_indptr[-1] == n
    assert np.all(np.diff(p.cta_indptr) >= 0)
    for name in ("request", "qo_tile", "kv_start", "kv_end", "out_slot", "merge_indptr",
                 "merge_request", "merge_qo_tile", "merge_slots"):
        assert getattr(p, name).dtype == np.int32, name

    # Every KV token of every (request, fused-row tile) is covered exactly once.
    tiles = expected_tiles(qo, kv, group, p.tile_q)
    by_tile = {}
    for r, t, s, e, slot in items_of(p):
        assert (r, t) in tiles, f"item for a tile that does not exist: {(r, t)}"
        assert 0 <= s <= e
        assert e - s <= p.chunk_limit
        by_tile.setdefault((r, t), []).append((s, e, slot))
    assert set(by_tile) == set(tiles)
    for key, chunks in by_tile.items():
        k = tiles[key][1]
        chunks.sort()
        if k == 0:
            # A tile with no keys still gets one item that writes the empty state.
            assert chunks == [(0, 0, DIRECT)]
            continue
        assert all(e > s for s, e, _ in chunks), "non-empty tiles have no empty chunks"
        assert chunks[0][0] == 0 and chunks[-1][1] == k
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        if len(chunks) == 1:
            assert chunks[0][2] == DIRECT
        else:
            assert all(slot >= 0 for _, _, slot in chunks)

    # Partial slots: each used exactly once; the reduction map lists exactly the
    # split tiles, once each, with their slots in kv_start order.
    slots = p.out_slot[p.out_slot != DIRECT]
    assert sorted(slots.tolist()) == list(range(p.num_partials))
    assert p.merge_indptr[0] == 0 and p.merge_indptr[-1] == p.num_partials
    assert np.all(np.diff(p.merge_indptr) >= 2)
    split = {key for key, chunks in by_tile.items() if len(chunks) > 1}
    merged = list(zip(p.merge_request.tolist(), p.merge_qo_tile.tolist()))
    assert len(merged) == len(set(merged)) and set(merged) == split
    slot_start = {slot: s for r, t, s, e, slot in items_of(p) if slot != DIRECT}
    slot_tile = {slot: (r, t) for r, t, s, e, slot in items_of(p) if slot != DIRECT}
    for m, key in enumerate(merged):
        listed = p.merge_slots[p.merge_indptr[m]:p.merge_indptr[m + 1]].tolist()
        assert all(slot_tile[s] == key for s in listed)
        assert [slot_start[s] for s in listed] == sorted(slot_start[s] for s in listed)
        assert len(listed) == len(by_tile[key])
    # Paper App. D.3: at most 2*C partial slots.
    assert p.num_partials <= 2 * p.num_ctas

    # Costs, makespan and the lower bound.
    cost = p.item_cost()
    per_cta = np.bincount(p.item_cta(), weights=cost, minlength=p.num_ctas)
    np.testing.assert_allclose(p.cta_cost, per_cta, rtol=1e-12, atol=1e-9)
    assert p.makespan == pytest.approx(per_cta.max() if p.num_ctas else 0.0)
    bound = max(cost.sum() / p.num_ctas, cost.max()) if n else 0.0
    assert p.lower_bound == pytest.approx(bound)
    assert p.makespan >= p.lower_bound - 1e-9


@SETTINGS
@given(lens=batches(), **plan_args)
def test_plan_invariants(lens, num_ctas, tile_q, group, alpha, beta):
    qo, kv = lens
    p = plan(qo, kv, num_ctas, tile_q, group=group, alpha=alpha, beta=beta)
    expected_tile_q = choose_tile_q(qo, group) if tile_q is None else tile_q
    assert p.tile_q == expected_tile_q
    work = sum(-(-q * group // p.tile_q) * k for q, k in zip(qo, kv))
    assert p.chunk_limit == max(1, -(-work // num_ctas))
    check_plan_invariants(p, qo, kv, group)


@SETTINGS
@given(lens=batches(), **plan_args)
def test_plan_matches_plain_python_lpt(lens, num_ctas, tile_q, group, alpha, beta):
    # An independent, slow transcription of the LPT algorithm must give the very
    # same queues, including every tie-break.
    qo, kv = lens
    p = plan(qo, kv, num_ctas, tile_q, group=group, alpha=alpha, beta=beta)
    limit, queues, _ = reference_lpt(qo, kv, group, p.tile_q, num_ctas, alpha, beta)
    assert p.chunk_limit == limit
    got = [[item[:4] for item in items_of(p)[p.cta_indptr[c]:p.cta_indptr[c + 1]]]
           for c in range(num_ctas)]
    assert got == queues


@SETTINGS
@given(lens=batches(), **plan_args)
def test_plan_is_deterministic(lens, num_ctas, tile_q, group, alpha, beta):
    qo, kv = lens
    a = plan(qo, kv, num_ctas, tile_q, group=group, alpha=alpha, beta=beta)
    b = plan(np.array(qo, dtype=np.int32), np.array(kv, dtype=np.int64), num_ctas, tile_q,
             group=group, alpha=alpha, beta=beta)
    for name in ("cta_indptr", "request", "qo_tile", "kv_start", "kv_end", "out_slot",
                 "merge_indptr", "merge_request", "merge_qo_tile", "merge_slots", "cta_cost"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.makespan, a.lower_bound, a.num_partials) == (b.makespan, b.lower_bound,
                                                           b.num_partials)


@SETTINGS
@given(lens=batches(), overhead=st.sampled_from([0.0, 50.0]), limit=st.sampled_from([None, "auto", 7]),
       **plan_args)
def test_plan_lengths_is_plan_without_the_array_checks(lens, overhead, limit, num_ctas, tile_q, group, alpha,
                                                       beta):
    # The wrappers' entry: checked int64 lengths in, the very plan plan() makes out.
    qo, kv = lens
    kw = dict(group=group, alpha=alpha, beta=beta, chunk_overhead=overhead, chunk_limit=limit)
    a = plan(qo, kv, num_ctas, tile_q, **kw)
    b = plan_lengths(np.array(qo, np.int64), np.array(kv, np.int64), num_ctas, tile_q, **kw)
    for name in ("qo_lens", "kv_lens", "cta_indptr", "request", "qo_tile", "kv_start", "kv_end", "out_slot",
                 "merge_indptr", "merge_request", "merge_qo_tile", "merge_slots", "cta_cost"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y) and not y.flags.writeable, name
    assert (a.chunk_limit, a.tile_q, a.makespan, a.num_partials) == (b.chunk_limit, b.tile_q, b.makespan,
                                                                     b.num_partials)
    with pytest.raises(ValueError, match="num_ctas"):        # its scalar arguments are still checked
        plan_lengths(np.array(qo, np.int64), np.array(kv, np.int64), 0, tile_q, **kw)


@settings(max_examples=400, deadline=None)
@given(lens=batches(max_kv=3000), overhead=st.sampled_from([0.0, 4.0, 50.0]), **plan_args)
# a candidate's largest chunk must pair each tile's rows with that tile's keys
@example(lens=([1, 0, 2], [625, 0, 125]), overhead=50.0, num_ctas=7, tile_q=None, group=4, alpha=1.0,
         beta=1.0)
def test_auto_chunk_limit_matches_plain_python(lens, overhead, num_ctas, tile_q, group, alpha, beta):
    # The candidate search, re-done by hand, picks the same limit and the same
    # queues; the plan keeps every invariant (2*C partial bound included, since
    # no candidate is below the base limit) and is never worse under its own cost
    # than the base limit or no split.
    qo, kv = lens
    p = plan(qo, kv, num_ctas, tile_q, group=group, alpha=alpha, beta=beta,
             chunk_overhead=overhead, chunk_limit="auto")
    limit, span = reference_auto_limit(qo, kv, group, p.tile_q, num_ctas, alpha, beta, overhead)
    assert p.chunk_limit == limit
    _, queues, _ = reference_lpt(qo, kv, group, p.tile_q, num_ctas, alpha, beta, overhead, limit)
    got = [[item[:4] for item in items_of(p)[p.cta_indptr[c]:p.cta_indptr[c + 1]]]
           for c in range(num_ctas)]
    assert got == queues
    check_plan_invariants(p, qo, kv, group)
    assert p.makespan == pytest.approx(span)
    spec = plan(qo, kv, num_ctas, tile_q, group=group, alpha=alpha, beta=beta, chunk_overhead=overhead)
    assert p.makespan <= spec.makespan + 1e-9
    assert p.chunk_limit >= spec.chunk_limit


def test_auto_chunk_limit_on_the_benchmark_shapes():
    # 64 x 4096 keys on 66 CTAs: the base rule's limit (3972) leaves 124-key tails that two
    # CTAs run 32 at a time; with a per-item price the search keeps requests whole.
    const = [4096] * 64
    spec = plan([1] * 64, const, 66, 4, group=4, chunk_overhead=50)
    assert spec.chunk_limit == 3972 and spec.num_partials == 128
    auto = plan([1] * 64, const, 66, 4, group=4, chunk_overhead=50, chunk_limit="auto")
    assert auto.chunk_limit == 4096 and auto.num_partials == 0 and auto.makespan < spec.makespan
    # Without the price the base rule's limit is already the best LPT can do here.
    assert plan([1] * 64, const, 66, 4, group=4, chunk_limit="auto").chunk_limit == 3972
    # Skewed (1 x 32k + 63 x 512): the long request must still be cut.
    skew = [32768] + [512] * 63
    auto = plan([1] * 64, skew, 66, 4, group=4, chunk_overhead=50, chunk_limit="auto")
    assert auto.chunk_limit == plan([1] * 64, skew, 66, 4, group=4).chunk_limit == 986
    assert auto.makespan < 1.1 * auto.lower_bound


def test_forced_chunk_limit_and_bad_values():
    p = plan([1, 1], [250, 30], 4, 1, chunk_limit=100)
    assert p.chunk_limit == 100
    assert sorted(zip(p.request.tolist(), p.kv_start.tolist(), p.kv_end.tolist())) == [
        (0, 0, 100), (0, 100, 200), (0, 200, 250), (1, 0, 30)]
    for bad in (0, -3, 2.5, "spec"):
        with pytest.raises(ValueError, match="chunk_limit"):
            plan([1], [10], 2, 1, chunk_limit=bad)
    with pytest.raises(ValueError, match="chunk_overhead"):
        plan([1], [10], 2, 1, chunk_overhead=-1)
    # The overhead is part of every item's cost.
    p = plan([1, 1], [10, 20], 1, 1, chunk_overhead=7)
    np.testing.assert_allclose(sorted(p.item_cost()), [7 + 1 + 10, 7 + 1 + 20])


def brute_force_makespan(costs, num_ctas):
    """Optimal makespan of placing ``costs`` on ``num_ctas`` machines, by enumeration."""
    costs = np.asarray(costs, dtype=np.float64)
    # Chunk 0 may be pinned to machine 0: machines are interchangeable.
    rest = np.array(list(itertools.product(range(num_ctas), repeat=len(costs) - 1)))
    assign = np.concatenate([np.zeros((len(rest), 1), dtype=int), rest], axis=1)
    loads = np.stack([(assign == c) @ costs for c in range(num_ctas)], axis=1)
    return loads.max(axis=1).min()


@settings(max_examples=120, deadline=None)
@given(
    kv=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    qo=st.lists(st.integers(1, 2), min_size=4, max_size=4),
    num_ctas=st.integers(2, 3),
    alpha=st.sampled_from([0.0, 1.0, 5.0]),
)
def test_lpt_within_four_thirds_of_optimal(kv, qo, num_ctas, alpha):
    qo = qo[:len(kv)]
    p = plan(qo, kv, num_ctas, 1, alpha=alpha)
    assume(2 <= p.num_items <= 9)
    best = brute_force_makespan(p.item_cost(), num_ctas)
    assert p.makespan >= best - 1e-9
    # Graham: LPT <= (4/3 - 1/(3C)) * OPT.
    assert p.makespan <= (4 / 3 - 1 / (3 * num_ctas)) * best + 1e-9


def test_brute_force_helper_finds_known_optimum():
    # {3,3,2,2,2} on 2 machines: LPT gives 7, the optimum is 6.
    assert brute_force_makespan([3, 3, 2, 2, 2], 2) == 6


def test_lpt_tie_break_lowest_cta_and_stable_order():
    # Four equal chunks on four CTAs: item order (request) maps to CTA order.
    p = plan([1, 1, 1, 1], [10, 10, 10, 10], num_ctas=4, tile_q=1)
    assert p.cta_indptr.tolist() == [0, 1, 2, 3, 4]
    assert p.request.tolist() == [0, 1, 2, 3]
    # Longest first: the long request lands on CTA 0 alone.
    p = plan([1, 1, 1], [5, 40, 5], num_ctas=2, tile_q=1)
    assert p.chunk_limit == 25
    first = p.request[p.cta_indptr[0]:p.cta_indptr[1]].tolist()
    assert first[0] == 1


@settings(max_examples=100, deadline=None)
@given(batches(max_kv=300), st.integers(1, 16), st.sampled_from([1, 2, 4]),
       st.sampled_from([1, 4, 16]))
def test_causal_plan_covers_visible_keys(lens, num_ctas, group, tile_q):
    qo, kv = lens
    kv = [max(k, q) for q, k in zip(qo, kv)]
    p = plan(qo, kv, num_ctas, tile_q, group=group, causal=True)
    by_tile = {}
    for r, t, s, e, _ in items_of(p):
        by_tile.setdefault((r, t), []).append((s, e))
    tiles = expected_tiles(qo, kv, group, tile_q)
    assert set(by_tile) == set(tiles)
    work = 0
    for (r, t), (rows, k) in tiles.items():
        start, end = p.tile_rows(r, t)
        # Bottom-right causal: the tile's last row (position (end-1)//group)
        # sees keys [0, k - l_qo + position + 1); the tile needs exactly those.
        visible = k - qo[r] + (end - 1) // group + 1 if k else 0
        chunks = sorted(by_tile[(r, t)])
        assert chunks[0][0] == 0 and chunks[-1][1] == visible
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        work += visible
    assert p.chunk_limit == max(1, -(-work // num_ctas))


def test_causal_rejects_more_queries_than_keys():
    with pytest.raises(ValueError, match="causal"):
        plan([5], [3], 4, causal=True)


def test_empty_requests():
    # Request 0: no queries (no work). Request 1: queries but no keys: one empty
    # item per tile, writing the final (empty) state directly.
    p = plan([0, 3, 2], [100, 0, 7], num_ctas=1, tile_q=2)
    items = sorted(items_of(p))
    assert items == [(1, 0, 0, 0, DIRECT), (1, 1, 0, 0, DIRECT), (2, 0, 0, 7, DIRECT)]
    assert sorted(p.item_cost().tolist()) == [1.0, 2.0, 9.0]  # alpha*l_q + beta*l_kv
    empty = plan([], [], num_ctas=4)
    assert empty.num_items == 0 and empty.makespan == 0.0 and empty.lower_bound == 0.0
    assert empty.cta_indptr.tolist() == [0] * 5
    none = plan([0, 0], [5, 9], num_ctas=2)
    assert none.num_items == 0 and none.num_partials == 0


def test_gqa_fused_rows():
    # l_qo = 3, group = 4: 12 fused rows, tiles of 5 rows -> rows [0,5) [5,10) [10,12).
    p = plan([3], [10], num_ctas=1, tile_q=5, group=4)
    assert sorted(set(p.qo_tile.tolist())) == [0, 1, 2]
    assert [p.tile_rows(0, t) for t in range(3)] == [(0, 5), (5, 10), (10, 12)]
    assert sorted(p.item_rows().tolist()) == [2, 5, 5]
    # Default tile: mean(l_qo * group) = 12 -> 16.
    assert plan([3], [10], num_ctas=1, group=4).tile_q == 16


def test_spec_worked_example_from_indptr():
    qo_indptr = np.array([0, 3, 4, 8], np.int32)
    kv_indptr = np.array([0, 2, 3, 6], np.int32)
    last = np.array([2, 2, 1], np.int32)
    p = plan_from_indptr(qo_indptr, kv_indptr, last, 4, num_ctas=2, tile_q=2)
    assert p.qo_lens.tolist() == [3, 1, 4] and p.kv_lens.tolist() == [6, 2, 9]
    check_plan_invariants(p, [3, 1, 4], [6, 2, 9], 1)
    q = plan([3, 1, 4], [6, 2, 9], 2, 2)
    assert np.array_equal(p.request, q.request) and np.array_equal(p.kv_end, q.kv_end)
    with pytest.raises(ValueError, match="last_page_len"):
        plan_from_indptr(qo_indptr, kv_indptr, np.array([2, 0, 1], np.int32), 4, num_ctas=2)
    with pytest.raises(ValueError, match="int32"):
        plan_from_indptr(qo_indptr.astype(np.float32), kv_indptr, last, 4, num_ctas=2)
    p64 = plan_from_indptr(qo_indptr.astype(np.int64), kv_indptr.astype(np.int64), last, 4,
                           num_ctas=2, tile_q=2)
    assert np.array_equal(p64.request, p.request) and np.array_equal(p64.kv_end, p.kv_end)


@pytest.mark.parametrize("bad", [
    dict(qo_lens=[1, -1], kv_lens=[3, 3]),
    dict(qo_lens=[1, 1], kv_lens=[3]),
    dict(qo_lens=[1.0, 2.0], kv_lens=[3, 3]),
    dict(qo_lens=[[1]], kv_lens=[[3]]),
    dict(qo_lens=[1], kv_lens=[3], num_ctas=0),
    dict(qo_lens=[1], kv_lens=[3], group=0),
    dict(qo_lens=[1], kv_lens=[3], tile_q=0),
    dict(qo_lens=[1], kv_lens=[3], alpha=-1.0),
    dict(qo_lens=[1], kv_lens=[2**31]),
])
def test_plan_rejects_bad_input(bad):
    args = dict(num_ctas=4)
    args.update(bad)
    with pytest.raises(ValueError):
        plan(**args)


def test_plan_arrays_are_read_only():
    p = plan([1, 2], [50, 60], 3)
    for name in ("qo_lens", "kv_lens", "cta_indptr", "request", "qo_tile", "kv_start", "kv_end", "out_slot",
                 "merge_indptr", "merge_request", "merge_qo_tile", "merge_slots", "cta_cost"):
        with pytest.raises(ValueError):
            getattr(p, name)[:1] = 1


def test_plan_of_is_the_dataclass_without_its_init():
    p = plan([1, 3, 2], [50, 900, 0], 3, chunk_limit=200)
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(Plan)}
    q = Plan.of(**fields)
    assert type(q) is Plan and q.num_items == p.num_items and q.placement == p.placement
    assert all(getattr(q, k) is v for k, v in fields.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.num_ctas = 4
    with pytest.raises(TypeError, match="missing.*placement"):
        Plan.of(**{k: v for k, v in fields.items() if k != "placement"})
    with pytest.raises(TypeError, match="extra.*colour"):
        Plan.of(**fields, colour=1)


@SETTINGS
@given(batches(), st.integers(1, 24), st.sampled_from([1, 16, 64]), st.sampled_from([1, 2, 4]),
       st.sampled_from([64, 128]))
def test_partial_buffer_bound_always_suffices(lens, num_ctas, tile_q, group, head_dim):
    qo, kv = lens
    num_qo_heads = 8 * group
    bound = partial_buffer_bound(num_ctas, tile_q, num_qo_heads, head_dim)
    assert bound == 2 * num_ctas * tile_q * num_qo_heads * (head_dim + 1)
    p = plan(qo, kv, num_ctas, tile_q, group=group, num_qo_heads=num_qo_heads,
             head_dim=head_dim, partial_capacity=bound)
    need = p.partial_elements(num_qo_heads, head_dim)
    assert need == p.num_partials * tile_q * (num_qo_heads // group) * (head_dim + 1)
    assert need <= bound


def test_partial_capacity_check_names_the_rule():
    p = plan([1] * 4, [1000, 10, 10, 10], num_ctas=4, tile_q=1)
    assert p.num_partials > 0
    need = p.partial_elements(32, 128)
    assert check_partial_capacity(p, 32, 128, need) == need
    with pytest.raises(ValueError, match=r"2\*C\*T_q\*H_qo\*\(head_dim\+1\)"):
        check_partial_capacity(p, 32, 128, need - 1)
    with pytest.raises(ValueError, match="partial-buffer capacity"):
        plan([1] * 4, [1000, 10, 10, 10], num_ctas=4, tile_q=1, num_qo_heads=32,
             head_dim=128, partial_capacity=need - 1)
    with pytest.raises(ValueError, match="num_qo_heads"):
        plan([1], [10], 2, partial_capacity=10)
    with pytest.raises(ValueError, match="multiple of group"):
        plan([1], [10], 2, group=4).partial_elements(6, 128)


# --- tile heuristic ---------------------------------------------------------

@pytest.mark.parametrize("qo_lens, group, expected", [
    ([1] * 8, 1, 1),
    ([1] * 8, 4, 16),
    ([1] * 8, 8, 16),
    ([1, 2], 1, 16),
    ([16], 1, 16),
    ([17], 1, 32),
    ([20, 40], 1, 32),
    ([64], 1, 64),
    ([65], 1, 128),
    ([100, 200], 1, 128),
    ([1000], 1, 128),
    ([0, 0], 1, 1),
    ([], 1, 1),
    ([8, 8], 4, 32),
])
def test_choose_tile_q_spot_values(qo_lens, group, expected):
    assert choose_tile_q(qo_lens, group) == expected


def test_smem_model_spot_values():
    # Q 128x128 + K,V 128x128 in fp16, plus the fp32 128x128 score tile and 2x128 stats.
    assert smem_bytes(128, 128, 128, 2) == (128 * 128 + 2 * 128 * 128) * 2 + (128 * 128 + 256) * 4
    assert resident_ctas(smem_bytes(128, 128, 128)) == 1
    assert resident_ctas(smem_bytes(128, 64, 128)) == 2
    assert resident_ctas(300 * 1024) == 0


@pytest.mark.parametrize("tile_q, head_dim, elem_bytes, expected", [
    (1, 128, 2, 128),     # decode: a 128-key tile still leaves 3 CTAs per SM
    (16, 128, 2, 128),
    (64, 128, 2, 128),
    (128, 128, 2, 64),    # 128 would leave 1 CTA per SM
    (128, 128, 4, 32),
    (128, 256, 2, 32),
    (128, 64, 2, 128),
    (128, 512, 2, 32),    # below the 2-CTA target: best effort, smallest tile
])
def test_choose_tile_kv_spot_values(tile_q, head_dim, elem_bytes, expected):
    assert choose_tile_kv(tile_q, head_dim, elem_bytes) == expected


def test_choose_tile_kv_respects_budget_and_raises():
    assert choose_tile_kv(128, 128, min_ctas_per_sm=1) == 128
    assert choose_tile_kv(128, 128, min_ctas_per_sm=3) == 32
    with pytest.raises(ValueError, match="no KV tile fits"):
        choose_tile_kv(128, 1024)
    assert choose_tiles([1] * 4, 4, 128) == (16, 128)
    assert choose_tiles([300], 1, 128) == (128, 64)
