"""Pins the start-up decisions of nbattn._compat:
numpy-2.5's missing ``row_stack`` is aliased before numba.cuda compiles, and
the simulator is chosen when no GPU is usable."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import nbattn
from nbattn import _compat


def test_row_stack_alias_present_and_idempotent():
    assert hasattr(np, "row_stack")
    assert _compat.ensure_row_stack() is False        # already there: nothing to do
    a = np.ones((1, 2))
    np.testing.assert_array_equal(np.row_stack((a, a)), np.vstack((a, a)))


def test_row_stack_alias_installed_when_missing(monkeypatch):
    saved = np.__dict__.get("row_stack")
    monkeypatch.delitem(np.__dict__, "row_stack", raising=False)
    try:
        assert _compat.ensure_row_stack() is True
        assert np.row_stack is np.vstack
    finally:
        if saved is not None:
            np.row_stack = saved


def test_backend_matches_numba_cuda_configuration():
    from numba import cuda
    sim = bool(getattr(cuda, "simulator_init", None) is not None and _compat.simulator_enabled())
    assert nbattn.BACKEND in ("gpu", "simulator")
    if _compat.driver_gpu_count() == 0 and os.environ.get("NUMBA_ENABLE_CUDASIM", "1") != "0":
        assert nbattn.simulator_enabled() and sim
    from nbattn.cuda.blocks import primitives
    assert primitives.SIMULATOR == nbattn.simulator_enabled()


def test_user_choice_is_respected_in_a_fresh_process():
    code = "import nbattn, os; print(nbattn.BACKEND, os.environ['NUMBA_ENABLE_CUDASIM'])"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["simulator", "1"]
