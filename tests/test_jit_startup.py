"""nbattn._jit.import_without_scipy: the first compiled call of a new process does not
import ``scipy.linalg`` (0.3-0.4 s where SciPy is installed), and numba's flag is what
its own import would have set: ``_HAVE_BLAS`` says whether SciPy can be imported.

CI has no SciPy, so the subprocess puts a stand-in ``scipy`` package on its path:
``scipy.linalg`` records that it was imported.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import sys, importlib
    import numpy as np
    plan = importlib.import_module("nbattn.sched.plan")
    plan.plan_lengths(np.ones(3, np.int64), np.array([5, 9, 2]), 4)
    import numba.np.arraymath as am
    print("linalg_after_first_call", "scipy.linalg" in sys.modules)
    print("have_blas", am._HAVE_BLAS)
    print("finders_left", sum(type(f).__name__ == "_NoScipy" for f in sys.meta_path))
""")


def _probe(tmp_path, with_scipy: bool) -> dict:
    env = dict(os.environ)
    paths = [os.getcwd()]
    if with_scipy:
        pkg = tmp_path / "scipy"
        (pkg / "linalg").mkdir(parents=True)
        (pkg / "__init__.py").write_text("__version__ = '1.99.0'\n")
        (pkg / "linalg" / "__init__.py").write_text("")
        (pkg / "linalg" / "cython_blas.py").write_text("")
        paths.insert(0, str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split() for line in out.stdout.splitlines() if line.count(" ") == 1)


@pytest.mark.parametrize("with_scipy", [True, False])
def test_the_first_compiled_call_does_not_import_scipy_linalg(tmp_path, with_scipy):
    got = _probe(tmp_path, with_scipy)
    assert got["linalg_after_first_call"] == "False"
    assert got["have_blas"] == str(with_scipy or importlib.util.find_spec("scipy") is not None)
    assert got["finders_left"] == "0"
