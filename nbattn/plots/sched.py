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

__all__ = ["gantt", "reduction_map", "policy_utilization"]

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
