"""Figure registry, builders and the measured-data path.

Result files here are synthetic fixtures written to tmp_path; nothing is
written under benchmarks/results.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from nbattn import figures
from nbattn.perf import results
from nbattn.plots import paper, roofline, style

REPO = Path(__file__).resolve().parents[1]
MINE = ["roofline", "intensity_vs_length", "shared_prefix_traffic", "page_size_vs_contiguous",
        "decode_bandwidth", "split_kv_speedup", "planning_breakeven", "amdahl"]
PNG = b"\x89PNG\r\n\x1a\n"

MEASURED_FIGURES = [roofline.roofline_figure, paper.shared_prefix_figure,
                    paper.page_size_figure, paper.decode_bandwidth_figure,
                    paper.split_kv_figure, paper.breakeven_figure]


def write_results(root: Path, *, nbattn_bw=0.8, sdpa_bw=0.55, copy_bw=4300.0,
                  prefill_tflops=300.0, cascade=10.0, split=3.0, plan_us=40.0) -> Path:
    """Synthetic result files, with knobs for the values under test."""
    decode = []
    for batch in (1, 64):
        for kv in (1024, 4096, 32768):
            case = {"batch": batch, "kv_len": kv, "num_qo_heads": 32, "num_kv_heads": 8,
                    "head_dim": 128, "page_size": 0}
            decode.append({"case": case, "metric": "bw_fraction", "value": nbattn_bw,
                           "unit": "ratio", "peers": {"sdpa": sdpa_bw, "flex": 0.4,
                                                      "cudnn": None}})
            decode.append({"case": dict(case, page_size=1), "metric": "bw_fraction",
                           "value": nbattn_bw * 0.9, "unit": "ratio"})
            decode.append({"case": {"batch": batch, "kv_len": kv}, "metric": "split_speedup",
                           "value": split / batch, "unit": "x"})
    common = dict(gpu="NVIDIA H200", command="synthetic test fixture", date="2026-11-29",
                  root=root)
    results.write_suite("decode", decode, copy_bandwidth_GBps=copy_bw, **common)
    prefill = [{"case": {"batch": 1, "qo_len": 32768, "kv_len": 32768, "causal": True,
                         "page_size": ps}, "metric": "tflops",
                "value": prefill_tflops * (1.0 if ps == 0 else 0.9), "unit": "TFLOP/s",
                "peers": {"cudnn": 600.0} if ps == 0 else {}} for ps in (0, 1)]
    results.write_suite("prefill", prefill, copy_bandwidth_GBps=copy_bw, **common)
    results.write_suite("cascade", [
        {"case": {"batch": b, "prefix_len": 32768, "suffix_len": 128}, "metric": "speedup",
         "value": cascade * b / 64, "unit": "x"} for b in (16, 64)], **common)
    results.write_suite("sched", [{"case": {"batch": 64}, "metric": "plan_us",
                                   "value": plan_us, "unit": "us"}], **common)
    return root


@pytest.fixture
def results_dir(tmp_path):
    return write_results(tmp_path / "results")


def artist(fig, gid):
    """The one line / collection / patch group tagged ``gid`` in any axes of ``fig``."""
    found = []
    for ax in fig.axes:
        found += [a for a in ax.lines if a.get_gid() == gid]
        found += [a for a in ax.collections if a.get_gid() == gid]
        patches = [p for p in ax.patches if p.get_gid() == gid]
        if patches:
            found.append(patches)
    assert len(found) == 1, f"{gid}: found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

def test_registry_lists_builtin_figures():
    entries = figures.registry()
    names = [e.name for e in entries]
    assert names[:len(MINE)] == MINE
    assert len(set(names)) == len(names)
    for entry in entries:
        name, builder, caption, source = entry  # unpacks as the documented 4-tuple
        assert callable(builder) and caption and source
    by_name = {e.name: e for e in entries}
    # The paper's number beside ours, and ours only by reference to its file.
    assert "16.07" in by_name["shared_prefix_traffic"].caption
    assert "benchmarks/results/cascade.json" in by_name["shared_prefix_traffic"].caption
    assert "370" in by_name["page_size_vs_contiguous"].caption
    assert "37.87" in by_name["amdahl"].caption
    assert "decode.json" in by_name["decode_bandwidth"].data_source


def test_readme_has_every_figure():
    text = (REPO / "figures" / "README.md").read_text()
    for entry in figures.registry():
        assert f"`{entry.name}.png`" in text
    assert text.count("**Data source:**") >= len(MINE)
    assert figures.render_readme() == text, "regenerate with nbattn.figures.write_readme()"


def test_figures_module_is_cheap_to_import():
    code = "import sys, nbattn.figures; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def clean_registry(monkeypatch):
    """A registry with only the built-ins, restored afterwards."""
    figures.registry()
    monkeypatch.setattr(figures, "_REGISTRY", dict(figures._REGISTRY))
    return figures._REGISTRY


def test_register_and_build(tmp_path, clean_registry):
    seen = {}

    @figures.register("test_two_args", caption="c", source="s")
    def two(path, results_root):
        seen["root"] = results_root
        path.write_bytes(PNG)

    @figures.register("test_one_arg", caption="c", source="s")
    def one(path):
        path.write_bytes(PNG)

    @figures.register("test_returns_figure", caption="c", source="s")
    def returns(path, results_root):
        fig, ax = style.new_figure()
        ax.plot([0, 1], [0, 1])
        return fig

    out = tmp_path / "out"
    assert figures.build("test_two_args", out, tmp_path / "r") == out / "test_two_args.png"
    assert seen["root"] == tmp_path / "r"
    assert figures.build("test_one_arg", out).exists()
    assert figures.build("test_returns_figure", out).read_bytes()[:8] == PNG
    # Same builder twice is fine, a different one under a taken name is not.
    figures.register("test_one_arg", caption="c", source="s")(one)
    with pytest.raises(ValueError, match="already registered"):
        figures.register("test_one_arg", caption="c", source="s")(two)
    with pytest.raises(ValueError):
        figures.register("bad name!", caption="c", source="s")
    with pytest.raises(KeyError, match="no figure"):
        figures.get("no_such_figure")


def test_build_failures_propagate(tmp_path, clean_registry):
    @figures.register("test_silent", caption="c", source="s")
    def silent(path, results_root):
        return None

    @figures.register("test_raises", caption="c", source="s")
    def raises(path, results_root):
        raise ZeroDivisionError("boom")

    with pytest.raises(RuntimeError, match="wrote nothing"):
        figures.build("test_silent", tmp_path)
    with pytest.raises(ZeroDivisionError):
        figures.build_all(tmp_path, progress=False, names=["test_raises"])


def test_import_failures_are_tolerated(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeplots"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.py").write_text("raise RuntimeError('half-written module')\n")
    (pkg / "works.py").write_text(textwrap.dedent("""
        def one_arg(path):
            path.write_bytes(b"\\x89PNG\\r\\n\\x1a\\n")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(figures, "_REGISTRY", {})
    monkeypatch.setattr(figures, "_LOADED", False)
    monkeypatch.setattr(figures, "_BUILTIN", [
        ("fakeplots.absent", "f", "from_absent", "c", "s"),
        ("fakeplots.broken", "f", "from_broken", "c", "s"),
        ("fakeplots.works", "missing_function", "from_missing", "c", "s"),
        ("fakeplots.works", "one_arg", "from_works", "c", "s"),
    ])
    with pytest.warns(RuntimeWarning) as caught:
        names = figures.figure_names()
    assert names == ["from_works"]
    messages = " ".join(str(w.message) for w in caught)
    assert "half-written module" in messages and "missing_function" in messages
    assert "absent" not in messages  # a module not written yet is skipped quietly
    paths = figures.build_all(tmp_path / "out", progress=False)
    assert paths == [tmp_path / "out" / "from_works.png"]


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------

def test_build_all_without_results(tmp_path):
    paths = figures.build_all(tmp_path / "figs", tmp_path / "no_results_here", progress=False)
    assert [p.stem for p in paths] == figures.figure_names()
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_build_all_with_results(tmp_path, results_dir):
    paths = figures.build_all(tmp_path / "figs", results_dir, progress=False, names=MINE)
    assert [p.name for p in paths] == [f"{n}.png" for n in MINE]
    assert all(p.read_bytes()[:8] == PNG for p in paths)


@pytest.mark.parametrize("make", MEASURED_FIGURES, ids=lambda f: f.__name__)
def test_no_measured_data_note(make, tmp_path, results_dir):
    assert style.has_no_data_note(make(None))
    assert style.has_no_data_note(make(tmp_path / "empty"))
    assert not style.has_no_data_note(make(results_dir))


def test_model_only_figures():
    for make in (roofline.intensity_figure, paper.amdahl_figure):
        fig = make(None)
        assert not style.has_no_data_note(fig)
        assert any(line.get_gid() for ax in fig.axes for line in ax.lines)


# --------------------------------------------------------------------------
# Measured values reach the plots (and only through result files)
# --------------------------------------------------------------------------

def test_decode_bandwidth_follows_the_file(tmp_path):
    root = write_results(tmp_path, nbattn_bw=0.8, sdpa_bw=0.55)
    fig = paper.decode_bandwidth_figure(root)
    np.testing.assert_allclose(artist(fig, "measured:b1:nbattn").get_ydata(), [0.8] * 3)
    np.testing.assert_allclose(artist(fig, "measured:b64:sdpa").get_xdata(), [1024, 4096, 32768])
    with pytest.raises(AssertionError):
        artist(fig, "measured:b1:cudnn")  # a null peer is not plotted
    write_results(tmp_path, nbattn_bw=0.93, sdpa_bw=0.31)
    fig = paper.decode_bandwidth_figure(root)
    np.testing.assert_allclose(artist(fig, "measured:b1:nbattn").get_ydata(), [0.93] * 3)
    np.testing.assert_allclose(artist(fig, "measured:b64:sdpa").get_ydata(), [0.31] * 3)


def test_roofline_follows_the_file(tmp_path):
    root = write_results(tmp_path, copy_bw=4000.0, nbattn_bw=0.5)
    fig = roofline.roofline_figure(root)
    roof = artist(fig, "roof:H200")
    x, y = roof.get_xdata(), roof.get_ydata()
    assert y[0] == pytest.approx(4000.0 * x[0] * 1e-3)
    assert "4,000 GB/s (decode.json)" in roof.get_label()

    def fractions(fig, bw):
        # Each point is bw_fraction * copy bandwidth * the case's own intensity.
        pts = np.asarray(artist(fig, "measured:decode:nbattn").get_offsets())
        return sorted(set(np.round(pts[:, 1] / (pts[:, 0] * bw * 1e-3), 9)))

    np.testing.assert_allclose(fractions(fig, 4000.0), [0.45, 0.5])  # page 1 runs at 0.9x
    write_results(tmp_path, copy_bw=4400.0, nbattn_bw=0.9)
    fig = roofline.roofline_figure(root)
    assert artist(fig, "roof:H200").get_ydata()[0] == pytest.approx(4400.0 * x[0] * 1e-3)
    np.testing.assert_allclose(fractions(fig, 4400.0), [0.81, 0.9])
    prefill = artist(fig, "measured:prefill:cudnn").get_offsets()
    np.testing.assert_allclose(prefill[:, 1], [600.0])
    # Without files, the H200 roof uses the H200's measured ceiling.
    assert artist(roofline.roofline_figure(None), "roof:H200").get_ydata()[0] == \
        pytest.approx(4300.0 * x[0] * 1e-3)


def test_paper_figures_follow_the_file(tmp_path):
    root = write_results(tmp_path, prefill_tflops=300.0, cascade=10.0, split=3.0, plan_us=40.0)
    before = {
        "cascade": artist(paper.shared_prefix_figure(root), "measured:P32768:S128").get_ydata(),
        "bars": [p.get_height() for p in artist(paper.page_size_figure(root),
                                                "bars:contiguous")],
        "split": artist(paper.split_kv_figure(root), "measured:kv32768").get_ydata(),
        "plan": artist(paper.breakeven_figure(root), "measured:plan_us").get_xdata(),
    }
    np.testing.assert_allclose(before["cascade"], [2.5, 10.0])
    assert before["bars"][:2] == [370.0, 627.0] and before["bars"][2] == pytest.approx(300.0)
    np.testing.assert_allclose(before["split"], [3.0, 3.0 / 64])
    np.testing.assert_allclose(before["plan"], [40.0, 40.0])
    write_results(tmp_path, prefill_tflops=450.0, cascade=14.0, split=5.0, plan_us=12.5)
    np.testing.assert_allclose(
        artist(paper.shared_prefix_figure(root), "measured:P32768:S128").get_ydata(),
        [3.5, 14.0])
    bars = [p.get_height() for p in artist(paper.page_size_figure(root), "bars:page size 1")]
    assert bars[:2] == [347.0, 532.0] and bars[2] == pytest.approx(450.0 * 0.9)
    np.testing.assert_allclose(
        artist(paper.split_kv_figure(root), "measured:kv32768").get_ydata(), [5.0, 5.0 / 64])
    np.testing.assert_allclose(
        artist(paper.breakeven_figure(root), "measured:plan_us").get_xdata(), [12.5, 12.5])


def test_model_curves_match_the_model():
    fig = paper.shared_prefix_figure(None)
    line = artist(fig, "model:P32768:S128")
    n = line.get_xdata()
    np.testing.assert_allclose(line.get_ydata(), n * (32768 + 128) / (32768 + n * 128))
    fig = paper.breakeven_figure(None)
    line = artist(fig, "model:gain2")
    np.testing.assert_allclose(line.get_ydata(), np.floor(line.get_xdata() / 2) + 1)
    fig = paper.amdahl_figure(None)
    line = artist(fig, "model:f0.8")
    k = line.get_xdata()
    np.testing.assert_allclose(line.get_ydata(), 1 / (0.2 + 0.8 / k))
    # Paper's ablation: -37.87 % ITL is a 1/(1 - 0.3787) step speedup.
    assert artist(fig, "paper:long-variable").get_ydata()[0] == pytest.approx(1 / 0.6213)


def test_breakeven_reads_cpu_plan_cost(tmp_path):
    # The plan runs on the CPU: a CPU-only sched_cpu.json is a valid source of p.
    results.write_suite("sched_cpu", [
        {"case": {"workload": w}, "metric": "plan_us", "value": v, "unit": "us"}
        for w, v in (("variable", 80.0), ("skewed", 90.0), ("zipf", 100.0))],
        gpu="none (CPU)", command="fixture", date="2026-11-29", root=tmp_path)
    fig = paper.breakeven_figure(tmp_path)
    np.testing.assert_allclose(artist(fig, "measured:plan_us").get_xdata(), [90.0, 90.0])
    assert not style.has_no_data_note(fig)
