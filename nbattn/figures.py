"""Figure registry and ``build_all``.

Every figure is an entry ``(name, builder, caption, data_source)``.  A builder
has the signature ``builder(path: pathlib.Path, results_root: pathlib.Path)
-> None`` and writes one image to ``path``; measured data reach it only through
:mod:`nbattn.perf.results` under ``results_root``.

Other modules add figures with the decorator::

    from nbattn.figures import register

    @register("my_figure", caption="...", source="model (performance model)")
    def my_figure(path, results_root): ...

This module is cheap to import: plotting modules (and matplotlib) load the
first time the registry is read.  The built-in list also names figure
functions of modules written elsewhere (``nbattn.plots.sched``,
``nbattn.plots.layout``); those are picked up when their module imports and
skipped, with a warning, when it does not.  Tolerance ends at import: a
builder that raises while rendering fails ``build_all``.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

__all__ = [
    "FigureEntry",
    "register",
    "registry",
    "figure_names",
    "get",
    "build",
    "build_all",
    "render_readme",
    "write_readme",
]

log = logging.getLogger("nbattn.figures")

Builder = Callable[..., object]


class FigureEntry(NamedTuple):
    """One registered figure; unpacks as ``(name, builder, caption, data_source)``."""

    name: str
    builder: Builder
    caption: str
    data_source: str


_REGISTRY: dict[str, FigureEntry] = {}
_LOADED = False


def register(name: str, caption: str, source: str, *, replace: bool = False):
    """Decorator adding ``builder(path, results_root)`` to the registry under ``name``.

    Registering the same builder twice under one name is a no-op (modules may
    be re-imported); a different builder under a taken name is an error unless
    ``replace=True``.
    """
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"figure name {name!r}: use letters, digits, '_' or '-'")

    def deco(builder: Builder) -> Builder:
        old = _REGISTRY.get(name)
        if old is not None and old.builder is not builder and not replace:
            raise ValueError(f"figure {name!r} is already registered by "
                             f"{getattr(old.builder, '__module__', '?')}")
        _REGISTRY[name] = FigureEntry(name, builder, caption, source)
        return builder

    return deco


# --------------------------------------------------------------------------
# Built-in figures
# --------------------------------------------------------------------------
# (module, function, name, caption, data source[, adapter]).  An adapter turns a
# function that needs data into a ``builder(path, results_root)``.  Captions put the paper's
# reported number beside ours; measured values are never written here,
# only the file they live in.

_RESULTS = "benchmarks/results"


# nbattn.plots.sched draws data it is given (``gantt(plan_or_sim, path)``,
# ``reduction_map(plan, path)``, ``policy_utilization(results, path)``); these
# adapters make that data with nbattn.sched on fixed, seeded inputs so the
# figures are reproducible.  They run only if the module imported.

def _sched_gantt(fn: Builder) -> Builder:
    def builder(path: Path, results_root: Path) -> None:
        from .sched.plan import plan
        from .sched.simulate import make_workload

        # Skewed step (one long request among short ones): the case where LPT
        # splitting matters, small enough (16 CTAs) to read.
        w = make_workload("skewed", batch=24, long_len=8192, short_len=512)
        lpt = plan(w.qo_lens, w.kv_lens, 16, group=w.group)
        # The baseline: the same LPT placement with no request split (limit = the longest).
        whole = plan(w.qo_lens, w.kv_lens, 16, group=w.group, chunk_limit=int(max(w.kv_lens)))
        fn(lpt, path, baseline=whole,
           baseline_title=f"baseline: no request split, C=16 (simulated, cost model), "
                          f"makespan {whole.makespan:.0f}")

    return builder


def _sched_reduction_map(fn: Builder) -> Builder:
    def builder(path: Path, results_root: Path) -> None:
        from .sched.plan import plan

        # The three-request example batch (docs/concepts/layouts.md) on 4 CTAs.
        fn(plan([3, 1, 4], [6, 2, 9], 4), path)

    return builder


def _sched_policy_utilization(fn: Builder) -> Builder:
    def builder(path: Path, results_root: Path) -> None:
        from .sched.simulate import WORKLOADS, compare_policies, make_workload

        workloads = [make_workload(name, batch=64, seed=0) for name in WORKLOADS]
        fn(compare_policies(workloads, 132), path)

    return builder


def _sched_measured(fn: Builder) -> Builder:
    def builder(path: Path, results_root: Path) -> None:
        from .perf.results import load_suite

        fn(load_suite("sched", results_root), path)

    return builder


_BUILTIN: list[tuple] = [
    ("nbattn.plots.roofline", "build_roofline", "roofline",
     "Attention roofline of H200, H100 SXM and A100 SXM 80GB (datasheet peaks; the H200 "
     "bandwidth is the measured copy ceiling: copy_bandwidth_GBps of a result file when "
     "present, else 4.3 TB/s, an earlier copy measurement on the H200). Hollow markers: model "
     "points on the H200 roof (decode is memory-bound at ~group FLOP/byte, prefill "
     "compute-bound). Filled markers: measured nbattn and peers (SDPA flash and cuDNN, "
     "FlexAttention) at each case's intensity; crosses: nbattn's decode without split-KV, an "
     "ablation. The legend sits beside the axes and the y range reaches the lowest measured "
     f"point. Values: {_RESULTS}/decode.json and {_RESULTS}/prefill.json.",
     f"model + datasheets; measured: {_RESULTS}/decode.json, prefill.json "
     "(GPU named in each file)"),
    ("nbattn.plots.roofline", "build_intensity", "intensity_vs_length",
     "Operational intensity against l_q/l_kv (l_kv = 8192, head_dim 128, fp16) for GQA "
     "groups 1, 4, 8, exact ratio and the closed form (2/b)*l_q*l_kv/(l_q+l_kv)*group, "
     "with each GPU's ridge point. Decode (l_q = 1) sits at about `group` FLOP/byte, far "
     "below every ridge; against 8192 keys, prefill crosses the H200 ridge (230 FLOP/byte "
     "at 4.3 TB/s) at l_q of about 240 tokens for MHA, 60 for group 4 and 30 for group 8.",
     "model (performance model)"),
    ("nbattn.plots.paper", "build_shared_prefix", "shared_prefix_traffic",
     "Shared-prefix traffic model n(P+S)/(P+nS) (suffix S = 128) as an upper bound "
     "on the cascade speedup. Paper App. Table 5: batch 64, prefix 32768: "
     "4090 -> 254.54 us (16.07x; the traffic bound is 51.4x); batch 16, prefix 1024: "
     "46.52 -> 45.17 us (1.03x; bound 6.0x). Ours: see "
     f"{_RESULTS}/cascade.json (metric speedup).",
     f"model (performance model) + paper (FlashInfer paper); measured: {_RESULTS}/cascade.json"),
    ("nbattn.plots.paper", "build_page_size", "page_size_vs_contiguous",
     "Page size 1 against contiguous KV. Paper App. B (batch 1, 32768-token "
     "prefill, H100): FA2 template 370 vs 347 TFLOP/s (-6.2%), FA3 template 627 vs 532 "
     "(-15.2%); decode bandwidth about the same. Ours: see "
     f"{_RESULTS}/prefill.json (tflops) and {_RESULTS}/decode.json (bw_fraction), "
     "case key page_size.",
     f"paper (FlashInfer paper); measured: {_RESULTS}/prefill.json, decode.json"),
    ("nbattn.plots.paper", "build_decode_bandwidth", "decode_bandwidth",
     "Decode bandwidth utilization (achieved bytes/s over the copy bandwidth measured in the "
     "same run) against KV length, one panel per batch size: nbattn (drawn on top, larger "
     "markers), its other decode paths (nbattn_warp, nbattn_smem), SDPA flash and cuDNN, and "
     "FlexAttention, all from one run; solid lines GQA group 4, dashed group 8. Grey lines "
     "are the split / no-split occupancy model. The batch-1 panel has a single KV length, so "
     "its markers are spread sideways and none hides another. Values: "
     f"{_RESULTS}/decode.json.",
     f"measured: {_RESULTS}/decode.json (GPU named in the file); model otherwise"),
    ("nbattn.plots.paper", "build_split_kv", "split_kv_speedup",
     "Split-KV (FlashDecoding) speedup over a non-split decode kernel against batch size. "
     "FlashDecoding reports roughly 2-8x at small batch and long context (FlashInfer paper). The "
     "occupancy model (H200, 132 SMs; assumes one SM draws at most twice its fair bandwidth "
     "share) gives ~8x for GQA 4:1 at batch 1 and ~2x for MHA, falling to 1x once "
     "batch x KV heads fills the SMs. Ours: see "
     f"{_RESULTS}/decode.json (metric split_speedup); model when absent.",
     f"measured: {_RESULTS}/decode.json when present; otherwise model"),
    ("nbattn.plots.paper", "build_breakeven", "planning_breakeven",
     "Break-even of planning, L*(u - v) > p + h: the fewest layers that amortize a "
     "plan cost p for several per-layer savings u - v, against the 32 layers of Llama 3.1 "
     "8B and 80 of 70B. The plan runs on the CPU; its measured cost (range and median of "
     f"the plan_us records) is marked when {_RESULTS}/sched.json or sched_cpu.json has it, "
     "and labelled as a CPU time even when the file comes from a GPU machine.",
     f"model; measured plan cost: {_RESULTS}/sched.json or sched_cpu.json (CPU time)"),
    ("nbattn.plots.paper", "build_amdahl", "amdahl",
     "Amdahl curves: whole-step speedup when attention is a fraction f of the step and "
     "gets k x faster. Beside them, the paper's load-balancing ablation (Llama 3.1 "
     "8B, H100) as step speedups: ITL -2.18% ShareGPT (1.02x), -2.49% short-variable "
     "(1.03x), -37.87% long-variable (1.61x).",
     "model + paper"),
    # Written by the scheduler engineer (nbattn.plots.sched); data from nbattn.sched.
    ("nbattn.plots.sched", "gantt", "sched_gantt",
     "Per-CTA work queues of an LPT plan as a Gantt chart (below), beside the same step "
     "with no request split (above), both simulated with the planner's cost model (not a "
     "measurement), with the makespan bound max(sum t / C, max t). Paper: "
     "load balancing cuts ITL by 2.18% (ShareGPT), 2.49% (short-variable), 37.87% "
     "(long-variable).",
     "model: nbattn.sched planner and simulator", _sched_gantt),
    ("nbattn.plots.sched", "reduction_map", "sched_reduction_map",
     "Reduction map of a plan: for each output row, the ordered partial states merged "
     "with the merge operator (fixed order, no atomics).",
     "model: nbattn.sched planner", _sched_reduction_map),
    ("nbattn.plots.sched", "policy_utilization", "sched_policy_utilization",
     "SM utilization and makespan of one-request-per-CTA, fixed-split (FlashDecoding) and "
     "LPT policies on constant, Variable (512-2048) and skewed workloads.",
     "model: nbattn.sched simulator", _sched_policy_utilization),
    ("nbattn.plots.sched", "measured_utilization", "sched_measured_utilization",
     "The paper's Figure 8 counterpart, measured: decode bandwidth utilization (bytes over the "
     "same-run copy bandwidth) or TFLOP/s (mixed prefill + decode) per workload and scheduling "
     "policy (one request per CTA, fixed splits, LPT with the fitted cost model, the wrapper's "
     "default plan, the paper's rule), one panel per batch size; hatched: SDPA flash / cuDNN on "
     "the padded dense batch in the same run (timing peers). Policies a file lacks read "
     f"\"not measured\". Values: {_RESULTS}/sched.json.",
     f"measured: {_RESULTS}/sched.json (GPU named in the file)", _sched_measured),
    ("nbattn.plots.sched", "ablation_table", "sched_ablation",
     "The paper's load-balancing ablation, measured: each fixed policy's kernel time over LPT's "
     "per workload and batch (above 1: LPT faster; amber: LPT within 3%, issue 21's target). "
     f"Values: {_RESULTS}/sched.json (latency_us).",
     f"measured: {_RESULTS}/sched.json (GPU named in the file)", _sched_measured),
    ("nbattn.plots.sched", "prediction_vs_measured", "sched_prediction",
     "The simulator beside the measurement: the kernel time the simulator predicts under the "
     "fitted cost model (nbattn.sched.cost, benchmarks/results/cost_fit.json) against the "
     "measured one, and the relative error per workload (shaded: within 15%). Values: "
     f"{_RESULTS}/sched.json (predicted_us).",
     f"model fitted to the GPU + measured: {_RESULTS}/sched.json, cost_fit.json", _sched_measured),
    # Written by the layout engineer (nbattn.plots.layout); data from nbattn.layout.
    ("nbattn.plots.layout", "page_table_bsr", "layout_page_table_bsr",
     "Paper Figure 2: a paged KV table seen as a block-sparse (BSR) matrix with "
     "B_c = page_size, on the example batch of nbattn demo.",
     "model: nbattn.layout"),
    ("nbattn.plots.layout", "composable_formats", "layout_composable_formats",
     "Paper Figure 3: composable formats, one shared-prefix view with a large B_r and "
     "per-request unique-suffix views of the same pages.",
     "model: nbattn.layout"),
    ("nbattn.plots.layout", "causal_mask", "layout_causal_mask",
     "Bottom-right aligned causal mask for ragged requests: a decode row sees "
     "every key, row i of a Q-row request sees K - Q + i + 1 keys.",
     "model: nbattn.layout"),
]

# Modules of this package whose failure to import is a bug to surface, not skip.
_OWN_MODULES = {"nbattn.plots.roofline", "nbattn.plots.paper"}


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    modules: dict[str, object] = {}
    self_registered: set[str] = set()
    for module, func, name, caption, source, *adapter in _BUILTIN:
        if module not in modules:
            before = set(_REGISTRY)
            modules[module] = _import(module)
            if any(getattr(_REGISTRY[n].builder, "__module__", None) == module
                   for n in set(_REGISTRY) - before):
                self_registered.add(module)
        mod = modules[module]
        if mod is None or module in self_registered:
            continue  # absent, or it registered its own figures on import
        fn = getattr(mod, func, None)
        if fn is None:
            warnings.warn(f"figure {name!r} skipped: {module} has no function {func!r}",
                          RuntimeWarning, stacklevel=3)
            continue
        if name in _REGISTRY:
            continue
        builder = fn
        if adapter:
            builder = adapter[0](fn)
            builder.__qualname__ = f"{adapter[0].__name__}({module}.{func})"
        register(name, caption, source)(builder)
    _LOADED = True


def _import(module: str):
    if module in _OWN_MODULES:
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:  # not written yet: nothing to add
            log.debug("figures of %s not available: %s", module, exc)
            return None
        warnings.warn(f"figures of {module} skipped, import failed: {exc!r}",
                      RuntimeWarning, stacklevel=4)
    except Exception as exc:  # noqa: BLE001  (tolerance at import is the contract)
        warnings.warn(f"figures of {module} skipped, import failed: {exc!r}",
                      RuntimeWarning, stacklevel=4)
    return None


def registry() -> list[FigureEntry]:
    """All registered figures, built-in ones first, in registration order."""
    _load()
    return list(_REGISTRY.values())


def figure_names() -> list[str]:
    return [e.name for e in registry()]


def get(name: str) -> FigureEntry:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no figure {name!r}; registered: {sorted(_REGISTRY)}") from None


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------

def _positional_arity(fn) -> int | None:
    """How many positional arguments ``fn`` accepts (None: any number)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    n = 0
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n


def _call_builder(entry: FigureEntry, path: Path, results_root: Path) -> Path:
    # Builders from other modules may take only ``path`` (model-only figures)
    # and may hand back a Figure instead of saving it; both are accepted.
    arity = _positional_arity(entry.builder)
    result = entry.builder(path) if arity == 1 else entry.builder(path, results_root)
    if not path.exists() and hasattr(result, "savefig"):
        from .plots import style

        style.save(result, path)
    if not path.exists():
        raise RuntimeError(f"figure {entry.name!r}: builder "
                           f"{getattr(entry.builder, '__qualname__', entry.builder)} "
                           f"wrote nothing to {path}")
    return path


def build(name: str, outdir: str | Path = "figures",
          results_root: str | Path = _RESULTS, fmt: str = "png") -> Path:
    """Render one registered figure to ``<outdir>/<name>.<fmt>``; returns the path."""
    entry = get(name)
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    return _call_builder(entry, outdir / f"{name}.{fmt}", Path(results_root))


def build_all(outdir: str | Path = "figures", results_root: str | Path = _RESULTS,
              progress: bool = True, names: Iterable[str] | None = None,
              fmt: str = "png") -> list[Path]:
    """Render every registered figure (or those in ``names``); returns the written paths.

    A missing ``results_root`` is fine: each figure then shows its model and
    the "no measured data yet" note.
    """
    entries = registry() if names is None else [get(n) for n in names]
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    root = Path(results_root)
    from tqdm.auto import tqdm

    written = []
    bar = tqdm(entries, desc="figures", unit="fig", disable=not progress)
    for entry in bar:
        bar.set_postfix_str(entry.name)
        written.append(_call_builder(entry, outdir / f"{entry.name}.{fmt}", root))
    return written


# --------------------------------------------------------------------------
# figures/README.md
# --------------------------------------------------------------------------

def render_readme(fmt: str = "png") -> str:
    """Markdown caption list for ``figures/README.md``, one entry per figure.

    Built-in figures are listed whether or not their module imports right now,
    so the README does not depend on which modules happen to be present;
    figures registered by other modules follow.
    """
    entries = {e.name: e for e in registry()}
    rows = [(row[2], row[3], row[4]) for row in _BUILTIN]
    rows += [(e.name, e.caption, e.data_source) for e in entries.values()
             if e.name not in {r[0] for r in rows}]
    lines = [
        "# Figures",
        "",
        "Rendered by `nbattn figures` (or `python -c \"import nbattn.figures as f; "
        "f.build_all()\"`) from the performance models and, where they exist, the "
        "measured result files under `benchmarks/results/`. A figure "
        "whose result file is missing still renders from the model and says "
        "\"no measured data yet\"; no measured number is ever made up. Paper numbers are "
        "those of the FlashInfer paper (arXiv 2501.01005). The `sched_*` and "
        "`layout_*` figures come from `nbattn.plots.sched` and `nbattn.plots.layout` "
        "and are built when those modules import. The documentation site's gallery "
        "shows each figure with the GPU and date of its result files.",
        "",
    ]
    for name, caption, source in rows:
        lines += [f"## `{name}.{fmt}`", "", caption, "", f"**Data source:** {source}", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_readme(path: str | Path = "figures/README.md") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_readme())
    return path
