"""Readability fixes of the figures: legends off the data, no clipped or hidden points,
honest labels (CPU times, simulated schedules), whole-number ticks."""
from __future__ import annotations

import numpy as np

from nbattn.perf import results
from nbattn.plots import layout as layout_plots
from nbattn.plots import paper, roofline
from nbattn.plots import sched as sched_plots
from nbattn.sched.plan import plan

from test_figures import artist


def _decode(root, *, flex=0.01):
    case = {"batch": 1, "kv_len": 32768, "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128,
            "group": 4}
    recs = [{"case": dict(case, split="auto"), "metric": "bw_fraction", "value": 0.82, "unit": "ratio",
             "peers": {"sdpa_cudnn": 0.82, "flex": flex}},
            {"case": dict(case, split="unsplit"), "metric": "bw_fraction", "value": 0.10, "unit": "ratio",
             "peers": {"sdpa_cudnn": 0.82, "flex": flex}}]
    results.write_suite("decode", recs, gpu="NVIDIA H200", command="fixture", date="2026-11-29",
                        copy_bandwidth_GBps=4300.0, root=root)
    return root


def test_roofline_unsplit_is_its_own_series_and_nothing_is_clipped(tmp_path):
    fig = roofline.roofline_figure(_decode(tmp_path, flex=0.001))
    assert len(artist(fig, "measured:decode:nbattn").get_offsets()) == 1        # the split record only
    unsplit = artist(fig, "measured:decode:nbattn_unsplit")
    assert "without split-KV" in unsplit.get_label()
    assert len(artist(fig, "measured:decode:flex").get_offsets()) == 1           # peers not doubled
    ax = fig.axes[0]
    lowest = min(np.asarray(c.get_offsets())[:, 1].min() for c in ax.collections if len(c.get_offsets()))
    assert ax.get_ylim()[0] < lowest
    legend = ax.get_legend()
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1           # beside, not over


def test_decode_bandwidth_batch1_nbattn_is_on_top_and_not_hidden(tmp_path):
    fig = paper.decode_bandwidth_figure(_decode(tmp_path))
    mine, cudnn = artist(fig, "measured:b1:nbattn"), artist(fig, "measured:b1:sdpa_cudnn")
    assert mine.get_zorder() > cudnn.get_zorder()
    assert mine.get_xdata()[0] != cudnn.get_xdata()[0]            # same value, different place
    from nbattn import figures
    assert "0.58" not in figures.get("decode_bandwidth").caption


def test_breakeven_calls_a_plan_time_a_cpu_time(tmp_path):
    results.write_suite("sched", [{"case": {}, "metric": "plan_us", "value": 100.0, "unit": "us"}],
                        gpu="NVIDIA H200", command="fixture", date="2026-11-29", root=tmp_path)
    label = artist(paper.breakeven_figure(tmp_path), "measured:plan_us").get_label()
    assert "CPU of the NVIDIA H200 machine" in label


def test_gantt_says_simulated_and_causal_mask_ticks_are_whole(tmp_path):
    fig = sched_plots.gantt(plan([3, 1, 4], [6, 2, 9], 4), tmp_path / "g.png")
    assert "simulated" in fig.axes[0].get_title()
    fig = layout_plots.causal_mask(tmp_path / "m.png")
    for ax in fig.axes:
        for ticks in (ax.get_xticks(), ax.get_yticks()):
            assert np.all(ticks == np.round(ticks))


def test_gantt_draws_a_baseline_above_on_the_same_time_axis(tmp_path):
    qo, kv = [1] * 6, [4000, 300, 300, 200, 100, 50]
    lpt = plan(qo, kv, 4)
    whole = plan(qo, kv, 4, chunk_limit=max(kv))
    assert whole.makespan > lpt.makespan                 # splitting the long request pays here
    fig = sched_plots.gantt(lpt, tmp_path / "g.png", baseline=whole, baseline_title="baseline: no split (simulated)")
    top, bottom = fig.axes
    assert "baseline" in top.get_title() and "simulated" in top.get_title()
    assert "simulated" in bottom.get_title()
    assert top.get_xlim() == bottom.get_xlim() and top.get_xlim()[1] >= whole.makespan
    # the baseline's longest bar is the long request, whole (cost alpha*1 + beta*4000)
    widths = [p.get_width() for p in top.patches]
    assert max(widths) == whole.makespan == lpt.alpha * 1 + lpt.beta * max(kv)
