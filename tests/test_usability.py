"""Friendly edges of the public API: int64 metadata, "did you mean", the simulator notice."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import nbattn  # noqa: F401
from nbattn import layout as L
from nbattn import reference as R
from nbattn import variants

from test_layout import call, spec4

SIM_NOTICE = "numba.cuda kernels run in the CUDA simulator"


# --------------------------------------------------------------------------
# int64 metadata
# --------------------------------------------------------------------------

def test_int64_numpy_and_torch_metadata_match_int32():
    torch = pytest.importorskip("torch")
    b = spec4()
    want = call(b)
    for conv in (lambda a: a.astype(np.int64), lambda a: torch.from_numpy(a.astype(np.int64)),
                 lambda a: a.tolist()):
        got = call(b, **{k: conv(b[k]) for k in ("qo_indptr", "indptr", "indices", "last")})
        np.testing.assert_array_equal(got, want)


def test_int64_is_range_checked_and_float_refused():
    assert L.as_int32("x", np.array([0, 5], np.int64)).dtype == np.int32
    with pytest.raises(L.LayoutError, match="^x: values do not fit in int32"):
        L.as_int32("x", np.array([0, 2**31], np.int64))
    with pytest.raises(L.LayoutError, match="^x: values do not fit in int32"):
        L.as_int32("x", [0, -2**31 - 1])
    with pytest.raises(L.LayoutError, match="^x: must be int32"):
        L.as_int32("x", np.array([0.0, 1.0]))


def test_int64_on_the_device_is_refused_with_the_fix():
    class DeviceInt64:  # what a CUDA tensor / numba device array looks like to the check
        dtype = np.dtype(np.int64)
        __cuda_array_interface__ = {}

    with pytest.raises(L.LayoutError, match=r"^qo_indptr: must be int32 on the device.*torch.int32"):
        L.as_int32("qo_indptr", DeviceInt64())


# --------------------------------------------------------------------------
# did you mean
# --------------------------------------------------------------------------

@pytest.mark.parametrize("typo, meant", [("softcap", "logits_soft_cap"), ("windowleft", "window_left"),
                                         ("casual", "causal"), ("softmax_scale", "sm_scale"),
                                         ("is_causal", "causal")])
def test_unknown_keyword_suggests_the_right_one(typo, meant):
    b = spec4()
    with pytest.raises(TypeError, match=f"'{typo}' \\(did you mean '{meant}'\\?\\)"):
        R.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                              **{typo: 1})


def test_unrelated_keyword_gets_no_guess():
    msg = variants.unknown_keywords_message({"banana"})
    assert "did you mean" not in msg and "logits_soft_cap" in msg   # lists the real ones


# --------------------------------------------------------------------------
# the simulator notice appears where a kernel can run, and only there
# --------------------------------------------------------------------------

def _stderr(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stderr


@pytest.mark.skipif(nbattn._compat.driver_gpu_count() > 0, reason="a GPU: no simulator notice")
def test_simulator_notice_only_when_kernels_load():
    assert SIM_NOTICE not in _stderr("import nbattn, nbattn.reference, nbattn.layout")
    assert SIM_NOTICE not in _stderr("from nbattn import cli; cli.main(['demo'])")
    err = _stderr("import nbattn.cuda, nbattn.cuda.decode")
    assert err.count(SIM_NOTICE) == 1
