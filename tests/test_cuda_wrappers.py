"""Plan/run wrappers (docs/concepts/scheduler.md) against the golden model.

In the simulator (CI) the shapes are tiny and num_ctas is 4, so some requests
are split and merged and some are written directly.  The ``gpu`` tests
(100 bitwise-equal runs, CUDA-graph capture and replay after a re-plan) need
torch on a real GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import reference as R
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.wrappers import (BatchDecodeWithPagedKVCacheWrapper,
                                  BatchPrefillWithPagedKVCacheWrapper)

from brute import random_paged_batch

def gpu(f):
    """GPU only: selected by ``-m gpu``, skipped in the simulator."""
    return pytest.mark.gpu(pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")(f))
C = 4
HQ, HK, D, PAGE = 4, 2, 16, 4
WS = 1 << 20


def workspace(nbytes: int):
    """A device workspace: what FlashInfer users pass (a host array is refused on a GPU)."""
    from numba import cuda
    return cuda.device_array(nbytes, np.uint8)


def decode_batch(rng, kv_lens, layout="NHD", dtype=np.float16):
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=PAGE,
                           num_kv_heads=HK, group=HQ // HK, head_dim=D, kv_layout=layout,
                           share_first_page=True)
    b["q"], b["cache"] = b["q"].astype(dtype), b["cache"].astype(dtype)
    return b


def prefill_batch(rng, qo_lens, kv_lens, dtype=np.float16):
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=PAGE, num_kv_heads=HK,
                           group=HQ // HK, head_dim=D)
    b["q"], b["cache"] = b["q"].astype(dtype), b["cache"].astype(dtype)
    return b


def close(got, ref, tol=4e-3):
    (o, lse), (o_r, lse_r) = got, ref
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
    fin = np.isfinite(lse_r)
    np.testing.assert_allclose(lse[fin], lse_r[fin], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_r, rtol=tol, atol=tol)


def ref_decode(b, layout="NHD", **kw):
    return R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                kv_layout=layout, return_lse=True, **kw)


def ref_prefill(b, causal):
    return R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"],
                                 b["last"], causal=causal, return_lse=True)


def decode_wrapper(b, layout="NHD", **kw):
    # docs/concepts/scheduler.md's chunk rule and no item price: at these tiny lengths the
    # default price would keep every request whole, and the merge path untested.
    kw.setdefault("chunk_overhead", 0.0)
    kw.setdefault("chunk_limit", None)
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), layout, num_ctas=C)
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, **kw)
    return w


# ---------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_matches_golden(layout):
    rng = np.random.default_rng(0)
    b = decode_batch(rng, [37, 3, 0, 22, 9], layout)
    w = decode_wrapper(b, layout)
    p = w.last_plan
    assert p.num_merges >= 1 and (p.out_slot == -1).any()      # both paths exercised
    close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b, layout))


def test_decode_variant_passes_through():
    rng = np.random.default_rng(1)
    b = decode_batch(rng, [30, 5, 12])
    w = decode_wrapper(b, pos_encoding_mode="ALIBI", logits_soft_cap=5.0)
    close(w.run(b["q"], b["cache"], return_lse=True),
          ref_decode(b, pos_encoding_mode="ALIBI", logits_soft_cap=5.0))


def test_decode_merge_with_empty_partials_and_sigmoid():
    # A short window leaves the early chunks of a split request fully masked:
    # their partial LSE is -inf and the merge must weigh them 0.  Sigmoid
    # partials simply add (no LSE).
    rng = np.random.default_rng(11)
    b = decode_batch(rng, [41, 2, 0, 26])
    w = decode_wrapper(b, window_left=4)
    assert w.last_plan.num_merges >= 1
    close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b, window_left=4))
    w = decode_wrapper(b, use_sigmoid=True)
    assert w.last_plan.num_merges >= 1
    ref = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                               use_sigmoid=True)
    np.testing.assert_allclose(np.asarray(w.run(b["q"], b["cache"]), np.float32), ref,
                               rtol=4e-3, atol=4e-3)


def test_decode_plan_serves_layers_and_replan_keeps_addresses():
    rng = np.random.default_rng(2)
    b = decode_batch(rng, [33, 4, 18, 1])
    w = decode_wrapper(b)
    layout = w.layout
    for _ in range(2):   # two "layers": same lengths, new q and cache
        layer = dict(b, q=rng.standard_normal(b["q"].shape).astype(np.float16),
                     cache=rng.standard_normal(b["cache"].shape).astype(np.float16))
        close(w.run(layer["q"], layer["cache"], return_lse=True), ref_decode(layer))
    # re-plan with other lengths: same workspace layout, right answer
    b2 = decode_batch(rng, [2, 41, 7, 15])
    w.plan(b2["indptr"], b2["indices"], b2["last"], HQ, HK, D, PAGE)
    assert w.layout is layout
    close(w.run(b2["q"], b2["cache"], return_lse=True), ref_decode(b2))


def test_decode_default_plan_prices_items_and_caps_ctas():
    # Defaults: chunk_overhead=DecodeTuning.plan_chunk_overhead, chunk_limit="auto", C from
    # decode_plan_ctas.  Equal lengths stay whole (no partials), a long request
    # is still cut, and the output is right either way.
    from nbattn.cuda.tuning import DECODE
    rng = np.random.default_rng(6)
    for lens, split in (([24, 24, 24, 24, 24], False), ([400, 3, 5, 2], True)):
        b = decode_batch(rng, lens)
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
        p = w.last_plan
        assert p.chunk_overhead == DECODE.plan_chunk_overhead and p.num_ctas <= C
        assert (p.num_merges > 0) == split
        close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b))
    # A plan on fewer CTAs than the grid: the spare CTAs get empty queues.
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, num_ctas=2)
    assert w.last_plan.num_ctas == 2
    close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b))
    with pytest.raises(ValueError, match="num_ctas"):
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, num_ctas=C + 1)


def test_decode_plan_takes_a_tuning():
    """plan(tuning=) shapes the plan and the kernels of every run() of it; a tuning of
    another type is a TypeError naming it, before the workspace is touched."""
    from nbattn.cuda.tuning import DECODE, PREFILL
    rng = np.random.default_rng(8)
    b = decode_batch(rng, [400, 3, 5, 2])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
    for bad in ("warp", PREFILL):
        with pytest.raises(TypeError, match="tuning"):
            w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, tuning=bad)
    assert w.last_plan is None
    tuning = DECODE.replace(plan_chunk_overhead=7.0, path="smem")
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, tuning=tuning)
    assert w.last_plan.chunk_overhead == 7.0 and w._cfg.tuning == tuning and w._cfg.path == "smem"
    close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b))
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, tuning=tuning, chunk_overhead=3.0)
    assert w.last_plan.chunk_overhead == 3.0                # the argument wins over the tuning


def test_decode_plan_ctas_is_one_resident_wave():
    from types import SimpleNamespace
    from nbattn.cuda.host.driver import sm_count
    from nbattn.cuda.wrappers import decode_plan_ctas
    warp = SimpleNamespace(path="warp", heads_per_cta=4, min_blocks=4)
    # 32 query heads in blocks of 4: 8 kernel CTAs per planner CTA.
    assert decode_plan_ctas(warp, 32, 10 ** 6) == 4 * sm_count() // 8
    assert decode_plan_ctas(warp, 32, 1) == 1
    assert decode_plan_ctas(warp, 8, 10 ** 6) == 4 * sm_count() // 2
    tc = SimpleNamespace(path="tc", heads_per_cta=8, min_blocks=3)
    assert decode_plan_ctas(tc, 32, 10 ** 6) == 3 * sm_count() // 4
    assert decode_plan_ctas(SimpleNamespace(path="smem"), 32, 7) == 7


def test_decode_bitwise_repeatable_and_out_in_place():
    rng = np.random.default_rng(3)
    b = decode_batch(rng, [29, 6, 13])
    w = decode_wrapper(b)
    o1, l1 = w.run(b["q"], b["cache"], return_lse=True)
    out = np.full_like(o1, np.nan)
    lse = np.full(l1.shape, np.nan, np.float32)
    o2 = w.run(b["q"], b["cache"], out=out, lse=lse)
    assert o2 is out
    assert o1.tobytes() == out.tobytes() and l1.tobytes() == lse.tobytes()


def test_workspace_too_small_names_the_rule_before_any_launch():
    rng = np.random.default_rng(4)
    b = decode_batch(rng, [20, 3])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(4096), num_ctas=C, max_batch_size=4,
                                           max_num_pages=16, max_work_items=16)
    with pytest.raises(ValueError, match=r"2\*C\*T_q\*H_qo\*\(head_dim\+1\)"):
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
    assert w.last_plan is None
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(b["q"], b["cache"])
    # capacities are checked too, naming the constructor argument to grow
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=C, max_batch_size=1)
    with pytest.raises(ValueError, match="max_batch_size"):
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
    with pytest.raises(ValueError, match="plan region"):
        BatchDecodeWithPagedKVCacheWrapper(workspace(64), num_ctas=C)


def test_run_checks_q_against_plan():
    rng = np.random.default_rng(5)
    b = decode_batch(rng, [5, 6])
    w = decode_wrapper(b)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(b["q"].astype(np.float32), b["cache"].astype(np.float32))
    with pytest.raises(ValueError, match="shape"):
        w.run(b["q"][:1], b["cache"])


# ---------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_prefill_matches_golden(causal):
    rng = np.random.default_rng(10)
    b = prefill_batch(rng, [3, 1, 5, 0, 2], [40, 3, 17, 0, 25])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=causal)
    assert w.last_plan.num_merges >= 1
    close(w.run(b["q"], b["cache"], return_lse=True), ref_prefill(b, causal))


def test_prefill_plan_takes_a_tuning():
    """plan(tuning=) is a PrefillTuning that shapes the plan's tiles; another type is a
    TypeError naming it, before the workspace is touched."""
    from nbattn.cuda.tuning import DECODE, PREFILL
    rng = np.random.default_rng(11)
    b = prefill_batch(rng, [3, 1, 5], [40, 3, 17])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
    with pytest.raises(TypeError, match="tuning"):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, tuning=DECODE)
    assert w.last_plan is None
    tuning = PREFILL.replace(cuda_core=False)
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True, tuning=tuning)
    assert w._spec.tuning == tuning and w._spec_part.tuning == tuning
    close(w.run(b["q"], b["cache"], return_lse=True), ref_prefill(b, True))


def test_prefill_persistent_queues_and_smaller_replan():
    """run() is one launch of C CTAs per KV head walking their LPT queues: with
    more query tiles than CTAs some CTA runs several rows (final and partial
    ones mixed), and a smaller re-plan runs only its own rows."""
    rng = np.random.default_rng(11)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), use_cuda_graph=True, num_ctas=C,
                                            max_work_items=32)
    b = prefill_batch(rng, [20, 9, 1, 14], [60, 9, 200, 22])
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True)
    p = w.last_plan
    queue = np.diff(p.cta_indptr)
    assert queue.max() >= 2 and p.num_merges >= 1
    kinds = [set((p.out_slot[p.cta_indptr[c]:p.cta_indptr[c + 1]] >= 0).tolist()) for c in range(C)]
    assert any(k == {True, False} for k in kinds)          # a CTA mixing final and partial rows
    close(w.run(b["q"], b["cache"], return_lse=True), ref_prefill(b, True))
    b2 = prefill_batch(rng, [3], [21])
    w.plan(b2["qo_indptr"], b2["indptr"], b2["indices"], b2["last"], HQ, HK, D, PAGE, causal=True)
    close(w.run(b2["q"], b2["cache"], return_lse=True), ref_prefill(b2, True))


def test_prefill_plans_over_one_wave_of_ctas():
    """The plan balances over plan_ctas_per_sm * SMs // KV heads CTAs per KV head (at
    most the constructor's), or the num_ctas asked for; a bad num_ctas is refused
    before the wrapper's plan changes; every plan runs right."""
    from nbattn.cuda.host.driver import sm_count
    from nbattn.cuda.tuning import PREFILL
    rng = np.random.default_rng()
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=C, max_work_items=64)
    b = prefill_batch(rng, [9, 1, 5, 1], [40, 17, 5, 70])
    args = (b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
    for per_sm, asked in ((1, None), (2, None), (8, None), (1, 1), (2, 3)):
        tuning = PREFILL.replace(plan_ctas_per_sm=per_sm)
        w.plan(*args, causal=True, tuning=tuning, num_ctas=asked)
        want = asked if asked is not None else max(1, min(C, per_sm * sm_count() // HK))
        assert w.last_plan.num_ctas == want
        close(w.run(b["q"], b["cache"], return_lse=True), ref_prefill(b, True))
    before = w.last_plan
    for bad in (0, C + 1, 2.0, "4"):
        with pytest.raises(ValueError, match="num_ctas"):
            w.plan(*args, causal=True, num_ctas=bad)
        assert w.last_plan is before
    with pytest.raises(ValueError, match="plan_ctas_per_sm"):
        PREFILL.replace(plan_ctas_per_sm=0)


def _equal_outputs(a, b):
    (oa, la), (ob, lb) = a, b
    to = lambda x: np.asarray(x.copy_to_host() if hasattr(x, "copy_to_host") else (x.cpu() if hasattr(x, "cpu") else x))
    np.testing.assert_array_equal(to(oa).view(np.uint16), to(ob).view(np.uint16))
    np.testing.assert_array_equal(to(la), to(lb))


def test_decode_contraction_merge_matches_golden_across_replans():
    """The decode wrapper merges an LPT plan with the split-KV contraction on its fixed
    grid, reading the merge count on the device; one bound launch serves re-plans with
    other merge counts (an empty request, a non-full last page, fresh random data, a NaN
    key in one chunk of a split request, logits near +-1000), each against the golden
    model."""
    rng = np.random.default_rng()
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
    bound = None
    for lens, limit, poison in (([70, 3, 41, 0], 24, False), ([9, 60, 1, 33], 16, True), ([5, 5, 5, 5], 64, False)):
        b = decode_batch(rng, lens)
        if poison:      # request 1: a NaN key in its second chunk, and logits near +-1000
            page = b["indices"][b["indptr"][1] + 5]
            b["cache"][page, 0, 1, 0, 3] = np.nan
            b["q"][1] *= np.float16(300.0)
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, chunk_limit=limit, num_ctas=2,
               schedule="lpt")
        close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b))
        merges = w.last_plan.num_merges
        assert (merges >= 2) == (limit < 64), merges
        now = w._bound_now
        assert bound is None or now is bound          # the same bound launches after a re-plan
        bound = now


@pytest.mark.parametrize("graph", [False, True])
def test_prefill_runs_on_the_configurations_grid(graph):
    """Plans of one configuration share one bound grid: the configuration's planner
    CTAs (every constructor CTA with use_cuda_graph), whatever each plan's num_ctas
    below it; a plan over more CTAs binds a larger grid.  Every answer is right."""
    from nbattn.cuda.prefill_wrapper import prefill_plan_ctas
    from nbattn.cuda.tuning import PREFILL
    rng = np.random.default_rng()
    b = prefill_batch(rng, [9, 1, 5], [40, 17, 5])
    ref = ref_prefill(b, True)
    wave = prefill_plan_ctas(HK, 1 << 20, PREFILL)     # one wave of CTAs per KV head on this device
    cap = 2 * wave
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(8 * WS), use_cuda_graph=graph, num_ctas=cap, max_work_items=64)
    want = cap if graph else wave
    first = None
    for kw in ({}, {"num_ctas": 2}, {"chunk_limit": 8, "num_ctas": wave}):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True, **kw)
        close(w.run(b["q"], b["cache"], return_lse=True), ref)
        assert w._grid_ctas == want and w._bound_now[1][0].grid == (want, HK)
        first = first or w._bound_now[1]
        assert w._bound_now[1] is first          # one bound grid for the configuration
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True,
           chunk_limit=8, num_ctas=wave + 3)
    close(w.run(b["q"], b["cache"], return_lse=True), ref)
    assert w._grid_ctas == (cap if graph else wave + 3)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_merge_grid_does_not_change_a_bit(kind):
    """The fixed merge grid takes units of R rows of a tile, R chosen from the merge
    count and the grid: the same plan merged on grids of 2 and 32 CTAs per KV head
    gives bitwise the same output (few merges: R = 1 against the whole tile)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    outs = []
    rows = []
    for grid in (2, 32):
        if kind == "decode":
            b = decode_batch(np.random.default_rng(seed), [70, 3, 41])
            w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=grid, use_cuda_graph=True)
            w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, chunk_limit=40, num_ctas=2,
                   schedule="lpt")
            ref = ref_decode(b)
        else:
            b = prefill_batch(np.random.default_rng(seed), [9, 1, 5], [40, 17, 5])
            w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=grid, max_work_items=64,
                                                    use_cuda_graph=True)
            w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True,
                   chunk_limit=24, num_ctas=2)
            ref = ref_prefill(b, True)
        p = w.last_plan
        assert p.num_merges >= 1
        assert w._grid_ctas == grid      # use_cuda_graph: the constructor's num_ctas
        rows.append(min(p.tile_q, -(-p.num_merges * p.tile_q // grid)))    # the kernel's R
        outs.append(w.run(b["q"], b["cache"], return_lse=True))
        close(outs[-1], ref)
    assert rows[0] > rows[1], rows
    _equal_outputs(*outs)


# ---------------------------------------------------------------------------
# GPU only: determinism at scale, CUDA graphs
# ---------------------------------------------------------------------------

def _torch_decode(kv_lens, seed, hq=32, hk=8, d=128, page=16):
    import torch
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=page,
                           num_kv_heads=hk, group=hq // hk, head_dim=d)
    q = torch.from_numpy(b["q"].astype(np.float16)).cuda()
    cache = torch.from_numpy(b["cache"].astype(np.float16)).cuda()
    return b, q, cache


@gpu
def test_gpu_100_runs_bitwise_equal():
    import torch
    b, q, cache = _torch_decode([8192] + [512] * 15, 20)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=32)
    w.plan(b["indptr"], b["indices"], b["last"], 32, 8, 128, 16)
    assert w.last_plan.num_merges >= 1
    first = w.run(q, cache).clone()
    for _ in range(100):
        assert torch.equal(w.run(q, cache), first)


@gpu
def test_gpu_plans_back_to_back_while_the_stream_is_busy():
    """Plans made while the last plan's copies still wait behind other work use the
    two staging images in turn; each run() reads the plan made just before it."""
    import torch
    lens = ([4096, 100, 700, 3000], [50, 3900, 1200, 17], [9000, 1, 1, 300])
    batches = [_torch_decode(k, 40 + i) for i, k in enumerate(lens)]
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=16)
    big = torch.randn(8192, 8192, device="cuda")
    outs = []
    for rnd in range(2):
        for b, q, cache in batches:
            for _ in range(3):
                big @ big                 # keeps the stream busy: the plan's copies stay queued
            w.plan(b["indptr"], b["indices"], b["last"], 32, 8, 128, 16, schedule="lpt")
            outs.append((b, q, cache, w.run(q, cache)))
    assert w._h2d_spare is not None     # a plan found the first image in flight
    torch.cuda.synchronize()
    for b, q, cache, out in outs:
        ref = R.batch_decode_paged(q.cpu().numpy(), cache.cpu().numpy(), b["indptr"], b["indices"], b["last"])
        np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=4e-3, atol=4e-3)


@gpu
@pytest.mark.parametrize("schedule", ["auto", "lpt"])   # auto: the small-batch split shape
def test_gpu_cuda_graph_replay_after_replan(schedule):
    import torch
    hq, hk, d, page = 32, 8, 128, 16
    b1, q, cache = _torch_decode([4096, 100, 700, 3000], 21)
    rng = np.random.default_rng(22)
    pool = int(cache.shape[0])
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=16)
    w.plan(b1["indptr"], b1["indices"], b1["last"], hq, hk, d, page, schedule=schedule)
    assert w._mode == ("split" if schedule == "auto" else "lpt")
    out = torch.empty_like(q)
    w.run(q, cache, out=out)          # compile before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out)
    # new lengths (same batch, pages from the same pool), new q values
    lens2 = [50, 3900, 1200, 17]
    n2 = [-(-n // page) for n in lens2]
    indices2 = rng.permutation(pool)[:sum(n2)].astype(np.int32)
    indptr2 = np.concatenate([[0], np.cumsum(n2)]).astype(np.int32)
    last2 = np.array([n - (k - 1) * page for n, k in zip(lens2, n2)], np.int32)
    w.plan(indptr2, indices2, last2, hq, hk, d, page, schedule=schedule)
    assert schedule == "auto" or w.last_plan.num_merges >= 1
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = R.batch_decode_paged(q.cpu().numpy(), cache.cpu().numpy(), indptr2, indices2, last2)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=4e-3, atol=4e-3)


@gpu
def test_gpu_prefill_cuda_graph_replay_after_replan():
    import torch
    hq, hk, d, page = 32, 8, 128, 16
    rng = np.random.default_rng(31)
    qo1, kv1 = [300, 1, 77, 134], [2000, 700, 77, 4000]
    qo2, kv2 = [12, 400, 90, 10], [90, 3000, 1500, 10]          # same total query rows
    pool = sum(-(-k // page) for k in kv1) + sum(-(-k // page) for k in kv2)
    cache = torch.randn((pool, 2, page, hk, d), device="cuda", dtype=torch.float16)

    def table(qo, kv, first_page):
        n = [-(-k // page) for k in kv]
        indices = (first_page + np.arange(sum(n))).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        last = np.array([k - (m - 1) * page for k, m in zip(kv, n)], np.int32)
        return np.concatenate([[0], np.cumsum(qo)]).astype(np.int32), indptr, indices, last

    t1 = table(qo1, kv1, 0)
    t2 = table(qo2, kv2, int(t1[2].size))
    q = torch.randn((sum(qo1), hq, d), device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, num_ctas=32)
    for tc in (False, True):
        w.plan(*t1, hq, hk, d, page, causal=True, tensor_cores=tc)
        w.run(q, cache, out=out)                     # compile before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out)
        for t in (t2, t1):
            w.plan(*t, hq, hk, d, page, causal=True, tensor_cores=tc)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            ref = R.batch_prefill_paged(q.cpu().numpy(), cache.cpu().numpy(), *t, causal=True)
            np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=5e-3, atol=5e-3)


# ---------------------------------------------------------------------------
# run(): the bound launches (split schedule, re-plans, constant Python work)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_split_schedule_matches_golden_and_replans(layout):
    """The small-batch schedule (every request in equal chunks, one-round merge) with
    an empty request, a non-full last page and a re-plan of the same batch."""
    rng = np.random.default_rng([61, len(layout)])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), layout, num_ctas=C)
    for lens in ([0, 37], [40, 1], [6, 29]):
        b = decode_batch(rng, lens, layout)
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, schedule="split",
               window_left=9, sink_size=1)
        assert w.last_plan.num_partials == w.last_plan.num_items == 4        # 2 chunks a request
        got = w.run(b["q"], b["cache"], return_lse=True)
        close(got, ref_decode(b, layout, window_left=9, sink_size=1))


def test_decode_lpt_and_split_agree():
    rng = np.random.default_rng(62)
    b = decode_batch(rng, [19, 3, 0, 33])
    outs = []
    for sched in ("lpt", "split"):
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), "NHD", num_ctas=C)
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, schedule=sched)
        outs.append(w.run(b["q"], b["cache"], return_lse=True))
    close(outs[0], (np.asarray(outs[1][0], np.float32), outs[1][1]))
    close(outs[1], ref_decode(b))


def test_decode_run_bad_input_raises_before_launch(monkeypatch):
    from nbattn.cuda.host import driver as _driver
    rng = np.random.default_rng(63)
    b = decode_batch(rng, [4, 9])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), "NHD", num_ctas=C)
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
    launched = []
    monkeypatch.setattr(_driver.BoundLaunch, "__call__", lambda self, stream=0: launched.append(1))
    for bad, match in ((b["q"][:1], "q: must have shape"), (b["q"].astype(np.float32), "q: dtype"),
                       (b["q"], "paged_kv_cache: .page_size")):
        cache = b["cache"][:, :, :2] if match.startswith("paged") else b["cache"]
        with pytest.raises(Exception, match=match):
            w.run(bad, cache)
    assert not launched


def test_decode_run_skips_checks_only_for_what_it_accepted(monkeypatch):
    """A run() whose inputs look as the last accepted run()'s did skips the checks; any
    other dtype, shape, layout or too small a cache is still refused before a launch,
    and plan() forgets what was accepted (a re-plan to a larger page id is checked)."""
    from nbattn.cuda.host import driver as _driver
    from nbattn.cuda import wrappers as WR
    rng = np.random.default_rng(67)
    b = decode_batch(rng, [4, 9])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), "NHD", num_ctas=C)
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE)
    close(w.run(b["q"], b["cache"], return_lse=True), ref_decode(b))
    checked = []
    check = WR.PlanRunWrapper._check_run
    monkeypatch.setattr(WR.PlanRunWrapper, "_check_run", lambda self, *a: checked.append(1) or check(self, *a))
    q2 = rng.standard_normal(b["q"].shape).astype(b["q"].dtype)      # new values, same look
    w.run(q2, b["cache"])
    assert not checked
    launched = []
    monkeypatch.setattr(_driver.BoundLaunch, "__call__", lambda self, stream=0: launched.append(1))
    qf = np.asfortranarray(b["q"])
    for q, cache, match in ((b["q"][:1], b["cache"], "q: must have shape"),
                            (b["q"].astype(np.float32), b["cache"], "q: dtype"),
                            (b["q"], b["cache"][:, :, :2], "paged_kv_cache: .page_size"),
                            (b["q"], b["cache"][:1], "paged_kv_cache: plan.. uses page")):
        with pytest.raises(Exception, match=match):
            w.run(q, cache)
    assert not launched and len(checked) == 4
    w.run(qf, b["cache"])                                   # another layout: checked, then accepted
    assert len(checked) == 5
    big = decode_batch(rng, [30, 40])                       # same q shape, more pages than b's cache
    assert big["q"].shape == b["q"].shape and big["indices"].max() >= b["cache"].shape[0]
    w.plan(big["indptr"], big["indices"], big["last"], HQ, HK, D, PAGE)
    with pytest.raises(Exception, match="uses page"):
        w.run(big["q"], b["cache"])
    assert len(checked) == 6


def _count_run_calls(w, b, monkeypatch):
    """Python function calls made by one run() (kernels not executed), and their names."""
    import gc
    import sys
    from nbattn.cuda.host import driver as _driver
    monkeypatch.setattr(_driver.BoundLaunch, "__call__", lambda self, stream=0: None)
    w.run(b["q"], b["cache"])                         # binds the launches (once per configuration)
    names = []

    def prof(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else frame.f_code.co_name)
    # garbage from earlier tests must not be collected (finalizers are Python calls) inside the window
    gc.collect()
    gc.disable()
    sys.setprofile(prof)
    try:
        w.run(b["q"], b["cache"])
    finally:
        sys.setprofile(None)
        gc.enable()
    return names


@pytest.mark.skipif(not __import__("nbattn").simulator_enabled(), reason="counts the simulator's Python calls; on a GPU numba's allocator adds calls of its own")
def test_decode_run_python_work_is_constant(monkeypatch):
    """run() checks shapes and launches: no metadata validation, no per-request loop
    (its Python calls do not grow with the batch)."""
    rng = np.random.default_rng(64)
    counts = []
    for lens in ([5, 9], list(rng.integers(1, 30, size=40))):
        b = decode_batch(rng, lens)
        w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), "NHD", num_ctas=C)
        w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, schedule="lpt")
        names = _count_run_calls(w, b, monkeypatch)
        metadata_work = {"validate", "as_int32", "from_cache", "plan", "host_meta", "split_work", "build_work",
                         "check_causal_lengths", "kv_lens", "_page_table"}
        assert not [n for n in names if n.rsplit(".", 1)[-1] in metadata_work], names
        assert "_check_run" not in [n.rsplit(".", 1)[-1] for n in names], names   # accepted last time
        fp8_work = {"run_scales", "check_run_dtypes", "is_fp8", "check_scale", "kv_scales", "set_scalar"}
        assert not [n for n in names if n.rsplit(".", 1)[-1] in fp8_work], names   # the fp16 path: no fp8 work
        counts.append(len(names))
    assert counts[0] == counts[1], counts


@pytest.mark.skipif(not __import__("nbattn").simulator_enabled(), reason="counts the simulator's Python calls; on a GPU numba's allocator adds calls of its own")
def test_prefill_run_python_work_is_constant(monkeypatch):
    """The prefill wrapper's run() too: bound launches, no metadata work, no per-request loop."""
    rng = np.random.default_rng(65)
    counts = []
    for qo, kv in (([3, 2], [9, 5]), ([int(x) for x in rng.integers(1, 4, 30)], [int(x) for x in rng.integers(4, 30, 30)])):
        b = prefill_batch(rng, qo, kv)
        w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True)
        names = _count_run_calls(w, b, monkeypatch)
        metadata_work = {"validate", "as_int32", "from_cache", "plan", "host_meta", "split_work", "build_work",
                         "check_causal_lengths", "kv_lens", "_page_table", "request_rows", "get_persistent_kernel"}
        assert not [n for n in names if n.rsplit(".", 1)[-1] in metadata_work], names
        counts.append(len(names))
    assert counts[0] == counts[1], counts


def test_prefill_run_after_replan_to_other_shapes_rebinds():
    """Bound launches are per configuration: a re-plan to another total_q, then back, is right each time."""
    rng = np.random.default_rng(66)
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=C)
    for qo, kv in (([3, 1], [12, 4]), ([5], [7]), ([2, 2], [9, 11])):
        b = prefill_batch(rng, qo, kv)
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True)
        close(w.run(b["q"], b["cache"], return_lse=True), ref_prefill(b, True))


@gpu
def test_gpu_sinks_tensor_read_in_place_rechecked_after_writes_and_captured():
    """run(sinks=) with a CUDA sinks tensor: the kernel reads its current values,
    an in-place write that makes one non-finite is refused (torch counted it), a
    bfloat16 tensor and host logits give the same result, and a capture after one
    eager run replays with the values written between replays."""
    import torch
    from nbattn.reference.sinks import apply_sinks as golden_sinks
    hq, hk, d, page = 32, 8, 128, 16
    b, q, cache = _torch_decode([3000, 0, 700, 17], 23)
    ref_o, ref_l = R.batch_decode_paged(b["q"].astype(np.float16).astype(np.float64),
                                        b["cache"].astype(np.float16).astype(np.float64), b["indptr"],
                                        b["indices"], b["last"], return_lse=True, dtype=np.float64)
    rng = np.random.default_rng(24)
    host = (rng.standard_normal(hq) * 3).astype(np.float32)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=16)
    w.plan(b["indptr"], b["indices"], b["last"], hq, hk, d, page)

    def want(s):
        return golden_sinks(ref_o.copy(), ref_l.copy(), np.asarray(s, np.float64))

    def got(o, lse):
        return o.float().cpu().numpy(), lse.cpu().numpy()

    sinks = torch.from_numpy(host).cuda()
    close(got(*w.run(q, cache, return_lse=True, sinks=sinks)), want(host))
    sinks.mul_(-0.5)                                   # torch counts the write: checked and read again
    close(got(*w.run(q, cache, return_lse=True, sinks=sinks)), want(host * -0.5))
    sinks[3] = float("inf")
    with pytest.raises(ValueError, match="sinks: must be finite"):
        w.run(q, cache, sinks=sinks)
    close(got(*w.run(q, cache, return_lse=True, sinks=host)), want(host))
    bf = torch.from_numpy(host).cuda().to(torch.bfloat16)
    close(got(*w.run(q, cache, return_lse=True, sinks=bf)), want(bf.float().cpu().numpy()))
    live = torch.from_numpy(host).cuda()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    w.run(q, cache, out=out, lse=lse, sinks=live)      # checks the values and binds, before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out, lse=lse, sinks=live)
    for scale in (1.0, 2.0):
        live.copy_(torch.from_numpy(host * scale))
        g.replay()
        torch.cuda.synchronize()
        close((out.float().cpu().numpy(), lse.cpu().numpy()), want(host * scale))


@gpu
@pytest.mark.parametrize("schedule", ["auto", "lpt"])
def test_gpu_window_plans_hidden_pages_out(schedule):
    """A sliding window on the decode wrapper with torch CUDA tensors: the work
    lists start at each request's first visible page (decode_problem.first_visible),
    and the result equals the golden model's, split or not, also in a graph replay."""
    import torch
    hq, hk, d, page = 32, 8, 128, 16
    b, q, cache = _torch_decode([9000, 5, 700, 0, 333], 25)
    gold = R.batch_decode_paged(b["q"].astype(np.float16).astype(np.float64),
                                b["cache"].astype(np.float16).astype(np.float64), b["indptr"], b["indices"],
                                b["last"], return_lse=True, dtype=np.float64, window_left=500)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, num_ctas=16)
    w.plan(b["indptr"], b["indices"], b["last"], hq, hk, d, page, schedule=schedule, window_left=500)
    o, lse = w.run(q, cache, return_lse=True)
    close((o.float().cpu().numpy(), lse.cpu().numpy()), gold)
    out, lse2 = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, cache, out=out, lse=lse2)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    close((out.float().cpu().numpy(), lse2.cpu().numpy()), gold)
