"""Roofline figures (docs/concepts/performance.md).

* :func:`roofline_figure`: rooflines of H200, H100 SXM and A100 SXM 80GB with
  model prefill/decode points and, when ``decode.json`` / ``prefill.json``
  exist, measured points of nbattn and its peers.
* :func:`intensity_figure`: operational intensity against ``l_q/l_kv`` for GQA
  groups 1, 4 and 8, with each GPU's ridge point.

Each ``*_figure`` returns a matplotlib Figure (tests read its data back); the
``build_*`` functions are the registry builders of :mod:`nbattn.figures`.
``results_root=None`` means "read no measured data".
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..perf import gpus as _gpus
from ..perf import roofline as rl
from ..perf.results import attention_shape, load_suite
from . import style

__all__ = [
    "measured_specs",
    "measured_points",
    "roofline_figure",
    "intensity_figure",
    "build_roofline",
    "build_intensity",
]

# Suites that may carry a re-measured copy ceiling, most specific first.
_BANDWIDTH_SUITES = ("copy", "decode", "prefill", "cascade", "sched")


def measured_specs(results_root) -> dict[str, tuple[_gpus.GPUSpec, str]]:
    """GPU specs with copy bandwidth taken from result files where they have it.

    Returns ``{name: (spec, where)}`` where ``where`` says where the bandwidth
    came from: ``"<suite>.json"``, ``"measured"`` (the H200's measured ceiling)
    or ``"datasheet"``.
    """
    out = {}
    for name, spec in _gpus.GPUS.items():
        where = "measured" if spec.bandwidth_is_measured else "datasheet"
        out[name] = (spec, where)
    if results_root is None:
        return out
    taken = set()
    for suite_name in _BANDWIDTH_SUITES:
        suite = load_suite(suite_name, results_root)
        if suite is None or suite.copy_bandwidth_GBps is None:
            continue
        base = _gpus.match_gpu(suite.gpu)
        if base is None or base.name in taken:
            continue
        taken.add(base.name)
        out[base.name] = (_gpus.with_copy_bandwidth(base, suite), f"{suite_name}.json")
    return out


def _record_tflops(value: float, metric: str, shape: dict, bandwidth_GBps: float) -> tuple[float, float] | None:
    """(intensity, achieved TFLOP/s) of one measured value, or None if not placeable."""
    kw = dict(head_dim=shape["head_dim"], num_qo_heads=shape["num_qo_heads"])
    flops = shape["batch"] * rl.attention_flops(shape["l_q"], shape["l_kv"],
                                                causal=shape["causal"], **kw)
    nbytes = shape["batch"] * rl.attention_bytes(
        shape["l_q"], shape["l_kv"], num_kv_heads=shape["num_kv_heads"],
        bytes_per_elem=shape["bytes_per_elem"], **kw)
    intensity = float(flops / nbytes)
    if metric == "tflops":
        tflops = value
    elif metric == "bw_fraction":
        tflops = value * bandwidth_GBps * intensity * 1e-3
    elif metric == "latency_us":
        if value <= 0:
            return None
        tflops = flops / (value * 1e-6) * 1e-12
    else:
        return None
    return intensity, float(tflops)


def measured_points(results_root) -> list[dict]:
    """Measured roofline points from ``decode.json`` and ``prefill.json``.

    One entry per (suite, implementation): ``{"suite", "impl", "gpu",
    "x": intensities, "y": TFLOP/s}``.  nbattn's own value and every peer in
    ``peers`` are placed with the same shape, so they share an x position.
    ``bw_fraction`` is turned into FLOP/s through the suite's own copy
    bandwidth; records without a usable shape are skipped.
    A record of the ablation without split-KV (case ``split: "unsplit"``) is
    its own series, ``nbattn_unsplit``; its peers repeat the split record's
    and are not placed twice.
    """
    if results_root is None:
        return []
    series: dict[tuple[str, str], dict] = {}
    for suite_name, default_l_q, metrics in (("decode", 1, ("bw_fraction", "tflops", "latency_us")),
                                             ("prefill", None, ("tflops", "latency_us"))):
        suite = load_suite(suite_name, results_root)
        if suite is None:
            continue
        spec = _gpus.match_gpu(suite.gpu) or _gpus.H200
        bw = suite.copy_bandwidth_GBps or spec.copy_bandwidth_GBps
        for metric in metrics:
            recs = suite.select(metric)
            if not recs:
                continue
            for rec in recs:
                shape = attention_shape(rec.case, default_l_q=default_l_q)
                if shape is None:
                    continue
                if str(rec.case.get("split", "")).lower() == "unsplit":
                    values = {"nbattn_unsplit": rec.value}
                else:
                    values = {"nbattn": rec.value, **rec.peers}
                for impl, value in values.items():
                    if value is None:
                        continue
                    pt = _record_tflops(value, metric, shape, bw)
                    if pt is None:
                        continue
                    s = series.setdefault((suite_name, impl), {
                        "suite": suite_name, "impl": impl, "gpu": suite.gpu, "x": [], "y": []})
                    s["x"].append(pt[0])
                    s["y"].append(pt[1])
            break  # one metric per suite, the first present, so points are not doubled
    return list(series.values())


# Model shapes (a Llama-like layer: 32 query heads, head_dim 128, fp16).
_MODEL_POINTS = (
    ("decode MHA (l_kv 4k)", dict(l_q=1, l_kv=4096, num_qo_heads=32, num_kv_heads=32), "v"),
    ("decode GQA-8 (l_kv 4k)", dict(l_q=1, l_kv=4096, num_qo_heads=32, num_kv_heads=4), "^"),
    ("prefill 8k x 8k causal", dict(l_q=8192, l_kv=8192, num_qo_heads=32, num_kv_heads=32,
                                    causal=True), "D"),
    ("prefill 512 x 4k", dict(l_q=512, l_kv=4096, num_qo_heads=32, num_kv_heads=8), "P"),
)


def roofline_figure(results_root=None):
    """Roofline of the three GPUs with model points and any measured points."""
    specs = measured_specs(results_root)
    points = measured_points(results_root)
    with style.context():
        fig, ax = style.new_figure(width=10.5, height=4.8)
        x = np.geomspace(0.25, 4096, 400)
        line_styles = {"H200": "-", "H100 SXM": "--", "A100 SXM 80GB": ":"}
        for name, (spec, where) in specs.items():
            bw = spec.copy_bandwidth_GBps
            ax.plot(x, rl.attainable_tflops(x, spec.tensor_tflops, bw),
                    color="black", ls=line_styles.get(name, "-"), lw=1.3,
                    label=f"{name}: {bw:,.0f} GB/s ({where}), {spec.tensor_tflops:g} TFLOP/s",
                    gid=f"roof:{name}")
        h200, _ = specs["H200"]
        if h200.measured_bf16_matmul_tflops:
            ax.axhline(h200.measured_bf16_matmul_tflops, color="#999999", lw=0.9, ls="-.",
                       label=f"H200 bf16 matmul, measured: "
                             f"{h200.measured_bf16_matmul_tflops:g} TFLOP/s")
        for label, kw, marker in _MODEL_POINTS:
            inten = rl.operational_intensity(head_dim=128, **kw)
            perf = rl.attainable_tflops(inten, h200.tensor_tflops, h200.copy_bandwidth_GBps)
            ax.plot([inten], [perf], marker=marker, ls="none", mfc="white",
                    mec=style.IMPL_COLORS["model"], mew=1.3, ms=7,
                    label=f"model on H200: {label}", gid=f"model:{label}")
        markers = {"decode": "o", "prefill": "s"}
        for s in points:
            unsplit = s["impl"] == "nbattn_unsplit"
            label = ("nbattn without split-KV (ablation)" if unsplit
                     else style.impl_label(s["impl"]))
            ax.scatter(s["x"], s["y"], marker="x" if unsplit else markers[s["suite"]],
                       s=30 if unsplit else 22,
                       color="#7f1d1d" if unsplit else style.impl_color(s["impl"]),
                       alpha=0.85, zorder=3,
                       label=f"{label} ({s['suite']}.json, {s['gpu']})",
                       gid=f"measured:{s['suite']}:{s['impl']}")
        if not points:
            style.note_no_measured(ax, "points are the model; measured points come from "
                                   "benchmarks/results/decode.json, prefill.json",
                                   loc="lower center")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlim(x[0], x[-1])
        lowest = min((min(s["y"]) for s in points if s["y"]), default=0.5)
        ax.set_ylim(min(0.5, lowest / 2), 2000)         # no measured point sits on the floor
        ax.set_xlabel("operational intensity (FLOP / byte)")
        ax.set_ylabel("attainable / achieved TFLOP/s")
        ax.set_title("Attention roofline: decode is memory-bound, prefill compute-bound")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                  fontsize="small")                   # beside the axes: it covers no data
        style.footer(fig, "model: FLOPs 4*l_q*l_kv*d per head, bytes b*d*(2*l_q*H_qo+2*l_kv*H_kv); "
                          "roofs: datasheet peaks, bandwidth as labelled")
    return fig


def intensity_figure(results_root=None):
    """Operational intensity vs ``l_q/l_kv`` for GQA groups 1, 4, 8 (model only)."""
    specs = measured_specs(results_root)
    l_kv = 8192
    l_q = np.unique(np.geomspace(1, l_kv, 200).round()).astype(np.int64)
    with style.context():
        fig, ax = style.new_figure(width=6.4, height=4.2)
        colours = {1: "#1f4e9c", 4: "#2a9d3a", 8: "#c0392b"}
        for group in (1, 4, 8):
            inten = rl.operational_intensity(l_q, l_kv, head_dim=128, num_qo_heads=32,
                                             num_kv_heads=32 // group)
            ax.plot(l_q / l_kv, inten, color=colours[group],
                    label=f"group {group} (32 q heads / {32 // group} kv heads)",
                    gid=f"intensity:group{group}")
            approx = rl.intensity_approx(l_q, l_kv, group=group)
            ax.plot(l_q / l_kv, approx, color=colours[group], ls=":", lw=1.0,
                    label="dotted: closed form (2/b)*l_q*l_kv/(l_q+l_kv)*group"
                    if group == 1 else None)
        ridge_styles = {"H200": "-", "H100 SXM": "--", "A100 SXM 80GB": ":"}
        for name, (spec, where) in specs.items():
            ridge = spec.ridge_intensity()
            ax.axhline(ridge, color="black", lw=0.8, ls=ridge_styles.get(name, "-."),
                       label=f"{name} ridge: {ridge:.0f} FLOP/byte ({where} bandwidth)",
                       gid=f"ridge:{name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel(f"l_q / l_kv   (l_kv = {l_kv}, head_dim 128, fp16)")
        ax.set_ylabel("operational intensity (FLOP / byte)")
        ax.set_title("Decode sits at ~group FLOP/byte; prefill grows with length")
        ax.legend(loc="lower right")
        style.footer(fig, "model only: exact ratio solid, (2/b)*l_q*l_kv/(l_q+l_kv)*group dotted")
    return fig


def build_roofline(path: Path, results_root: Path) -> None:
    style.save(roofline_figure(results_root), path)


def build_intensity(path: Path, results_root: Path) -> None:
    style.save(intensity_figure(results_root), path)
