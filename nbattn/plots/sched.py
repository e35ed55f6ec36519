"""Figures of the scheduler (docs/concepts/scheduler.md): Gantt charts, reduction maps, policy bars.

Each function takes data and an output path, writes the figure there and
returns the :class:`matplotlib.figure.Figure`.  Figures are built on the Agg
canvas directly (no ``pyplot``), so importing this module changes no global
matplotlib state and works without a display.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..sched.plan import DIRECT, Plan
from ..sched.simulate import CostModel, SimResult, simulate_plan

__all__ = ["gantt", "reduction_map", "policy_utilization", "measured_utilization", "ablation_table",
           "prediction_vs_measured"]

_CMAP = "tab20"


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path) -> Figure:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return fig


def _request_colors(request: np.ndarray):
    import matplotlib

    cmap = matplotlib.colormaps[_CMAP]
    return cmap((np.asarray(request) % cmap.N) / max(cmap.N - 1, 1))


def _schedule_of(plan_or_sim):
    """(schedule, rows to draw, lower bound, makespan, title) of a Plan or a SimResult."""
    if isinstance(plan_or_sim, Plan):
        p = plan_or_sim
        sim = simulate_plan(p, CostModel(alpha=p.alpha, beta=p.beta, chunk_overhead=0.0,
                                         merge_cost=0.0))
        label = (f"simulated LPT plan (cost model, not measured), C={p.num_ctas}, "
                 f"tile_q={p.tile_q}, L={p.chunk_limit}")
        return sim.schedule, sim.schedule.kind == 0, p.lower_bound, p.makespan, label
    if isinstance(plan_or_sim, SimResult):
        sim = plan_or_sim
        label = (f"simulated: {sim.policy} {sim.workload}, C={sim.num_ctas}, "
                 f"utilization {sim.utilization:.2f}")
        return sim.schedule, np.ones(sim.schedule.kind.shape, dtype=bool), sim.lower_bound, sim.makespan, label
    raise TypeError("gantt takes a Plan or a SimResult")


def _draw_gantt(ax, s, keep, bound: float, makespan: float, title: str, x_max: float) -> None:
    num_ctas = s.num_ctas
    cta, start, end = s.cta[keep], s.start[keep], s.end[keep]
    request, kind = s.request[keep], s.kind[keep]
    colors = _request_colors(request)
    compute = kind == 0
    ax.barh(cta[compute], (end - start)[compute], left=start[compute], height=0.8,
            color=colors[compute], edgecolor="black", linewidth=0.3)
    if np.any(~compute):
        ax.barh(cta[~compute], (end - start)[~compute], left=start[~compute], height=0.8,
                color=colors[~compute], edgecolor="black", linewidth=0.3, hatch="///")
    ax.axvline(bound, color="black", linestyle="--", linewidth=1,
               label=f"lower bound {bound:.0f}")
    ax.axvline(makespan, color="red", linewidth=1, label=f"makespan {makespan:.0f}")
    ax.set_ylim(num_ctas - 0.5, -0.5)
    ax.set_xlim(0, x_max)
    ax.set_xlabel("time (cost units)")
    ax.set_ylabel("CTA")
    ax.set_title(title, fontsize=10)
    handles, _ = ax.get_legend_handles_labels()
    if np.any(~compute):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="merge"))
    ax.legend(handles=handles, loc="lower right", fontsize=8)


def gantt(plan_or_sim, path, *, title: str | None = None, baseline=None,
          baseline_title: str | None = None) -> Figure:
    """Gantt chart: one row per CTA, time on x, work colored by request.

    A :class:`~nbattn.sched.plan.Plan` is drawn with its own chunk costs
    (``alpha*l_q + beta*l_kv``, no overhead, no merge phase), so the right edge
    is ``plan.makespan``.  A :class:`~nbattn.sched.simulate.SimResult` is drawn
    with its simulated times; merge jobs are hatched.  The dashed line is the
    lower bound.  ``baseline`` (a Plan or SimResult of the same work) is drawn
    above it on the same time axis, to contrast with.
    """
    panels = [_schedule_of(plan_or_sim) + (title,)]
    if baseline is not None:
        panels.insert(0, _schedule_of(baseline) + (baseline_title,))
    x_max = max(max(p[2], p[3]) for p in panels)
    x_max = x_max * 1.02 if x_max > 0 else 1
    height = sum(max(2.5, min(0.12 * p[0].num_ctas + 1.5, 14)) for p in panels)
    fig = _new_figure(9, height)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (s, keep, bound, makespan, label, given) in zip(axes, panels):
        _draw_gantt(ax, s, keep, bound, makespan, given or label, x_max)
    return _save(fig, path)


def reduction_map(plan: Plan, path, *, max_outputs: int = 24, title: str | None = None) -> Figure:
    """Work items -> partial slots -> merged outputs, in the style of FlashInfer's Figure 6.

    Left column: work items grouped by CTA in queue order ("c3: r1 t0 [0,512)").
    Middle: partial slots, with their position in the merge order.  Right: one
    box per output tile (request, query tile).  Split work goes through a slot;
    unsplit work (``out_slot == DIRECT``) goes straight to its output.  Only the
    first ``max_outputs`` output tiles (in request, tile order) are drawn.
    """
    import matplotlib

    items = np.arange(plan.num_items)
    cta = plan.item_cta()
    key = plan.request.astype(np.int64) * (1 << 31) + plan.qo_tile
    outputs = np.unique(key)[:max_outputs]
    shown = np.isin(key, outputs)
    items, cta = items[shown], cta[shown]

    slots = np.sort(plan.out_slot[items][plan.out_slot[items] != DIRECT])
    merge_position = {}
    for m in range(plan.num_merges):
        for k, s in enumerate(plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]):
            merge_position[int(s)] = k

    def column_y(n):
        # Spread n boxes evenly over [0, 1], top to bottom.
        return np.linspace(1.0, 0.0, n) if n > 1 else np.array([0.5])

    y_item = column_y(len(items))
    y_slot = dict(zip(slots.tolist(), column_y(len(slots)))) if len(slots) else {}
    y_out = dict(zip(outputs.tolist(), column_y(len(outputs))))

    n_rows = max(len(items), len(outputs), len(slots), 1)
    fig = _new_figure(10, max(3.0, 0.28 * n_rows + 1.2))
    ax = fig.add_subplot()
    ax.set_axis_off()
    cmap = matplotlib.colormaps[_CMAP]
    x_item, x_slot, x_out = 0.0, 0.45, 0.9
    box = dict(boxstyle="round,pad=0.25", linewidth=0.6)

    arrow = dict(arrowstyle="->", linewidth=0.7, shrinkA=2, shrinkB=2)
    for i, c, y in zip(items, cta, y_item):
        c = int(c)
        color = cmap(c % cmap.N)
        text = (f"c{c}: r{plan.request[i]} t{plan.qo_tile[i]} "
                f"[{plan.kv_start[i]},{plan.kv_end[i]})")
        ax.text(x_item, y, text, ha="right", va="center", fontsize=7, family="monospace",
                bbox=dict(box, facecolor=color, alpha=0.5))
        slot = int(plan.out_slot[i])
        target = (x_slot, y_slot[slot]) if slot != DIRECT else (x_out, y_out[int(key[i])])
        ax.annotate("", xy=target, xytext=(x_item + 0.01, y),
                    arrowprops=dict(arrow, color=color))
    for m in range(plan.num_merges):
        out = int(plan.merge_request[m]) * (1 << 31) + int(plan.merge_qo_tile[m])
        if out not in y_out:
            continue
        for s in plan.merge_slots[plan.merge_indptr[m]:plan.merge_indptr[m + 1]]:
            s = int(s)
            ax.text(x_slot, y_slot[s], f"slot {s} (#{merge_position[s]})", ha="center",
                    va="center", fontsize=7, bbox=dict(box, facecolor="lightyellow"))
            ax.annotate("", xy=(x_out, y_out[out]), xytext=(x_slot + 0.06, y_slot[s]),
                        arrowprops=dict(arrow, color="gray"))
    for out, y in y_out.items():
        r, t = divmod(out, 1 << 31)
        lo, hi = plan.tile_rows(r, t)
        ax.text(x_out, y, f"out r{r} t{t} rows[{lo},{hi})", ha="left", va="center",
                fontsize=7, bbox=dict(box, facecolor="lightblue"))
    ax.set_xlim(-0.45, 1.25)
    ax.set_ylim(-0.05, 1.05)
    ax.text(x_item, 1.07, "work items (CTA: request, tile, keys)", ha="right", fontsize=8,
            weight="bold")
    ax.text(x_slot, 1.07, "partial slots (#merge order)", ha="center", fontsize=8,
            weight="bold")
    ax.text(x_out, 1.07, "outputs", ha="left", fontsize=8, weight="bold")
    ax.set_title(title or f"reduction map: {plan.num_items} items, {plan.num_partials} "
                 f"partials, {plan.num_merges} merges", fontsize=10, pad=18)
    return _save(fig, path)


def _as_summary(r) -> dict:
    return r.summary() if isinstance(r, SimResult) else dict(r)


def policy_utilization(results, path, *, title: str | None = None) -> Figure:
    """Bars per workload and policy: utilization (left) and makespan / lower bound (right).

    ``results`` are :class:`~nbattn.sched.simulate.SimResult` objects or their
    ``summary()`` dicts (keys ``workload``, ``policy``, ``utilization``,
    ``makespan_over_bound``), e.g. read back from a benchmark JSON.
    """
    rows = [_as_summary(r) for r in results]
    if not rows:
        raise ValueError("policy_utilization needs at least one result")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    table = {(r["workload"], r["policy"]): r for r in rows}

    fig = _new_figure(11, 4)
    axes = fig.subplots(1, 2)
    width = 0.8 / len(policies)
    x = np.arange(len(workloads))
    for k, policy in enumerate(policies):
        util = [table.get((w, policy), {}).get("utilization", np.nan) for w in workloads]
        ratio = [table.get((w, policy), {}).get("makespan_over_bound", np.nan) for w in workloads]
        offset = (k - (len(policies) - 1) / 2) * width
        axes[0].bar(x + offset, util, width, label=policy)
        axes[1].bar(x + offset, ratio, width, label=policy)
    axes[0].set_ylim(0, 1.2)
    axes[0].set_ylabel("utilization  sum(busy) / (C * makespan)")
    axes[1].set_yscale("log")
    top = np.nanmax([r["makespan_over_bound"] for r in rows])
    axes[1].set_ylim(0.8, max(2.0, top) * 3)
    axes[1].axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes[1].set_ylabel("makespan / lower bound (log)")
    for ax in axes:
        ax.set_xticks(x, workloads)
        ax.legend(fontsize=8, ncol=len(policies), loc="upper center")
    fig.suptitle(title or "scheduling policies (simulated)", fontsize=11)
    return _save(fig, path)


# ---------------------------------------------------------------------------
# Measured: benchmarks/results/sched.json (benchmarks/gpu_sched.py)
# ---------------------------------------------------------------------------

_POLICY_ORDER = ("one_per_cta", "split_512", "split_1024", "split_2048", "split_4096", "split_auto", "lpt",
                 "lpt_default", "lpt_spec", "lpt_spec_resident")


def _records(suite, metric: str) -> list:
    return [] if suite is None else [r for r in suite.records if r.metric == metric]


def _ordered(names) -> list:
    names = list(dict.fromkeys(names))
    known = [p for p in _POLICY_ORDER if p in names]
    return known + sorted(n for n in names if n not in known)


def _batch(r) -> int | None:
    b = r.case.get("batch")
    return int(b) if b is not None else None


def measured_utilization(suite, path, *, title: str | None = None) -> Figure:
    """The paper's Figure 8 counterpart, measured: bandwidth utilization (decode,
    ``bw_fraction``) or TFLOP/s (mixed prefill + decode, ``tflops``) per workload and
    policy, one panel per batch size, with the same-run SDPA peers on the padded batch
    hatched beside.  ``suite``: the ``sched`` result suite (:func:`nbattn.perf.results.load_suite`)
    or None; a missing suite or metric is drawn as "no measured data yet", never invented."""
    from . import style

    bw, tf = _records(suite, "bw_fraction"), _records(suite, "tflops")
    panels = [("bw_fraction", b, [r for r in bw if _batch(r) == b]) for b in sorted({_batch(r) for r in bw}
                                                                                    - {None})]
    panels += [("tflops", b, [r for r in tf if _batch(r) == b]) for b in sorted({_batch(r) for r in tf} - {None})]
    fig = _new_figure(max(6.0, 4.2 * max(len(panels), 1)), 4.2)
    if not panels:
        ax = fig.add_subplot()
        ax.set_axis_off()
        style.note_no_measured(ax, "bw_fraction / tflops records would come from sched.json "
                                   "(benchmarks/gpu_sched.py)", loc="upper center")
        return _save(fig, path)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (metric, batch, recs) in zip(axes, panels):
        workloads = list(dict.fromkeys(r.case.get("workload") for r in recs))
        policies = _ordered(r.case.get("policy") for r in recs)
        peers = sorted({k for r in recs for k, v in r.peers.items() if k.startswith("sdpa") and v is not None})
        table = {(r.case.get("workload"), r.case.get("policy")): r for r in recs}
        names = policies + peers
        width = 0.84 / len(names)
        x = np.arange(len(workloads))
        for k, name in enumerate(names):
            vals = []
            for w in workloads:
                if name in policies:
                    r = table.get((w, name))
                    vals.append(r.value if r is not None else np.nan)
                else:
                    got = [r.peers.get(name) for (ww, _), r in table.items() if ww == w and r.peers.get(name)]
                    vals.append(got[0] if got else np.nan)
            off = (k - (len(names) - 1) / 2) * width
            peer = name not in policies
            ax.bar(x + off, vals, width, label=name + (" (padded)" if peer and "padded" not in name else ""),
                   color=style.impl_color(name) if peer else None, hatch="//" if peer else None,
                   edgecolor="black" if peer else None, linewidth=0.3)
            for xi, v in zip(x + off, vals):
                if np.isnan(v):
                    ax.text(xi, 0.01, "not measured", rotation=90, fontsize=5, ha="center", va="bottom")
        ax.set_xticks(x, workloads, fontsize=8)
        ax.set_ylabel("fraction of copy bandwidth" if metric == "bw_fraction" else "TFLOP/s")
        ax.set_title(f"batch {batch}" + ("" if metric == "bw_fraction" else ", mixed prefill + decode"))
        if metric == "bw_fraction":
            ax.set_ylim(0, 1.15)
    axes[-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    gpu = getattr(suite, "gpu", "")
    fig.suptitle(title or f"scheduling policies, measured ({gpu}, sched.json)\nhatched: SDPA on the padded "
                          f"batch, same run", fontsize=9)
    return _save(fig, path)


def ablation_table(suite, path, *, title: str | None = None) -> Figure:
    """The paper's load-balancing ablation, measured: for every workload and batch, each
    fixed policy's kernel time over LPT's (``> 1``: LPT is faster), from the
    ``latency_us`` records; cells without both numbers say "not measured"."""
    from . import style

    lat = [r for r in _records(suite, "latency_us") if r.case.get("policy")]
    by_case: dict = {}
    for r in lat:
        by_case.setdefault((r.case.get("workload"), _batch(r)), {})[r.case["policy"]] = r.value
    fixed = _ordered(p for d in by_case.values() for p in d
                     if p == "one_per_cta" or str(p).startswith("split_"))
    others = _ordered(p for d in by_case.values() for p in d if str(p).startswith("lpt") and p != "lpt")
    cols = fixed + others
    rows = [k for k in by_case if "lpt" in by_case[k]]
    fig = _new_figure(max(6.0, 1.1 * len(cols) + 2.5), 0.35 * max(len(rows), 1) + 1.6)
    ax = fig.add_subplot()
    ax.set_axis_off()
    if not rows or not cols:
        style.note_no_measured(ax, "latency_us records of lpt and fixed policies would come from sched.json",
                               loc="upper center")
        return _save(fig, path)
    text, colors = [], []
    for k in rows:
        d = by_case[k]
        line, cl = [], []
        for c in cols:
            if c in d:
                ratio = d[c] / d["lpt"]
                line.append(f"{ratio:.2f}x")
                cl.append("#c9e7c9" if ratio >= 1.0 else ("#fbe3b6" if ratio >= 1 / 1.03 else "#f4c2c2"))
            else:
                line.append("not measured")
                cl.append("white")
        text.append(line)
        colors.append(cl)
    tab = ax.table(cellText=text, cellColours=colors, colLabels=cols,
                   rowLabels=[f"{w} b{b}" if b is not None else str(w) for w, b in rows], loc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(7)
    ax.set_title(title or "policy time / LPT time, measured (>1: LPT faster; green LPT wins, amber within 3%, "
                          "red LPT slower)", fontsize=9)
    return _save(fig, path)


def prediction_vs_measured(suite, path, *, title: str | None = None) -> Figure:
    """The simulator beside the measurement: the fitted model's predicted kernel time
    (``predicted_us`` records, whose peer ``measured`` is the same-run time) against the
    measured one, per workload, with the relative error; the 15% band of issue 21 is
    shaded.  Without predictions it says so ("no measured data yet")."""
    from . import style

    recs = [r for r in _records(suite, "predicted_us") if r.peers.get("measured")]
    fig = _new_figure(11, 4.2)
    axes = fig.subplots(1, 2)
    if not recs:
        for ax in axes:
            ax.set_axis_off()
        style.note_no_measured(axes[0], "predicted_us records (simulator under the fitted cost model) would "
                                        "come from sched.json", loc="upper center")
        return _save(fig, path)
    meas = np.array([r.peers["measured"] for r in recs])
    pred = np.array([r.value for r in recs])
    wl = [r.case.get("workload") for r in recs]
    names = list(dict.fromkeys(wl))
    ax = axes[0]
    lo, hi = min(meas.min(), pred.min()) * 0.8, max(meas.max(), pred.max()) * 1.25
    line = np.array([lo, hi])
    ax.fill_between(line, line / 1.15, line * 1.15, color="#dddddd", label="within 15%")
    ax.plot(line, line, color="black", linewidth=0.8)
    for n in names:
        m = np.array([w == n for w in wl])
        ax.scatter(meas[m], pred[m], s=14, label=n)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured kernel time (us)")
    ax.set_ylabel("simulator, fitted model (us)")
    ax.legend(fontsize=7)
    err = pred / meas - 1
    ax = axes[1]
    ax.axhspan(-0.15, 0.15, color="#dddddd")
    for k, n in enumerate(names):
        m = np.array([w == n for w in wl])
        ax.scatter(np.full(m.sum(), k) + np.linspace(-0.25, 0.25, m.sum()), err[m] * 100, s=12)
        worst = err[m][np.argmax(np.abs(err[m]))]
        ax.text(k, 100 * worst, f"{100 * worst:+.0f}%", fontsize=7, ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("prediction error (%)")
    ax.axhline(0, color="black", linewidth=0.8)
    fig.suptitle(title or f"simulator vs measured ({getattr(suite, 'gpu', '')}, sched.json): largest |error| "
                          f"{100 * np.max(np.abs(err)):.0f}%", fontsize=10)
    return _save(fig, path)
