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
