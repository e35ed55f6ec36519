"""The scheduler's cost model, kept as data (docs/concepts/scheduler.md, "Cost model").

One :class:`CostModel` prices a step for both the planner
(:func:`nbattn.sched.plan`, argument ``cost=``) and the simulator
(:mod:`nbattn.sched.simulate`), so the simulator predicts with the very numbers
the planner planned with.  :class:`CostFit` holds one model per kernel path
(decode warp, decode tensor-core, prefill tile) plus where the numbers came
from; :func:`load_cost_fit` reads it from a fit file written by
``benchmarks/gpu_sched.py`` (``benchmarks/results/cost_fit.json``).

The model
---------
A work item (one query tile of ``l_q`` fused rows against ``l_kv`` keys) costs

* ``chunk_overhead``: a fixed *latency* per item (read the queue entry and the
  first page ids, load the Q tile, fill the pipeline, write the state).  It is
  paid whatever the rest of the GPU does.
* ``alpha*l_q + beta*l_kv``: *streaming work*.  In a full wave (every resident
  CTA slot busy) it takes exactly that long; when only ``n`` of the ``S`` slots
  are still busy, each streams ``min(solo_speedup, S/n)`` times faster, because
  the memory bandwidth the idle slots leave is shared by the busy ones, up to
  what one CTA can pull on its own.  ``solo_speedup = 1`` is the plain additive
  model.

A CTA runs its queue back to back; a slot whose queue holds latency ``lat`` and
work ``w`` finishes at ``lat + T(w)``, where ``T`` integrates the speed-up over
the slots still streaming (:func:`slot_finish`).  That is exact when the latency
does not compete for bandwidth and every slot starts at once, and a first-order
approximation otherwise.

A split tile's merge job costs ``l_q * (merge_cost * partials + merge_row)``;
the jobs run side by side on the merge pass's CTAs.  The pass (a second kernel)
adds ``merge_launch`` when there is at least one merge, plus ``merge_total`` per
partial slot of the whole plan (a price the merges do not share out, if the
kernel has one), and the attention pass adds ``launch``.  The predicted makespan
is::

    launch + max_slot(lat + T(w))
           + [merges] * (merge_launch + merge_total * partials + max merge CTA load)

With ``two_pass`` (the prefill wrapper, which launches the chunks of split tiles
and the unsplit tiles as two kernels, each CTA's queue cut in two), the
attention term is the sum of the two passes' ``max_slot(lat + T(w))``.

"What a wave means": the planner balances over ``num_ctas`` CTAs per KV head,
the slots resident at once.  ``ctas_per_sm`` and ``sm_count`` say how that
number comes about for a path (:meth:`CostModel.resident`).

Candidate search
----------------
``search = "limits"`` keeps the planner's ``chunk_limit="auto"`` exactly as it
was before this model existed (the candidate chunk limits of
:mod:`nbattn.sched.lpt`, ranked by LPT makespan without merge).
``search = "plans"`` ranks whole plans by the predicted makespan above, merge
included (:func:`nbattn.sched.lpt.choose_plan`).

Defaults
--------
Until a GPU fit exists the defaults equal the behaviour before the model: the
class defaults are the simulator's old ``CostModel`` (overhead 32, merge 1 per
partial row), and :data:`DEFAULT_FIT` holds, per path, what the plan/run
wrappers passed the planner (``alpha = beta = 1``; the decode wrappers' item price
of ``nbattn.cuda.tuning.DecodeTuning.plan_chunk_overhead`` = 64 tokens; the
prefill wrapper none), with ``search="limits"`` and no merge term, so a plan
made with :data:`DEFAULT_FIT` is the plan made without it.  Nothing changes
untested: the fitted numbers only act where a caller passes them.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from .lpt import merge_span, slot_finish, work_clock

__all__ = ["CostModel", "CostFit", "DEFAULT_FIT", "PATHS", "SEARCHES", "load_cost_fit",
           "cost_fit_from_dict", "slot_finish", "work_clock", "merge_span"]

PATHS = ("decode_warp", "decode_tc", "prefill")
SEARCHES = ("limits", "plans")


@dataclass(frozen=True)
class CostModel:
    """Per-item, merge and wave costs of one kernel path (module docstring).

    Time is in ``unit`` (``"KV tokens"``: the time to stream one KV token of one
    KV head in a full wave; a fitted model uses ``"us"``)."""

    alpha: float = 1.0
    beta: float = 1.0
    chunk_overhead: float = 32.0
    merge_cost: float = 1.0
    merge_row: float = 0.0
    merge_launch: float = 0.0
    merge_total: float = 0.0
    launch: float = 0.0
    solo_speedup: float = 1.0
    ctas_per_sm: int = 0
    sm_count: int = 0
    search: str = "limits"
    unit: str = "KV tokens"
    two_pass: bool = False

    def __post_init__(self):
        for f in ("alpha", "beta", "chunk_overhead", "merge_cost", "merge_row", "merge_launch", "merge_total",
                  "launch"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"CostModel.{f}: must be a finite number >= 0, got {v!r}")
        if not (np.isfinite(self.solo_speedup) and self.solo_speedup >= 1.0):
            raise ValueError(f"CostModel.solo_speedup: must be >= 1, got {self.solo_speedup!r}")
        for f in ("ctas_per_sm", "sm_count"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"CostModel.{f}: must be an int >= 0, got {v!r}")
        if not isinstance(self.two_pass, (bool, np.bool_)):
            raise ValueError(f"CostModel.two_pass: must be a bool, got {self.two_pass!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"CostModel.search: must be one of {SEARCHES}, got {self.search!r}")

    def replace(self, **changes) -> "CostModel":
        return replace(self, **changes)

    def chunk_time(self, l_q, l_kv):
        """Item time in a full wave: ``chunk_overhead + alpha*l_q + beta*l_kv``."""
        return self.chunk_overhead + self.alpha * np.asarray(l_q, dtype=np.float64) \
            + self.beta * np.asarray(l_kv, dtype=np.float64)

    def work_time(self, l_q, l_kv):
        """The streaming part of an item, ``alpha*l_q + beta*l_kv`` (speeds up in the tail)."""
        return self.alpha * np.asarray(l_q, dtype=np.float64) + self.beta * np.asarray(l_kv, dtype=np.float64)

    def merge_time(self, rows, partials):
        """A split tile's merge job: ``rows * (merge_cost * partials + merge_row)``."""
        return np.asarray(rows, dtype=np.float64) * (self.merge_cost * np.asarray(partials, dtype=np.float64)
                                                     + self.merge_row)

    def resident(self, head_blocks: int = 1) -> int | None:
        """CTA slots per KV-head block resident at once (``ctas_per_sm * sm_count //
        head_blocks``), or None when the model does not say."""
        if not (self.ctas_per_sm and self.sm_count):
            return None
        return max(1, self.ctas_per_sm * self.sm_count // max(int(head_blocks), 1))

    def params(self) -> tuple:
        """The numbers the compiled planner takes, in its argument order."""
        return (float(self.alpha), float(self.beta), float(self.chunk_overhead), float(self.merge_cost),
                float(self.merge_row), float(self.merge_launch), float(self.merge_total), float(self.launch),
                float(self.solo_speedup), float(self.two_pass))


@dataclass(frozen=True)
class CostFit:
    """One :class:`CostModel` per kernel path, and where the numbers came from."""

    decode_warp: CostModel = field(default_factory=lambda: CostModel(chunk_overhead=64.0, merge_cost=0.0))
    decode_tc: CostModel = field(default_factory=lambda: CostModel(chunk_overhead=64.0, merge_cost=0.0))
    prefill: CostModel = field(default_factory=lambda: CostModel(chunk_overhead=0.0, merge_cost=0.0))
    gpu: str = ""
    commit: str = ""
    date: str = ""
    source: str = ("defaults: the planner's behaviour before the cost model (alpha = beta = 1, "
                   "decode item price 64 tokens, no merge term, search='limits'); not a measurement")

    def for_path(self, path: str) -> CostModel:
        """The model of ``path``: one of :data:`PATHS`, or a decode kernel path
        (``"warp"``, ``"tc"``; the teaching ``"smem"`` path takes the warp model)."""
        name = {"warp": "decode_warp", "tc": "decode_tc", "smem": "decode_warp"}.get(path, path)
        if name not in PATHS:
            raise ValueError(f"path: must be one of {PATHS} or warp/tc/smem, got {path!r}")
        return getattr(self, name)

    @property
    def measured(self) -> bool:
        return bool(self.gpu)

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "commit": self.commit, "date": self.date, "source": self.source,
                **{p: asdict(getattr(self, p)) for p in PATHS}}


DEFAULT_FIT = CostFit()
"""The models the planner used before any fit: plans made with them equal plans made without."""


def cost_fit_from_dict(obj: dict, source: str = "") -> CostFit:
    """A :class:`CostFit` from a fit file's ``"fit"`` object (unknown keys are refused)."""
    names = {f.name for f in fields(CostModel)}
    models = {}
    for p in PATHS:
        if p not in obj:
            models[p] = getattr(DEFAULT_FIT, p)
            continue
        d = dict(obj[p])
        bad = set(d) - names
        if bad:
            raise ValueError(f"{source or 'cost fit'}: {p} has unknown fields {sorted(bad)}")
        models[p] = CostModel(**d)
    return CostFit(**models, gpu=str(obj.get("gpu", "")), commit=str(obj.get("commit", "")),
                   date=str(obj.get("date", "")), source=str(obj.get("source", source)))


def load_cost_fit(path) -> CostFit:
    """Read a fit file: the ``cost_fit`` result suite ``benchmarks/gpu_sched.py`` writes
    (``benchmarks/results/cost_fit.json``; the probes are its records, the fitted
    models its ``"fit"`` object, which names the GPU and commit it was measured at)."""
    path = Path(path)
    obj = json.loads(path.read_text())
    if "fit" not in obj:
        raise ValueError(f"{path}: no 'fit' object (is this a cost_fit.json?)")
    fit = dict(obj["fit"])
    fit.setdefault("gpu", obj.get("gpu", ""))
    fit.setdefault("date", obj.get("date", ""))
    fit.setdefault("source", str(path))
    return cost_fit_from_dict(fit, str(path))
