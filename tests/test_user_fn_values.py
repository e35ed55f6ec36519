"""A user ``score_mod`` / ``mask_mod`` reads values the kernels compile in (numba
freezes a function's closure cells and the globals it names, NumPy arrays
included).  When such a value changes between calls, the kernels must compute
with the new one, as the golden model does, and never reuse the code compiled
for the old one; while nothing changes, nothing is compiled again.

In the simulator a device function reads its globals live, so the end-to-end
checks below pass either way there; the checks on the Variant (a new function
object exactly when a value changed, hence a new compile on a GPU) are what
guard the GPU."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import cuda as C
from nbattn import reference as R
from nbattn.cuda.blocks.variants import cached_variant, kernel_variant
from brute import fresh

LIMIT = np.array([2, 5], np.int64)      # per request: how far back a query may look
BONUS = 0.0


def window_mask(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= LIMIT[b]


def bonus_score(score, b, h, q_idx, kv_idx):
    return score + BONUS * (kv_idx % 2)


def test_the_same_values_give_the_same_function_and_a_change_gives_a_new_one():
    global LIMIT
    LIMIT = np.array([2, 5], np.int64)
    a = kernel_variant(dict(mask_mod=window_mask))
    b = kernel_variant(dict(mask_mod=window_mask))
    assert a.mask_mod is b.mask_mod                          # nothing changed: one compile
    LIMIT[1] = 7                                             # a captured array changed in place
    c = kernel_variant(dict(mask_mod=window_mask))
    assert c.mask_mod is not a.mask_mod and c.mask_mod.__code__ is window_mask.__code__
    assert cached_variant(dict(mask_mod=window_mask)).mask_mod is c.mask_mod
    LIMIT[1] = 5                                             # back to the first values: a fresh copy again
    assert cached_variant(dict(mask_mod=window_mask)).mask_mod is not c.mask_mod


def test_a_changed_global_number_reaches_the_kernel():
    global BONUS
    rng, seed = fresh()
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 2, 8), (9, 2, 8), (9, 2, 8)))
    seen = set()
    for value in (0.0, 3.0, 0.0):
        BONUS = value
        var = cached_variant(dict(score_mod=bonus_score))
        seen.add(id(var.score_mod))
        got = C.single_prefill(q, k, v, score_mod=bonus_score)
        want = R.single_prefill(q, k, v, score_mod=bonus_score)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"BONUS={value} seed={seed}")
    assert len(seen) >= 2, "a changed global must give the kernels a new function"


def test_a_changed_captured_array_reaches_the_paged_decode():
    from brute import random_paged_batch
    rng, seed = fresh()
    b = random_paged_batch(rng, qo_lens=[1, 1], kv_lens=[9, 14], page_size=4, num_kv_heads=1, group=2, head_dim=8)
    for limit in ([2, 5], [8, 1]):
        LIMIT[:] = limit
        got = C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], mask_mod=window_mask)
        want = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], mask_mod=window_mask)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"LIMIT={limit} seed={seed}")


def test_the_plain_decode_call_never_remembers_a_call_with_user_functions():
    """The plain decode remembers its checks per input signature; with a user function
    it must not (the function's values are checked on every call instead)."""
    from nbattn.cuda import decode_call as DC
    from nbattn.variants import Variant
    q, cache = np.zeros((2, 2, 8), np.float32), np.zeros((3, 2, 4, 1, 8), np.float32)
    sig = lambda variant: DC._signature(q, cache, "numpy", "NHD", False, variant, None, None, None)  # noqa: E731
    assert sig({}) is not None and sig({"logits_soft_cap": 30.0}) is not None
    assert sig({"mask_mod": window_mask}) is None
    assert sig({"score_mod": bonus_score}) is None
    assert sig({"variant": Variant(score_mod=bonus_score)}) is None


# ---------------------------------------------------------------------------
# Captured device arrays (FlexAttention's captured tensors): read in place
# ---------------------------------------------------------------------------

def _doc_ids(rng, n):
    """Document ids of n tokens: a few documents of random lengths, in order."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)


def _brute_doc_attention(q, k, v, doc):
    """Each query attends to the keys of its own document, causally: float64 softmax."""
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(q.shape[2])
    qi, kj = np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    keep = (doc[qi] == doc[kj]) & (kj <= qi)
    s = np.where(keep[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v.astype(np.float64))


DOC = None                               # a device array of document ids, read by same_document


def same_document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def test_a_captured_device_array_is_read_where_it_lives_by_both_models():
    """A document mask from a device array of ids: the kernel and the golden model
    both read it at call time; an in-place change reaches both without a new
    function for the kernels (compiled code reads the array in place), and a new
    array bound to the name gives the kernels a new function."""
    global DOC
    from numba import cuda
    rng, seed = fresh()
    n = 14
    q, k, v = (rng.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(3))
    first, second = _doc_ids(rng, n), _doc_ids(rng, n)
    DOC = cuda.to_device(first)
    f1 = kernel_variant(dict(mask_mod=same_document)).mask_mod
    for doc in (first, second):
        DOC.copy_to_device(doc)                              # in place
        assert kernel_variant(dict(mask_mod=same_document)).mask_mod is f1
        want = _brute_doc_attention(q, k, v, doc)
        for impl in (C, R):
            got = impl.single_prefill(q, k, v, causal=True, mask_mod=same_document)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{impl.__name__} seed={seed}")
    DOC = cuda.to_device(first)                              # a new array under the name
    assert kernel_variant(dict(mask_mod=same_document)).mask_mod is not f1
    np.testing.assert_allclose(C.single_prefill(q, k, v, causal=True, mask_mod=same_document),
                               _brute_doc_attention(q, k, v, first), rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")


def test_the_golden_model_reads_host_copies_of_captured_torch_tensors():
    from nbattn.reference.masks import host_function
    torch = pytest.importorskip("torch")
    ids = torch.arange(6, dtype=torch.int32)

    def by_parity(b, h, q_idx, kv_idx):
        return ids[kv_idx] % 2 == 0

    assert host_function(by_parity) is by_parity           # a CPU tensor is already on the host
    from numba import cuda
    dev = cuda.to_device(np.arange(6, dtype=np.int32))

    def from_device(b, h, q_idx, kv_idx):
        return dev[kv_idx] % 2 == 0

    host = host_function(from_device)
    assert host is not from_device and isinstance(host.__closure__[0].cell_contents, np.ndarray)
    np.testing.assert_array_equal(host(0, 0, 0, np.arange(6)), np.arange(6) % 2 == 0)


def test_a_wrapper_refuses_to_run_a_plan_whose_user_function_values_changed():
    """plan() compiles the variant; when a value its mask_mod reads changes, run() says
    so, naming mask_mod, before any launch, and a new plan() computes with the new value."""
    from brute import random_paged_batch
    from nbattn.cuda.host import driver
    rng, seed = fresh()
    LIMIT[:] = [3, 6]
    b = random_paged_batch(rng, qo_lens=[1, 1], kv_lens=[9, 14], page_size=4, num_kv_heads=1, group=2,
                           head_dim=8)
    from numba import cuda
    w = C.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(1 << 20, np.uint8), num_ctas=4)
    plan = lambda: w.plan(b["indptr"], b["indices"], b["last"], 2, 1, 8, 4, q_data_type="float32",  # noqa: E731
                          mask_mod=window_mask)
    gold = lambda: R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],  # noqa: E731
                                        mask_mod=window_mask)
    plan()
    np.testing.assert_allclose(w.run(b["q"], b["cache"]), gold(), rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    LIMIT[1] = 2
    launched = []
    real_call = driver.BoundLaunch.__call__
    driver.BoundLaunch.__call__ = lambda *a, **kw: launched.append(1)
    try:
        with pytest.raises(ValueError, match="mask_mod: .* changed after plan"):
            w.run(b["q"], b["cache"])
    finally:
        driver.BoundLaunch.__call__ = real_call
    assert not launched, f"seed={seed}"
    plan()
    np.testing.assert_allclose(w.run(b["q"], b["cache"]), gold(), rtol=1e-5, atol=1e-5, err_msg=f"seed={seed}")
    LIMIT[:] = [2, 5]
