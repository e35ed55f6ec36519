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
