"""The plain batch_decode_paged on the launch layer (device inputs), in the simulator:
bound launches reused across calls with other lengths, batch sizes, scales and
variants must still give the golden model's answer, and the call's Python work
must not grow with the batch."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401
from nbattn import reference as R
from nbattn.cuda import decode_call as DC
from nbattn.cuda import batch_decode_paged
from numba import cuda

from brute import random_paged_batch


def _batch(rng, lens, dtype=np.float16, group=2):
    b = random_paged_batch(rng, qo_lens=[1] * len(lens), kv_lens=lens, page_size=4, num_kv_heads=2,
                           group=group, head_dim=16, share_first_page=True)
    b["q"], b["cache"] = b["q"].astype(dtype), b["cache"].astype(dtype)
    return b


def _run(b, **kw):
    sig = kw.get("use_sigmoid", False)
    res = batch_decode_paged(cuda.to_device(b["q"]), cuda.to_device(b["cache"]), b["indptr"], b["indices"],
                             b["last"], return_lse=not sig, **kw)
    o, lse = (res, None) if sig else res
    o = o.copy_to_host()
    return o.view(b["q"].dtype) if o.dtype != b["q"].dtype else o, None if sig else lse.copy_to_host()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_device_inputs_match_golden_across_calls(dtype):
    rng = np.random.default_rng([71, np.dtype(dtype).itemsize])
    cases = [([0, 37, 5, 90], {}), ([300], {}),                     # unsplit, then split + merge
             ([12, 1], dict(sm_scale=0.2)),                          # same kernel, another scale
             ([250, 3, 0], dict(window_left=6, sink_size=1, logits_soft_cap=4.0)),
             ([41], dict(pos_encoding_mode="ALIBI")), ([200, 7], dict(use_sigmoid=True, sigmoid_bias=-1.0))]
    for lens, kw in cases:
        b = _batch(rng, lens, dtype)
        o, lse = _run(b, **kw)
        ro = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                  return_lse=lse is not None, dtype=np.float64, **kw)
        if lse is not None:
            ro, rlse = ro
            assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
            fin = np.isfinite(rlse)
            np.testing.assert_allclose(lse[fin], rlse[fin], atol=1e-3, rtol=1e-3)
        tol = 4e-3 if dtype == np.float16 else 1e-4
        np.testing.assert_allclose(o.astype(np.float64), ro, atol=tol * (1 + np.abs(ro).max()), rtol=tol)


def test_split_work_arrays_equal_the_loop():
    from nbattn.cuda.decode import split_work
    rng = np.random.default_rng(72)
    for chunk in (None, 1, 7, 64):
        lens = rng.integers(0, 200, size=int(rng.integers(1, 30)))
        a, b = split_work(lens, chunk), DC.split_work_arrays(lens, chunk)
        for x, y in zip(a[:-1], b[:-1]):
            np.testing.assert_array_equal(x, y)
        assert a[-1] == b[-1]


@pytest.mark.skipif(not __import__("nbattn").simulator_enabled(), reason="counts the simulator's Python calls; on a GPU numba's allocator adds calls of its own")
def test_python_work_does_not_grow_with_the_batch(monkeypatch):
    import sys
    from nbattn.cuda import _driver
    monkeypatch.setattr(_driver.BoundLaunch, "__call__", lambda self, stream=0: None)
    rng = np.random.default_rng(73)
    counts = []
    for n in (3, 60):
        b = _batch(rng, list(rng.integers(1, 12, size=n)))
        q, cache = cuda.to_device(b["q"]), cuda.to_device(b["cache"])
        batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"])         # binds
        calls = []

        def prof(frame, event, arg):
            # dataclass __eq__ runs where a cache lookup meets an equal, not identical, key: a
            # constant number of times, not once per request
            if event == "call" and frame.f_code.co_name != "__eq__":
                calls.append(frame.f_code.co_name)
        sys.setprofile(prof)
        try:
            batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"])
        finally:
            sys.setprofile(None)
        counts.append(len(calls))
    assert counts[0] == counts[1], counts
