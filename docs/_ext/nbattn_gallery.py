"""The ``nbattn-gallery`` directive: one section per registered figure.

Each entry shows the committed image from ``figures/``, its caption, the data
source, whether it is measured or modelled, and the GPU and date recorded in
every result file it draws from.
"""
from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

ROOT = Path(__file__).resolve().parents[2]
_FILE = re.compile(r"([A-Za-z0-9_]+)\.json")


def _files(source: str) -> list[str]:
    seen: list[str] = []
    for name in _FILE.findall(source):
        if name not in seen:
            seen.append(name)
    return seen


def describe(entry) -> dict:
    """Kind (measured / modelled), and GPU/date of every result file of one figure."""
    from nbattn.perf import results

    files = _files(entry.data_source)
    suites = {name: results.load_suite(name, ROOT / "benchmarks" / "results") for name in files}
    runs = [f"``{name}.json``: {s.gpu}, {s.date}" if s else f"``{name}.json``: not present"
            for name, s in suites.items()]
    if not files:
        kind = "modelled: no measured data (a model, a plan or the paper's published numbers)"
    elif not any(suites.values()):
        kind = "modelled: its result files are not present, so only the model is drawn"
    elif "model" in entry.data_source.lower():
        kind = "measured, drawn beside a model"
    else:
        kind = "measured"
    return {"kind": kind, "runs": runs}


class Gallery(SphinxDirective):
    has_content = False

    def run(self):
        from nbattn import figures

        lines: list[str] = []
        for entry in figures.registry():
            image = ROOT / "figures" / f"{entry.name}.png"
            info = describe(entry)
            lines += [entry.name, "-" * len(entry.name), ""]
            if image.is_file():
                rel = Path("/") / ".." / "figures" / image.name
                lines += [f".. figure:: {rel.as_posix()}", f"   :alt: {entry.name}", "   :width: 100%", "",
                          "   " + entry.caption.replace("\n", " "), ""]
            else:
                lines += [f"*(not rendered yet: run* ``nbattn figures`` *)*", "", entry.caption, ""]
            lines += [f":Measured or modelled: {info['kind']}",
                      f":Data source: {entry.data_source}"]
            if info["runs"]:
                lines += [":GPU and date: " + "; ".join(info["runs"])]
            lines += [""]
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="nbattn-gallery"), container)
        return list(container.children)


def setup(app):
    app.add_directive("nbattn-gallery", Gallery)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
