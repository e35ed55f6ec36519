"""Differential testing is one call: the golden model and the kernels take the
same keywords and input kinds and give back the same kind."""
from __future__ import annotations

import importlib
import types

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first)
from nbattn import cuda as C
from nbattn import reference as R


def qkv(rng, nq=3, nk=7, hq=4, hkv=2, d=8):
    return (rng.standard_normal((nq, hq, d)).astype(np.float32),
            rng.standard_normal((nk, hkv, d)).astype(np.float32),
            rng.standard_normal((nk, hkv, d)).astype(np.float32))


def test_same_keywords_both_sides():
    rng = np.random.default_rng()
    q, k, v = qkv(rng)
    kw = dict(causal=True, return_lse=True, stream=0, tensor_cores=None, dtype=np.float32)
    outs = []
    for M in (R, C):
        out, lse = np.zeros_like(q), np.zeros(q.shape[:2], np.float32)
        o, l = M.single_prefill(q, k, v, out=out, lse=lse, **kw)
        assert o is out and l is lse                     # out=/lse= filled and returned on both sides
        outs.append((out.copy(), lse.copy()))
    np.testing.assert_allclose(outs[0][0], outs[1][0], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=2e-4, rtol=2e-4)


def test_reference_reads_torch_bf16_and_gives_torch():
    rng = np.random.default_rng()
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in qkv(rng))
    o, lse = R.single_prefill(q, k, v, return_lse=True)
    assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
    o2, lse2 = C.single_prefill(q, k, v, return_lse=True)
    assert isinstance(o2, torch.Tensor) and o2.dtype == torch.bfloat16
    np.testing.assert_allclose(o.float().numpy(), o2.float().numpy(), atol=3e-2, rtol=3e-2)
    ms = R.merge_states(torch.stack([o2, o2], 1).unsqueeze(0)[0], torch.stack([lse2, lse2], 1))
    assert np.isfinite(ms.o).all()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window_left=2)])
def test_cuda_split_kv_matches_reference(kw):
    rng = np.random.default_rng()
    q, k, v = qkv(rng, nq=2, nk=9)
    cuts = np.array([0, 3, 3, 7, 9], np.int32)             # an empty chunk too
    got = C.split_kv(q, k, v, cuts, return_lse=True, **kw)
    want = R.split_kv(q, k, v, cuts, return_lse=True, **kw)
    np.testing.assert_allclose(got[0], want[0], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(got[1], want[1], atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="return_partials"):
        C.split_kv(q, k, v, cuts, return_partials=True)


def test_import_cascade_gives_the_module_and_it_still_runs():
    mod = importlib.import_module("nbattn.cuda.cascade")
    assert isinstance(mod, types.ModuleType) and C.cascade is mod
    assert callable(C.cascade) and callable(mod.cascade)


def test_merge_states_rounds_once():
    """fp16 states: the golden merge equals the float64 merge rounded once to fp16."""
    rng = np.random.default_rng()
    v = rng.standard_normal((64, 6, 2, 8)).astype(np.float16)
    s = (rng.standard_normal((64, 6, 2)) * 3).astype(np.float32)
    o, lse = R.merge_states(v, s)
    w = np.exp2(s.astype(np.float64) - s.max(1, keepdims=True))
    exact = (w[..., None] * v.astype(np.float64)).sum(1) / w.sum(1)[..., None]
    assert o.dtype == np.float16
    np.testing.assert_array_equal(o, exact.astype(np.float16))
