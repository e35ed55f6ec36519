"""Shared look of nbattn figures.

Figures are built on :class:`matplotlib.figure.Figure` directly (no pyplot), so
no GUI backend is ever touched and builders are safe to call in threads or
headless CI; saving goes through the Agg canvas.  matplotlib is imported only
when a figure is made.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

__all__ = [
    "IMPL_COLORS",
    "NO_DATA_NOTE",
    "context",
    "new_figure",
    "impl_color",
    "impl_label",
    "note_no_measured",
    "footer",
    "save",
    "has_no_data_note",
]

NO_DATA_NOTE = "no measured data yet"

# One colour per implementation, stable across figures so "cudnn" is always
# the same green.  Peers' names come from result files' ``peers`` keys.
IMPL_COLORS = {
    "nbattn": "#1f4e9c",
    # nbattn's other decode kernels, recorded as peers of the default one
    "nbattn_warp": "#5dade2",
    "nbattn_smem": "#a9cce3",
    "sdpa": "#e07b00",
    "flash": "#e07b00",
    "sdpa_flash": "#e07b00",
    "cudnn": "#2a9d3a",
    "sdpa_cudnn": "#2a9d3a",
    "flex": "#8e44ad",
    "flexattention": "#8e44ad",
    "efficient": "#b5651d",
    "sdpa_efficient": "#b5651d",
    "paper": "#222222",
    "model": "#666666",
}
_FALLBACK = ["#c0392b", "#16a085", "#7f8c8d", "#d35400", "#2c3e50", "#f39c12"]

_RC = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 7.5,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "lines.markersize": 5,
    "savefig.dpi": 150,
    "figure.dpi": 100,
}


def _mpl():
    # The Agg default must be chosen before pyplot is ever imported by anyone
    # in this process; harmless when a backend is already set.
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    return matplotlib


@contextlib.contextmanager
def context() -> Iterator[None]:
    """rcParams of the nbattn look; artists created inside pick them up."""
    mpl = _mpl()
    with mpl.rc_context(_RC):
        yield


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.4,
               height: float = 4.0, **subplot_kw):
    """A pyplot-free Figure and its axes (a single Axes when 1x1, else an array)."""
    _mpl()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=True, **subplot_kw)
    return fig, axes


def impl_color(name: str) -> str:
    """Colour of an implementation; unknown names get a stable fallback colour."""
    key = name.lower()
    if key in IMPL_COLORS:
        return IMPL_COLORS[key]
    for known, colour in IMPL_COLORS.items():
        if known in key:
            return colour
    return _FALLBACK[sum(map(ord, key)) % len(_FALLBACK)]


def impl_label(name: str) -> str:
    return {"sdpa": "SDPA", "flex": "FlexAttention", "cudnn": "cuDNN",
            "flash": "SDPA flash"}.get(name.lower(), name)


_NOTE_PLACES = {
    "upper center": (0.5, 0.97, "center", "top"),
    "lower center": (0.5, 0.03, "center", "bottom"),
    "center right": (0.97, 0.45, "right", "center"),
    "lower right": (0.97, 0.03, "right", "bottom"),
    "upper right": (0.97, 0.97, "right", "top"),
}


def note_no_measured(ax, detail: str = "", loc: str = "upper center"):
    """Stamp ``ax`` with the visible "no measured data yet" note.

    The text artist carries ``gid="no-measured-note"`` so tests and readers can
    tell a model-only figure from one with measurements.  ``loc`` is one of
    ``upper center``, ``lower center``, ``center right``, ``lower right``,
    ``upper right`` (placed in axes coordinates, clear of the data we know).
    """
    text = NO_DATA_NOTE + (f"\n{detail}" if detail else "")
    x, y, ha, va = _NOTE_PLACES[loc]
    return ax.text(x, y, text, transform=ax.transAxes, ha=ha, va=va,
                   fontsize=8.5, color="#9b1c1c", gid="no-measured-note",
                   bbox=dict(boxstyle="round,pad=0.3", fc="#fff4f4", ec="#9b1c1c", lw=0.8))


def footer(fig, text: str):
    """Small grey source line under the figure (which model, which result file).

    Drawn as the figure's ``supxlabel`` so the constrained layout makes room
    for it below the axes' own labels.
    """
    t = fig.supxlabel(text, x=0.01, ha="left", fontsize=6.5, color="#555555")
    t.set_gid("source-footer")
    return t


def save(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with context():
        fig.savefig(path, bbox_inches="tight")
    return path


def has_no_data_note(fig) -> bool:
    """True when any axes of ``fig`` carries the "no measured data yet" note."""
    return any(t.get_gid() == "no-measured-note" for ax in fig.axes for t in ax.texts)
