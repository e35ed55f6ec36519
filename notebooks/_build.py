"""The teaching notebooks of nbattn: each ``NN_name.ipynb`` is paired (jupytext) with
``NN_name.py`` in the ``py:percent`` format, and the ``.py`` file is the source.

    .venv/bin/python notebooks/_build.py                # rewrite every .ipynb from its .py
    .venv/bin/python notebooks/_build.py --check        # exit 1 if a .ipynb is stale (writes nothing)
    .venv/bin/python notebooks/_build.py --student DIR  # the edition without worked solutions

In a ``.py`` source, ``# %%`` starts a code cell and ``# %% [markdown]`` a markdown cell
(its lines commented out); a cell's tags sit on its marker line:

* ``# %% tags=["exercise"]``  a placeholder for the reader;
* ``# %% jupyter={"source_hidden": true} tags=["solution"]``  a worked solution, collapsed
  in Jupyter: the committed notebooks run it, the student edition drops it;
* ``# %% tags=["check"]``  compares the answer with the golden model; fails if wrong.

The ``.ipynb`` files are written without outputs and with stable cell ids (``nb01-000``:
notebook and position), so rebuilding gives no diff unless a ``.py`` file changed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
PAIRING = "ipynb,py:percent"

NOTEBOOKS = [
    "01_online_softmax_and_merge.ipynb",
    "02_paged_kv_and_bsr.ipynb",
    "03_decode_kernel.ipynb",
    "04_prefill_and_roofline.ipynb",
    "05_scheduler.ipynb",
    "06_scheduler_on_the_gpu.ipynb",
    "07_variants.ipynb",
]


def source(name: str) -> Path:
    """The ``py:percent`` source of notebook ``name``."""
    return HERE / Path(name).with_suffix(".py").name


def make(name: str) -> nbformat.NotebookNode:
    """Notebook ``name`` as its ``.py`` source gives it: no outputs, stable cell ids."""
    nb = jupytext.read(source(name), fmt="py:percent")
    if nb.metadata.get("jupytext", {}).get("formats") != PAIRING:
        raise ValueError(f"{source(name).name} is not paired: its header needs formats: {PAIRING}")
    stem = name.split("_")[0]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"nb{stem}-{i:03d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.validate(nb)
    return nb


def render(nb) -> str:
    """The .ipynb text of ``nb``, as jupytext writes it to a file."""
    text = jupytext.writes(nb, fmt="ipynb")
    return text if text.endswith("\n") else text + "\n"


def _comparable(text: str) -> str:
    """An .ipynb text re-rendered without jupytext's own bookkeeping (its version stamp)."""
    nb = nbformat.reads(text, as_version=4)
    nb.metadata.get("jupytext", {}).pop("text_representation", None)
    return render(nb)


def stale() -> list[str]:
    """The notebooks whose .ipynb differs from what their .py source gives (writes nothing)."""
    out = []
    for name in NOTEBOOKS:
        path = HERE / name
        if not path.exists() or _comparable(path.read_text()) != render(make(name)):
            out.append(name)
    return out


def student_edition(nb) -> nbformat.NotebookNode:
    """A copy of ``nb`` without its worked solutions (cells tagged ``solution``):
    the exercise cells keep their placeholders, so every check fails until the
    student answers it. The copy is not paired with a .py file."""
    out = nbformat.reads(nbformat.writes(nb), as_version=4)
    out.cells = [c for c in out.cells if "solution" not in c.get("metadata", {}).get("tags", [])]
    out.metadata.pop("jupytext", None)
    return out


def write_student(outdir: Path) -> list[Path]:
    """Write the student edition of every notebook into ``outdir``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in NOTEBOOKS:
        path = outdir / name
        path.write_text(render(student_edition(make(name))))
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    if "--student" in argv:   # --student DIR: the edition without solutions (make student)
        i = argv.index("--student")
        outdir = Path(argv[i + 1]) if i + 1 < len(argv) else HERE.parent / "student-notebooks"
        for path in write_student(outdir):
            print("wrote", path)
        return 0
    if "--check" in argv:     # writes nothing
        if bad := stale():
            print("stale notebooks (edit the .py, then run notebooks/_build.py):", ", ".join(bad))
        return 1 if bad else 0
    for name in NOTEBOOKS:
        path, text = HERE / name, render(make(name))
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print("wrote", path.relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
