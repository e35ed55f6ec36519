"""Execute every teaching notebook top to bottom (nbclient), in the CUDA simulator.

The kernel is the Python running this test (the project's venv), not whatever
``python3`` kernel spec a machine happens to have installed: we hand nbclient a
kernel manager whose spec launches ``sys.executable -m ipykernel_launcher``,
and the first cell of every run reports the kernel's ``sys.prefix`` so the
test can prove it.

``NUMBA_ENABLE_CUDASIM`` is set to 1 for the kernel unless the caller chose a
value, so the notebooks take their small-shape path here (``nbattn`` would
also pick the simulator by itself on a machine without a GPU).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("jupytext")                      # notebooks/_build.py reads the .py sources

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))

PROBE = "import sys, json; print(json.dumps({'prefix': sys.prefix, 'executable': sys.executable}))"


class _ThisPythonSpecs(KernelSpecManager):
    """Every kernel name resolves to an ipykernel running on this interpreter."""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name=f"nbattn test ({sys.executable})", language="python",
                          resource_dir=str(NB_DIR))


def _load_builder():
    spec = importlib.util.spec_from_file_location("_nb_build", NB_DIR / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_notebooks_exist():
    build = _load_builder()
    names = {p.name for p in NOTEBOOKS}
    assert names == set(build.NOTEBOOKS), "notebooks/ and _build.NOTEBOOKS disagree"
    sources = {p.name for p in NB_DIR.glob("[0-9][0-9]_*.py")}
    assert sources == {build.source(n).name for n in build.NOTEBOOKS}, "a notebook without its .py source"


def test_notebooks_are_built_and_clean():
    """Every .ipynb is in sync with its paired .py source (what _build.py writes from it),
    and carries no outputs."""
    build = _load_builder()
    stale = build.stale()
    assert not stale, f"stale: {stale}: edit the .py, then run .venv/bin/python notebooks/_build.py"
    for name in build.NOTEBOOKS:
        path = NB_DIR / name
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name} has stored outputs"


def _execute(nb, monkeypatch, *, allow_errors: bool = False) -> float:
    """Run ``nb`` in place on this interpreter's ipykernel; returns seconds."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", os.environ.get("NUMBA_ENABLE_CUDASIM", "1"))
    km = KernelManager(kernel_name="python3", kernel_spec_manager=_ThisPythonSpecs())
    client = nbclient.NotebookClient(nb, km=km, timeout=600, kernel_name="python3",
                                     allow_errors=allow_errors,
                                     resources={"metadata": {"path": str(NB_DIR)}})
    t0 = time.perf_counter()
    client.execute()
    return time.perf_counter() - t0


def _tags(cell) -> list:
    return list(cell.get("metadata", {}).get("tags", []))


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    """Top to bottom, worked solutions included: every cell must succeed."""
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))
    elapsed = _execute(nb, monkeypatch)
    probe = json.loads(nb.cells[0].outputs[0]["text"])
    assert probe["prefix"] == sys.prefix, f"kernel ran on {probe['executable']}, not {sys.executable}"
    print(f"{path.name}: {elapsed:.1f} s")


def test_student_edition_drops_exactly_the_solutions(tmp_path):
    """``make student`` (``_build.py --student DIR``) writes every notebook minus its
    solution cells, and nothing else changes."""
    build = _load_builder()
    written = build.write_student(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in NOTEBOOKS)
    for path in NOTEBOOKS:
        full = nbformat.read(path, as_version=4)
        student = nbformat.read(tmp_path / path.name, as_version=4)
        assert any("solution" in _tags(c) for c in full.cells), f"{path.name} has no solutions"
        assert [c.source for c in student.cells] == \
            [c.source for c in full.cells if "solution" not in _tags(c)]


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_edition_checks_fail(path, monkeypatch):
    """The checks are real: in the student edition (worked solutions removed,
    the reader's placeholders left in), every check cell must fail."""
    build = _load_builder()
    nb = build.student_edition(nbformat.read(path, as_version=4))
    checks = [i for i, c in enumerate(nb.cells) if "check" in _tags(c)]
    assert checks, f"{path.name} has no exercise checks"
    assert sum("exercise" in _tags(c) for c in nb.cells) == len(checks)
    nb.cells = nb.cells[:checks[-1] + 1]                  # nothing after the last check matters
    _execute(nb, monkeypatch, allow_errors=True)
    passed = [c.source.splitlines()[0] for c in nb.cells
              if "check" in _tags(c) and not any(o.get("output_type") == "error" for o in c.outputs)]
    assert not passed, f"{path.name}: checks that pass with the placeholder left in: {passed}"
