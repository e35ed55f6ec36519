"""Sphinx configuration of the nbattn documentation site (``make docs``).

At start-up this file copies the teaching notebooks into ``docs/notebooks/``
(MyST-NB executes them there, in the CUDA simulator when there is no GPU) and
zips their student edition into ``docs/_generated/`` for download.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(ROOT))

import nbattn  # noqa: E402  (picks GPU or simulator before numba.cuda loads)

project = "nbattn"
author = "the nbattn authors"
copyright = "the nbattn authors"
release = version = nbattn.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "nbattn_gallery",
]
exclude_patterns = ["_build", "_generated", "jupyter_execute", "**.ipynb_checkpoints", ".gitignore"]

html_theme = "furo"
html_title = f"nbattn {release}"
html_static_path: list[str] = []

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

# The notebooks run at build time; the cache makes a rebuild without changes quick.
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True


def _load_notebook_builder():
    spec = importlib.util.spec_from_file_location("_nb_build", ROOT / "notebooks" / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy_if_changed(src: Path, dst: Path) -> None:
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
        shutil.copyfile(src, dst)


def _prepare_notebooks() -> None:
    out = DOCS / "notebooks"
    out.mkdir(exist_ok=True)
    sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for nb in sources:
        _copy_if_changed(nb, out / nb.name)
    for stale in out.glob("[0-9][0-9]_*.ipynb"):         # a notebook renamed or removed since the last build
        if stale.name not in {nb.name for nb in sources}:
            stale.unlink()
    gen = DOCS / "_generated"
    gen.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = _load_notebook_builder().write_student(Path(tmp))
        with zipfile.ZipFile(gen / "nbattn-student-notebooks.zip", "w", zipfile.ZIP_DEFLATED) as z:
            for p in paths:
                z.write(p, f"nbattn-student-notebooks/{p.name}")


_prepare_notebooks()
