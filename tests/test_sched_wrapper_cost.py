"""The decode wrapper plans with a cost model (plan(cost=...)) and still computes the golden answer."""
from __future__ import annotations

import numpy as np

import nbattn  # noqa: F401  (compat first)
from nbattn import reference as R
from nbattn.cuda.wrappers import BatchDecodeWithPagedKVCacheWrapper
from nbattn.sched import plan, simulate_plan
from nbattn.sched.cost import CostModel

from brute import random_paged_batch

HQ, HK, D, PAGE, C = 4, 2, 16, 4, 4


def test_decode_wrapper_plans_with_the_cost_model_and_matches_golden():
    from numba import cuda
    rng = np.random.default_rng()
    kv = [int(x) for x in rng.integers(1, 60, 5)]
    kv[0] = 90                                  # one long request: splitting pays
    b = random_paged_batch(rng, qo_lens=[1] * len(kv), kv_lens=kv, page_size=PAGE, num_kv_heads=HK,
                           group=HQ // HK, head_dim=D, kv_layout="NHD", share_first_page=True)
    q, cache = b["q"].astype(np.float16), b["cache"].astype(np.float16)
    # A model where a merge is cheap and items cost little: the search splits the long request.
    m = CostModel(alpha=0.0, beta=1.0, chunk_overhead=1.0, merge_cost=0.1, search="plans")
    w = BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(1 << 20, np.uint8), "NHD", num_ctas=C)
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, schedule="lpt", cost=m)
    p = w.last_plan
    assert p.cost_model is m and np.isfinite(p.predicted_makespan)
    assert p.num_merges >= 1
    # The planner made the plan the sched API makes under the same model and lengths.
    ref_plan = plan(np.ones(len(kv), np.int64), kv, p.num_ctas, tile_q=p.tile_q, group=HQ // HK, cost=m,
                    chunk_limit="auto")
    assert np.array_equal(ref_plan.kv_start, p.kv_start) and np.array_equal(ref_plan.cta_indptr, p.cta_indptr)
    assert simulate_plan(p).makespan == p.predicted_makespan or np.isclose(simulate_plan(p).makespan,
                                                                           p.predicted_makespan)
    o, lse = w.run(q, cache, return_lse=True)
    o_r, lse_r = R.batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"], return_lse=True)
    np.testing.assert_allclose(np.asarray(o, np.float32), o_r, rtol=4e-3, atol=4e-3)
    np.testing.assert_allclose(lse, lse_r, rtol=4e-3, atol=4e-3)
    # Without a model the wrapper plans as before (no model recorded).
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, schedule="lpt")
    assert w.last_plan.cost_model is None


def test_prefill_wrapper_plans_with_the_cost_model_and_matches_golden():
    """A model that prices a merge above any split's gain keeps every request whole (no
    partial slot); a model with cheap merges splits the long request; both compute the
    golden answer."""
    from numba import cuda
    from nbattn.cuda.wrappers import BatchPrefillWithPagedKVCacheWrapper
    from nbattn.sched.plan import DIRECT
    rng = np.random.default_rng()
    qo_lens = [int(x) for x in rng.integers(1, 4, 3)]
    kv = [int(x) for x in rng.integers(4, 16, 3)]
    kv[0] = 64                                  # one long request: splitting it is the question
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv, page_size=PAGE, num_kv_heads=HK, group=HQ // HK,
                           head_dim=D, kv_layout="NHD", share_first_page=True)
    q, cache = b["q"].astype(np.float16), b["cache"].astype(np.float16)
    w = BatchPrefillWithPagedKVCacheWrapper(cuda.device_array(4 << 20, np.uint8), "NHD", num_ctas=C)
    o_r, lse_r = R.batch_prefill_paged(q, cache, b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                       causal=True, return_lse=True)
    dear = CostModel(alpha=0.0, beta=1.0, chunk_overhead=1.0, merge_cost=1e6, search="plans")
    cheap = CostModel(alpha=0.0, beta=1.0, chunk_overhead=0.0, merge_cost=0.0, search="plans")
    for model, splits in ((dear, False), (cheap, True)):
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True,
               cost=model, chunk_limit="auto")
        p = w.last_plan
        assert p.cost_model is model
        assert bool(np.any(p.out_slot != DIRECT)) == splits
        o, lse = w.run(q, cache, return_lse=True)
        np.testing.assert_allclose(np.asarray(o, np.float32), o_r, rtol=4e-3, atol=4e-3)
        np.testing.assert_allclose(lse, lse_r, rtol=4e-3, atol=4e-3)
