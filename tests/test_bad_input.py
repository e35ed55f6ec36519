"""Bad input: each rule of docs/bad_input.md raises before any kernel runs, with
a message naming the argument, and changes nothing.  One test case per rule."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R
from nbattn.sched.tiles import smem_bytes

P = importlib.import_module("nbattn.sched.plan")
S = importlib.import_module("nbattn.sched.simulate")


def inputs():
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    k = rng.standard_normal((5, 1, 8)).astype(np.float32)
    v = rng.standard_normal((5, 1, 8)).astype(np.float32)
    cache = rng.standard_normal((3, 2, 2, 1, 8)).astype(np.float32)
    o = rng.standard_normal((4, 2, 8)).astype(np.float32)
    s = rng.standard_normal((4, 2)).astype(np.float32)
    return dict(q=q, k=k, v=v, cache=cache, o=o, s=s)


def readonly(x):
    x = x.copy()
    x.flags.writeable = False
    return x


def unvalidated_bsr(col):
    return L.BSR(np.array([0, 1], np.int32), np.array([col], np.int32), (2, 2), (2, 5))


WS = np.zeros(1 << 20, np.uint8)
PAGES = (np.array([0, 1], np.int32), np.array([0], np.int32), np.array([2], np.int32))

# (rule id, argument named in the message, call)
RULES = [
    ("soft_cap_inf", "logits_soft_cap", lambda d, M: M.single_prefill(d["q"], d["k"], d["v"], logits_soft_cap=np.inf)),
    ("soft_cap_nan", "logits_soft_cap", lambda d, M: M.single_prefill(d["q"], d["k"], d["v"], logits_soft_cap=np.nan)),
    ("sm_scale_inf", "sm_scale", lambda d, M: M.single_prefill(d["q"], d["k"], d["v"], sm_scale=np.inf)),
    ("sigmoid_bias_nan", "sigmoid_bias", lambda d, M: M.single_prefill(d["q"], d["k"], d["v"], use_sigmoid=True,
                                                                       sigmoid_bias=np.nan)),
    ("bsr_col_minus_1", "bsr", lambda d, M: M.block_sparse(d["q"], d["k"], d["v"], unvalidated_bsr(-1))),
    ("bsr_col_past_end", "bsr", lambda d, M: M.block_sparse(d["q"], d["k"], d["v"], unvalidated_bsr(7))),
    ("bsr_causal_more_rows", "q", lambda d, M: M.block_sparse(
        np.concatenate([d["q"]] * 3), d["k"], d["v"],
        L.BSR.from_block_mask(np.ones((3, 3), bool), (2, 2), (6, 5)), causal=True)),
    ("contiguous_dtype_mismatch", "v", lambda d, M: M.single_prefill(d["q"], d["k"], d["v"].astype(np.float16))),
    ("ragged_dtype_mismatch", "v", lambda d, M: M.batch_prefill_ragged(
        d["q"], d["k"], d["v"].astype(np.float16), [0, 2], [0, 5])),
    ("merge_dtype_mismatch", "v_b", lambda d, M: M.merge_state(d["o"], d["s"], d["o"].astype(np.float16), d["s"])),
    ("cascade_3_tuple", "levels[0]", lambda d, M: M.cascade(
        d["q"][:1], [(np.array([0, 1], np.int32),) + PAGES[:2]], d["cache"])),
    ("merge_states_empty", "v", lambda d, M: M.merge_states(np.zeros((0,), np.float32), np.zeros((0,), np.float32))),
    ("in_place_mask_length", "mask", lambda d, M: M.merge_state_in_place(d["o"], d["s"], d["o"].copy(), d["s"].copy(),
                                                                         mask=np.ones(3, bool))),
    ("in_place_readonly", "v", lambda d, M: M.merge_state_in_place(readonly(d["o"]), d["s"], d["o"].copy(),
                                                                   d["s"].copy())),
    ("empty_request_last_page_len", "paged_kv_last_page_len", lambda d, M: M.batch_decode_paged(
        d["q"][:1], d["cache"], [0, 0], np.zeros(0, np.int32), [2])),
]
CUDA_ONLY = [
    ("merge_state_list", "v_a", lambda d: C.merge_state([[1.0]], [1.0], [[1.0]], [1.0])),
    ("readonly_out", "out", lambda d: C.single_prefill(d["q"], d["k"], d["v"], out=readonly(np.zeros_like(d["q"])))),
    ("readonly_lse", "lse", lambda d: C.single_prefill(d["q"], d["k"], d["v"], return_lse=True,
                                                       lse=readonly(np.zeros((2, 2), np.float32)))),
    ("wrapper_max_batch_size", "max_batch_size", lambda d: C.BatchDecodeWithPagedKVCacheWrapper(WS, max_batch_size=-1)),
    ("wrapper_max_num_pages", "max_num_pages", lambda d: C.BatchPrefillWithPagedKVCacheWrapper(WS, max_num_pages=0)),
    ("wrapper_num_ctas_float", "num_ctas", lambda d: C.BatchDecodeWithPagedKVCacheWrapper(WS, num_ctas=2.7)),
    ("plan_q_data_type_float64", "q_data_type", lambda d: C.BatchDecodeWithPagedKVCacheWrapper(WS, num_ctas=2).plan(
        *PAGES, 2, 1, 8, 2, q_data_type="float64")),
    # 3 pages of 2**30 slots: request 1 holds 2**31 + 5 keys (the table itself is valid)
    ("plan_kv_length_over_int32", "paged_kv_indptr", lambda d: C.BatchDecodeWithPagedKVCacheWrapper(
        WS, num_ctas=2).plan([0, 1, 4], [0, 1, 2, 3], [1, 5], 2, 1, 8, 1 << 30)),
    ("prefill_plan_kv_length_over_int32", "paged_kv_indptr", lambda d: C.BatchPrefillWithPagedKVCacheWrapper(
        WS, num_ctas=2).plan([0, 1, 2], [0, 1, 4], [0, 1, 2, 3], [1, 5], 2, 1, 8, 1 << 30)),
    # 2**28 + 1 queries of one request times a group of 8 fused rows pass int32
    ("prefill_plan_fused_rows_over_int32", "qo_indptr", lambda d: C.BatchPrefillWithPagedKVCacheWrapper(
        WS, num_ctas=2).plan([0, (1 << 28) + 1], [0, 1], [0], [4], 8, 1, 8, 16)),
]
SCHED = [
    ("plan_num_ctas_float", "num_ctas", lambda: P.plan([1], [5], 2.7)),
    ("plan_num_ctas_zero", "num_ctas", lambda: P.plan([1], [5], 0)),
    ("simulate_num_ctas_zero", "num_ctas", lambda: S.simulate([1], [5], 0, "lpt")),
    ("simulate_negative_length", "kv_lens", lambda: S.simulate([1], [-5], 2, "one_per_cta")),
    ("compare_policies_num_ctas_zero", "num_ctas",
     lambda: S.compare_policies([S.make_workload("constant", 2, kv_len=8)], 0)),
    ("make_workload_negative", "kv_len", lambda: S.make_workload("constant", 2, kv_len=-3)),
    ("make_workload_batch", "batch", lambda: S.make_workload("constant", -1)),
    ("partial_buffer_bound_negative", "head_dim", lambda: P.partial_buffer_bound(1, 1, 1, -1)),
    ("smem_bytes_negative", "tile_kv", lambda: smem_bytes(16, -1, 64)),
    ("plan_from_indptr_empty_last", "paged_kv_last_page_len", lambda: P.plan_from_indptr([0, 1], [0, 0], [2], 4, 2)),
    ("plan_from_indptr_page_size_zero", "page_size", lambda: P.plan_from_indptr([0, 1], [0, 1], [2], 0, 2)),
]


def snapshot(d):
    return {k: v.copy() for k, v in d.items()}


def unchanged(d, before):
    return all(np.array_equal(d[k], before[k], equal_nan=True) for k in d)


@pytest.mark.parametrize("module", ["reference", "cuda"])
@pytest.mark.parametrize("rule,arg,call", RULES, ids=[r[0] for r in RULES])
def test_rule(module, rule, arg, call):
    d = inputs()
    before = snapshot(d)
    with pytest.raises((ValueError, TypeError)) as e:
        call(d, R if module == "reference" else C)
    assert str(e.value).startswith(arg + ":") or f"{arg}:" in str(e.value), str(e.value)
    assert unchanged(d, before)


@pytest.mark.parametrize("rule,arg,call", CUDA_ONLY, ids=[r[0] for r in CUDA_ONLY])
def test_cuda_rule(rule, arg, call):
    d = inputs()
    before = snapshot(d)
    with pytest.raises((ValueError, TypeError)) as e:
        call(d)
    assert str(e.value).startswith(arg + ":"), str(e.value)
    assert unchanged(d, before)


@pytest.mark.parametrize("rule,arg,call", SCHED, ids=[r[0] for r in SCHED])
def test_sched_rule(rule, arg, call):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(arg + ":"), str(e.value)


def test_empty_request_last_page_len_zero_is_accepted():
    """The settled contract: a request with no pages has last_page_len 0 (and KV length 0)."""
    d = inputs()
    o, lse = R.batch_decode_paged(d["q"][:1], d["cache"], [0, 0], np.zeros(0, np.int32), [0], return_lse=True)
    assert (o == 0).all() and np.isneginf(lse).all()
    o2, lse2 = C.batch_decode_paged(d["q"][:1], d["cache"], [0, 0], np.zeros(0, np.int32), [0], return_lse=True)
    assert (np.asarray(o2) == 0).all() and np.isneginf(np.asarray(lse2)).all()
    assert P.plan_from_indptr([0, 1], [0, 0], [0], 4, 2).kv_lens.tolist() == [0]


def test_merge_states_of_no_states_is_empty():
    o, lse = R.merge_states(np.zeros((3, 0, 2, 4), np.float32), np.zeros((3, 0, 2), np.float32))
    assert o.shape == (3, 2, 4) and (o == 0).all() and np.isneginf(lse).all()
