"""Figures that set the performance models beside the paper's reported numbers.

Measured data come only through :mod:`nbattn.perf.results`.  The case keys the
figures read (other keys are ignored, common alternative spellings are
accepted, see :func:`nbattn.perf.results.attention_shape`):

=====================  ===============  =========================================
figure                 file / metric    case keys
=====================  ===============  =========================================
shared-prefix traffic  cascade.json     ``batch``, ``prefix_len``, ``suffix_len``
                       ``speedup``      (speedup = naive time / cascade time)
page size 1 vs         prefill.json     ``page_size`` (1 = paged with one-token
contiguous             ``tflops``;      pages; 0, or ``layout: "contiguous"``,
                       decode.json      = contiguous KV), ``batch``, ``kv_len``
                       ``bw_fraction``
decode bandwidth       decode.json      ``batch``, ``kv_len``; peers
                       ``bw_fraction``  (``sdpa``, ``flex``, ``cudnn``, ...)
split-KV speedup       decode.json      ``batch``, ``kv_len``
                       ``split_speedup`` (= no-split time / split time)
planning break-even    sched.json       any (plan cost per step, microseconds)
                       ``plan_us``
=====================  ===============  =========================================

When a file or metric is absent the figure shows the model and the note
"no measured data yet"; nothing is ever filled in.  ``results_root=None``
means "read no measured data".
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from ..perf import gpus as _gpus
from ..perf import roofline as rl
from ..perf.results import Record, attention_shape, case_get, load_suite
from . import style

__all__ = [
    "PAPER",
    "page_layout",
    "shared_prefix_figure",
    "page_size_figure",
    "decode_bandwidth_figure",
    "split_kv_figure",
    "breakeven_figure",
    "amdahl_figure",
    "build_shared_prefix",
    "build_page_size",
    "build_decode_bandwidth",
    "build_split_kv",
    "build_breakeven",
    "build_amdahl",
]

# The paper's numbers, as it reports them (FlashInfer v0.2).
PAPER = {
    # Shared-prefix kernel latency, suffix 128 (App. Table 5).
    "cascade": [
        {"batch": 64, "prefix_len": 32768, "suffix_len": 128,
         "naive_us": 4090.0, "cascade_us": 254.54, "speedup": 16.07},
        {"batch": 16, "prefix_len": 1024, "suffix_len": 128,
         "naive_us": 46.52, "cascade_us": 45.17, "speedup": 1.03},
    ],
    # Page size 1 vs contiguous, batch 1, 32768 prefill, TFLOP/s (App. B, H100).
    "page_size_prefill": {"FA2 template": (370.0, 347.0), "FA3 template": (627.0, 532.0)},
    "page_size_kv_len": 32768,
    # Load-balancing ablation, ITL change (Llama 3.1 8B, H100).
    "load_balance_itl": {"ShareGPT": -2.18, "short-variable": -2.49, "long-variable": -37.87},
    # FlashDecoding: split-KV over non-split at small batch and long context.
    "flashdecoding_range": (2.0, 8.0),
}

_LAYERS = {"Llama 3.1 8B (32 layers)": 32, "Llama 3.1 70B (80 layers)": 80}


def page_layout(case) -> str | None:
    """``"contiguous"``, ``"page N"`` or None (unknown) for a benchmark case."""
    layout = str(case_get(case, "layout", "kv_storage", "storage", default="")).lower()
    if layout in ("contiguous", "dense", "ragged"):
        return "contiguous"
    ps = case_get(case, "page_size")
    if ps is None:
        return None
    ps = int(ps)
    return "contiguous" if ps <= 0 else f"page {ps}"


def _batch(case) -> int:
    return int(case_get(case, "batch", "batch_size", "bs", "n", default=1))


def _kv_len(case):
    v = case_get(case, "kv_len", "l_kv", "kv_length", "context_len", "seq_len")
    return None if v is None else int(v)


def _source(suite) -> str:
    return f"{suite.suite}.json ({suite.gpu}, {suite.date})"


def _cpu_source(suite) -> str:
    """Source of a CPU-side time: the planner runs on the host, whichever GPU the file names."""
    if "cpu" in suite.gpu.lower() or suite.gpu.lower().startswith("none"):
        where = "CPU"
    else:
        where = f"CPU of the {suite.gpu} machine"
    return f"{suite.suite}.json, {where}, {suite.date}"


# --------------------------------------------------------------------------
# Shared-prefix traffic vs cascade speedup
# --------------------------------------------------------------------------

def shared_prefix_figure(results_root=None, suffix_len: int = 128):
    """Traffic ratio ``n(P+S)/(P+nS)`` vs measured cascade speedup and App. Table 5."""
    suite = None if results_root is None else load_suite("cascade", results_root)
    measured = defaultdict(list)  # prefix_len -> [(batch, speedup)]
    if suite is not None:
        for r in suite.select("speedup"):
            p = case_get(r.case, "prefix_len", "prefix", "P")
            if p is None:
                continue
            measured[(int(p), int(case_get(r.case, "suffix_len", "suffix", "S",
                                            default=suffix_len)))].append((_batch(r.case), r.value))
    prefixes = sorted({(1024, suffix_len), (32768, suffix_len)} | set(measured))
    palette = ["#1f4e9c", "#c0392b", "#2a9d3a", "#8e44ad", "#e07b00", "#16a085"]
    n = np.unique(np.geomspace(1, 256, 60).round())
    with style.context():
        fig, ax = style.new_figure(width=6.6, height=4.3)
        for i, (p, s) in enumerate(prefixes):
            c = palette[i % len(palette)]
            ax.plot(n, rl.prefix_traffic_ratio(n, p, s), color=c,
                    label=f"model n(P+S)/(P+nS), P={p}, S={s}", gid=f"model:P{p}:S{s}")
            if (p, s) in measured:
                pts = sorted(measured[(p, s)])
                ax.plot([b for b, _ in pts], [v for _, v in pts], "o", color=c, ms=6,
                        label=f"ours, P={p} ({_source(suite)})", gid=f"measured:P{p}:S{s}")
        colour_of = {ps: palette[i % len(palette)] for i, ps in enumerate(prefixes)}
        for row in PAPER["cascade"]:
            ps = (row["prefix_len"], row["suffix_len"])
            ax.plot([row["batch"]], [row["speedup"]], "*", ms=12, mec="black", mew=0.6,
                    color=colour_of.get(ps, style.IMPL_COLORS["paper"]),
                    gid=f"paper:P{row['prefix_len']}")
            ax.annotate(f"paper: {row['naive_us']:g} -> {row['cascade_us']:g} us "
                        f"({row['speedup']:g}x)\nbatch {row['batch']}, P={row['prefix_len']}",
                        (row["batch"], row["speedup"]), textcoords="offset points",
                        xytext=(8, -22) if row["speedup"] > 2 else (-8, 8),
                        ha="left" if row["speedup"] > 2 else "right", fontsize=7)
        ax.plot([], [], "*", color="white", mec="black", ms=10,
                label="paper App. Table 5, suffix 128")
        if not measured:
            style.note_no_measured(ax, "measured cascade speedups come from\n"
                                   "benchmarks/results/cascade.json", loc="lower right")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("requests sharing the prefix (n)")
        ax.set_ylabel("speedup of prefix reuse (x)")
        # measured slowdowns (speedup < 1: cascade overhead beats a short shared prefix) stay in view
        lowest = min((v for pts in measured.values() for _, v in pts), default=1.0)
        ax.set_ylim(min(0.8, 0.8 * lowest), None)
        ax.set_title("Shared prefix: traffic saved bounds the cascade speedup")
        ax.legend(loc="upper left")
        style.footer(fig, "model: KV-token traffic; paper: shared-prefix latencies")
    return fig


# --------------------------------------------------------------------------
# Page size 1 vs contiguous
# --------------------------------------------------------------------------

def _paired_prefill(records: list[Record]):
    """nbattn TFLOP/s for contiguous and page-1 KV at one batch-1 length, or None."""
    by_layout = defaultdict(dict)  # layout -> kv_len -> value
    for r in records:
        lay = page_layout(r.case)
        kv = _kv_len(r.case)
        if lay not in ("contiguous", "page 1") or kv is None or _batch(r.case) != 1:
            continue
        by_layout[lay][kv] = r.value
    if not by_layout:
        return None
    common = set(by_layout.get("contiguous", {})) & set(by_layout.get("page 1", {}))
    pool = common or set().union(*(d.keys() for d in by_layout.values()))
    target = PAPER["page_size_kv_len"]
    kv = target if target in pool else max(pool)
    return kv, by_layout.get("contiguous", {}).get(kv), by_layout.get("page 1", {}).get(kv)


def page_size_figure(results_root=None):
    """Page size 1 vs contiguous KV: paper App. B beside our prefill and decode."""
    prefill = None if results_root is None else load_suite("prefill", results_root)
    decode = None if results_root is None else load_suite("decode", results_root)
    ours = _paired_prefill(prefill.select("tflops")) if prefill is not None else None
    with style.context():
        fig, (ax, bx) = style.new_figure(1, 2, width=9.6, height=4.0)
        groups = [(f"{k}\n(paper, H100)", v) for k, v in PAPER["page_size_prefill"].items()]
        # Our slot is always drawn, empty until prefill.json has the numbers.
        groups.append((f"nbattn\n(ours, {prefill.gpu})" if ours else "nbattn\n(ours)",
                       (ours[1], ours[2]) if ours else (None, None)))
        xs = np.arange(len(groups))
        w = 0.38
        for j, (lay, colour) in enumerate((("contiguous", "#1f4e9c"), ("page size 1", "#e07b00"))):
            heights = [np.nan if g[1][j] is None else g[1][j] for g in groups]
            bars = ax.bar(xs + (j - 0.5) * w, heights, w, color=colour, label=lay,
                          gid=f"bars:{lay}")
            for b, h in zip(bars, heights):
                if np.isfinite(h):
                    ax.text(b.get_x() + b.get_width() / 2, h, f"{h:.0f}", ha="center",
                            va="bottom", fontsize=7)
        for x, (_, (c, p)) in zip(xs, groups):
            if c and p:
                ax.text(x, max(c, p) * 1.08, f"{(p - c) / c * 100:+.1f}%", ha="center",
                        fontsize=8, color="#9b1c1c")
        ax.set_xticks(xs, [g[0] for g in groups])
        ax.set_ylabel("prefill TFLOP/s")
        kv_note = f"batch 1, length {ours[0] if ours else PAPER['page_size_kv_len']}"
        ax.set_title(f"Prefill, {kv_note}")
        top = max(v for _, pair in groups for v in pair if v is not None)
        ax.set_ylim(0, top * 1.3)
        ax.legend(loc="upper left")
        if ours is None:
            style.note_no_measured(ax, "ours: prefill.json\n(metric tflops,\ncase page_size 0/1)",
                                   loc="center right")

        # decode rows with page size 0/1: decode.json's, or prefill.json's App. B pair
        # (page size 1 measured with the contiguous run as its same-run peer)
        series = defaultdict(list)
        shown = None
        for suite in (decode, prefill):
            for r in (suite.select("bw_fraction") if suite is not None else ()):
                lay, kv = page_layout(r.case), _kv_len(r.case)
                if lay not in ("contiguous", "page 1") or kv is None:
                    continue
                shown = shown or suite
                series[(lay, _batch(r.case))].append((kv, r.value))
                if lay == "page 1" and r.peers.get("contiguous") is not None:
                    series[("contiguous", _batch(r.case))].append((kv, r.peers["contiguous"]))
        for (lay, batch), pts in sorted(series.items()):
            pts.sort()
            bx.plot([k for k, _ in pts], [v for _, v in pts], marker="o",
                    color="#1f4e9c" if lay == "contiguous" else "#e07b00",
                    ls="-" if lay == "contiguous" else "--",
                    label=f"nbattn {lay}, batch {batch}", gid=f"decode:{lay}:b{batch}")
        bx.axhline(1.0, color="black", lw=0.8)
        bx.set_ylim(0, 1.15)
        bx.set_xscale("log", base=2)
        bx.set_xlabel("KV length")
        bx.set_ylabel("decode bandwidth / copy bandwidth")
        bx.set_title("Decode: paper reports about the same bandwidth")
        if series:
            bx.legend(loc="lower right")
            bx.text(0.02, 0.02, f"ours: {_source(shown)}", transform=bx.transAxes, fontsize=7)
        else:
            bx.set_xlim(512, 131072)
            style.note_no_measured(bx, "ours: benchmarks/results/decode.json or prefill.json\n"
                                   "(metric bw_fraction, case page_size 0/1)", loc="lower center")
        style.footer(fig, "paper: App. B (FA2/FA3 templates, H100); "
                          "ours: measured only, never modelled")
    return fig


# --------------------------------------------------------------------------
# Decode bandwidth utilization vs KV length
# --------------------------------------------------------------------------

def decode_bandwidth_figure(results_root=None):
    """Decode bandwidth / copy bandwidth vs KV length: nbattn and its peers, one panel per batch."""
    suite = None if results_root is None else load_suite("decode", results_root)
    recs = [] if suite is None else suite.select("bw_fraction")
    recs = [r for r in recs if _kv_len(r.case) is not None]
    # Page-size sweeps have their own figure; keep one layout here, the commonest.
    layouts = defaultdict(int)
    for r in recs:
        layouts[page_layout(r.case)] += 1
    if len(layouts) > 1:
        keep = max(layouts, key=lambda k: (layouts[k], k == "contiguous"))
        recs = [r for r in recs if page_layout(r.case) == keep]
    batches = sorted({_batch(r.case) for r in recs})[:4] or [1, 64]
    kv_model = np.geomspace(512, 131072, 60)
    with style.context():
        fig, axes = style.new_figure(1, len(batches), width=3.3 * len(batches) + 0.6,
                                     height=3.8, sharey=True)
        axes = np.atleast_1d(axes)
        for ax, batch in zip(axes, batches):
            panel = [r for r in recs if _batch(r.case) == batch]
            shape = attention_shape(panel[0].case, default_l_q=1) if panel else None
            heads = dict(num_qo_heads=shape["num_qo_heads"], num_kv_heads=shape["num_kv_heads"],
                         head_dim=shape["head_dim"]) if shape else \
                dict(num_qo_heads=32, num_kv_heads=8, head_dim=128)
            spec = (_gpus.match_gpu(suite.gpu) if suite else None) or _gpus.H200
            for split, ls in ((True, "-"), (False, ":")):
                ax.plot(kv_model, rl.decode_bandwidth_model(batch, kv_model, split=split,
                                                            num_sms=spec.num_sms, **heads),
                        color=style.IMPL_COLORS["model"], ls=ls, lw=1.0,
                        label=f"model, {'split-KV' if split else 'no split'}",
                        gid=f"model:b{batch}:{'split' if split else 'nosplit'}")
            impls = ["nbattn"] + sorted({p for r in panel for p in r.peers})
            # One line per (implementation, GQA group); unsplit runs of a split
            # kernel belong to the split-KV figure, not here.
            panel = [r for r in panel if r.case.get("split") != "unsplit"]
            groups = sorted({r.case.get("group") for r in panel}, key=lambda g: (g is None, g))
            # A panel measured at one KV length only (batch 1) is a column of markers:
            # spread the implementations a little sideways so none hides another.
            one_length = len({_kv_len(r.case) for r in panel}) == 1
            for gi, group in enumerate(groups):
                rows = [r for r in panel if r.case.get("group") == group]
                tag = "" if len(groups) == 1 else f", group {group}"
                for ii, impl in enumerate(impls):
                    pts = [(_kv_len(r.case), r.value if impl == "nbattn" else r.peers.get(impl))
                           for r in rows]
                    pts = sorted((k, v) for k, v in pts if v is not None)
                    if not pts:
                        continue
                    dodge = 2.0 ** (0.12 * (ii - (len(impls) - 1) / 2)) if one_length else 1.0
                    mine = impl == "nbattn"          # drawn last and larger: always visible
                    ax.plot([k * dodge for k, _ in pts], [v for _, v in pts],
                            marker="os^v"[gi % 4], ms=6 if mine else 4,
                            mec="white" if mine else None, mew=0.8 if mine else None,
                            zorder=5 if mine else 3,
                            ls=["-", "--", "-.", ":"][gi % 4],
                            color=style.impl_color(impl), label=style.impl_label(impl) + tag,
                            gid=f"measured:b{batch}:{impl}" + (f":g{group}" if tag else ""))
            ax.axhline(1.0, color="black", lw=0.6, zorder=0)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("KV length")
            ax.set_title(f"batch {batch}")
            if not panel:
                style.note_no_measured(ax, "benchmarks/results/decode.json", loc="upper center")
        axes[0].set_ylabel("achieved / copy bandwidth")
        axes[0].set_ylim(0, 1.25)
        # One legend for all panels, outside them, so no data is covered.
        handles = {}
        for ax in axes:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lab, h)
        fig.legend(handles.values(), handles.keys(), loc="outside right upper")
        src = _source(suite) if recs else "none yet"
        style.footer(fig, f"measured: {src}; 1.0 = copy bandwidth of the same run; "
                          "grey: occupancy model (heads of the first case, else 32 q / 8 kv, "
                          "head_dim 128)." + ("\nbatch 1: one KV length; the implementations "
                                              "are spread sideways so that none hides another"
                                              if 1 in batches and recs else ""))
    return fig


# --------------------------------------------------------------------------
# Split-KV speedup vs batch
# --------------------------------------------------------------------------

def _split_speedups_from_bw(suite) -> dict:
    """Split-KV speedups from ``bw_fraction`` records measured both ways in one
    run: same bytes, so the speedup is the ratio of the two fractions."""
    unsplit, split = {}, {}
    for r in suite.select("bw_fraction"):
        key = (_kv_len(r.case), r.case.get("group"), _batch(r.case))
        if None in key[:1] or "split" not in r.case:
            continue
        (unsplit if r.case["split"] == "unsplit" else split)[key] = r.value
    out = defaultdict(list)
    for key, v in unsplit.items():
        if key in split and v > 0:
            out[key[:2]].append((key[2], split[key] / v))
    return out


def split_kv_figure(results_root=None):
    """Split-KV speedup over a non-split kernel vs batch size: measured or modelled."""
    suite = None if results_root is None else load_suite("decode", results_root)
    measured = defaultdict(list)
    if suite is not None:
        for r in suite.select("split_speedup"):
            kv = _kv_len(r.case)
            if kv is not None:
                measured[(kv, r.case.get("group"))].append((_batch(r.case), r.value))
        if not measured:
            measured = _split_speedups_from_bw(suite)
    spec = (_gpus.match_gpu(suite.gpu) if suite else None) or _gpus.H200
    batch = np.unique(np.geomspace(1, 256, 40).round())
    lo, hi = PAPER["flashdecoding_range"]
    with style.context():
        fig, ax = style.new_figure(width=6.4, height=4.2)
        ax.axhspan(lo, hi, color="#f3e2c7", alpha=0.6, lw=0,
                   label=f"FlashDecoding report: ~{lo:g}-{hi:g}x (small batch, long context)")
        cases = [(32768, 8, "#1f4e9c", "-"), (4096, 8, "#1f4e9c", "--"),
                 (32768, 32, "#c0392b", "-"), (4096, 32, "#c0392b", "--")]
        for kv, h_kv, colour, ls in cases:
            ax.plot(batch, rl.split_kv_speedup_model(batch, kv, num_qo_heads=32,
                                                     num_kv_heads=h_kv, num_sms=spec.num_sms),
                    color=colour, ls=ls, lw=1.2,
                    label=f"model, KV {kv}, {'MHA' if h_kv == 32 else f'GQA {32 // h_kv}:1'}",
                    gid=f"model:kv{kv}:hkv{h_kv}")
        for i, ((kv, group), pts) in enumerate(sorted(measured.items(), key=lambda kv_g: str(kv_g[0]))):
            pts.sort()
            tag = "" if group is None else f", group {group}"
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o",
                    color=["#2a9d3a", "#8e44ad", "#e07b00", "#16a085"][i % 4],
                    label=f"ours, KV {kv}{tag}", gid=f"measured:kv{kv}" + (f":g{group}" if tag else ""))
        ax.axhline(1.0, color="black", lw=0.8)
        if not measured:
            style.note_no_measured(ax, "model only; measured comes from\n"
                                   "decode.json, metric split_speedup", loc="center right")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_ylim(0.5, 32)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup of split-KV over no split (x)")
        ax.set_title("Split-KV pays when batch x KV heads cannot fill the SMs")
        ax.legend(loc="upper right")
        src = f"ours: {_source(suite)}; " if measured else ""
        style.footer(fig, f"{src}model: {spec.name}, {spec.num_sms} SMs, one SM draws <= 2x its "
                          "fair bandwidth share, fp32 partial states merged")
    return fig


# --------------------------------------------------------------------------
# Planning break-even and Amdahl
# --------------------------------------------------------------------------

def breakeven_figure(results_root=None, integration_us: float = 0.0):
    """Minimal layer count with ``L*(u - v) > p + h`` against plan cost ``p``.

    The plan runs on the CPU, so its measured cost may come from ``sched.json``
    or from the CPU-only ``sched_cpu.json`` (first found); all ``plan_us``
    records are shown as a range with their median.
    """
    suite = None
    if results_root is not None:
        for name in ("sched", "sched_cpu"):
            suite = load_suite(name, results_root)
            if suite is not None and suite.select("plan_us"):
                break
    plan_us = [r.value for r in suite.select("plan_us")] if suite is not None else []
    p = np.geomspace(1, 1e4, 200)
    with style.context():
        fig, ax = style.new_figure(width=6.4, height=4.2)
        for gain, colour in zip((0.5, 2.0, 10.0, 50.0),
                                ("#8e44ad", "#c0392b", "#2a9d3a", "#1f4e9c")):
            ax.plot(p, rl.planning_breakeven_layers(gain, 0.0, p, integration_us), color=colour,
                    label=f"per-layer saving u - v = {gain:g} us", gid=f"model:gain{gain:g}")
        for name, layers in _LAYERS.items():
            ax.axhline(layers, color="#777777", lw=0.8, ls="--")
            ax.text(1.2, layers * 1.08, name, fontsize=7, color="#444444")
        if plan_us:
            med = float(np.median(plan_us))
            lo, hi = min(plan_us), max(plan_us)
            if hi > lo:
                ax.axvspan(lo, hi, color=style.IMPL_COLORS["nbattn"], alpha=0.15, lw=0)
            ax.axvline(med, color=style.IMPL_COLORS["nbattn"], lw=1.4, ls="-.",
                       label=f"measured plan cost {lo:.0f}-{hi:.0f} us, median {med:.1f} us\n"
                             f"({_cpu_source(suite)})", gid="measured:plan_us")
        else:
            style.note_no_measured(ax, "plan cost p would come from sched.json\n"
                                   "or sched_cpu.json (plan_us)", loc="lower right")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("plan cost p + integration h (us, once per step)")
        ax.set_ylabel("layers needed to break even")
        ax.set_title("Planning pays when L (u - v) > p + h")
        ax.legend(loc="upper left")
        style.footer(fig, f"model: break-even, h = {integration_us:g} us")
    return fig


def amdahl_figure(results_root=None):
    """Whole-step speedup when attention (fraction f) gets k x faster, beside the paper's ablation."""
    k = np.geomspace(1, 100, 200)
    with style.context():
        fig, ax = style.new_figure(width=6.4, height=4.2)
        for f, colour in zip((0.2, 0.4, 0.6, 0.8, 0.95),
                             ("#7f8c8d", "#16a085", "#1f4e9c", "#c0392b", "#8e44ad")):
            ax.plot(k, rl.amdahl_speedup(f, k), color=colour,
                    label=f"attention fraction f = {f:g}", gid=f"model:f{f:g}")
            ax.axhline(1.0 / (1.0 - f), color=colour, lw=0.6, ls=":")
        # ITL change -> step speedup; labels of nearly equal values share a line
        # of text so they stay readable.
        steps = sorted((1.0 / (1.0 + pct / 100.0), name, pct)
                       for name, pct in PAPER["load_balance_itl"].items())
        clusters: list[list] = []
        for step, name, pct in steps:
            ax.axhline(step, color=style.IMPL_COLORS["paper"], lw=0.8, ls="--",
                       gid=f"paper:{name}")
            if clusters and step / clusters[-1][-1][0] < 1.05:
                clusters[-1].append((step, name, pct))
            else:
                clusters.append([(step, name, pct)])
        for cluster in clusters:
            text = "; ".join(f"{name} ITL {pct:+g}% = {step:.2f}x" for step, name, pct in cluster)
            ax.text(90, cluster[-1][0] * 1.02, f"paper LB ablation: {text}", fontsize=6.5,
                    ha="right", va="bottom", color="#222222")
        ax.set_xscale("log")
        ax.set_yscale("log", base=2)
        ax.set_xlabel("attention speedup k (x)")
        ax.set_ylabel("whole-step speedup (x)")
        ax.set_title("Amdahl: a faster attention kernel helps in proportion to its share")
        ax.legend(loc="upper left")
        style.footer(fig, "model: 1/((1-f)+f/k); dotted: 1/(1-f). Paper: load-balancing "
                          "ablation, Llama 3.1 8B, H100")
    return fig


def _builder(figure, name: str):
    """The registry's builder ``(path, results_root)`` that writes ``figure(results_root)``."""
    def build(path: Path, results_root: Path) -> None:
        style.save(figure(results_root), path)
    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"Write :func:`{figure.__name__}` of ``results_root`` to ``path``."
    return build


build_shared_prefix = _builder(shared_prefix_figure, "build_shared_prefix")
build_page_size = _builder(page_size_figure, "build_page_size")
build_decode_bandwidth = _builder(decode_bandwidth_figure, "build_decode_bandwidth")
build_split_kv = _builder(split_kv_figure, "build_split_kv")
build_breakeven = _builder(breakeven_figure, "build_breakeven")
build_amdahl = _builder(amdahl_figure, "build_amdahl")
